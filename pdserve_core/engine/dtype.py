"""The engines' dtype when the config says `native`: bfloat16 where the device multiplies bf16
matrices in hardware, float32 where it would not.

vLLM's CPU build multiplies bf16 matrices with oneDNN only on CPUs with bf16 instructions
(AVX512-BF16 or AMX on x86, the BF16 extension on Arm). Elsewhere oneDNN cannot build a bf16
matmul and vLLM falls back to torch's generic kernel: measured on an AVX2-only AMD EPYC, one
thread, a 576 × 1536 layer took 7–9× longer in bf16 than in float32 for 8–128 tokens and 1.6×
for one (docs/design.md, "Running on CPUs"). A GPU always takes bf16.

Each engine resolves its own dtype on its own host (`EngineActor.start`); the KV handshake
refuses a pair of engines whose dtypes differ, naming the field, so hosts of different CPUs
need the dtype set explicitly.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

NATIVE = "native"
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""/proc/cpuinfo flags (x86 `flags`, Arm `Features`) of CPUs with bf16 matrix instructions."""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first CPU listed in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def bf16_flags(cpuinfo: str | None = None) -> set[str]:
    """This CPU's bf16 matrix instruction flags. `cpuinfo`: /proc/cpuinfo's text (read here when
    None; an unreadable one has none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    return cpu_flags(cpuinfo) & BF16_FLAGS


def native_dtype(gpu: bool, cpuinfo: str | None = None) -> str:
    """bfloat16 on a GPU or a CPU with bf16 matrix instructions; float32 on any other CPU."""
    if gpu:
        return "bfloat16"
    return "bfloat16" if bf16_flags(cpuinfo) else "float32"


def resolve(dtype: str, gpu: bool) -> str:
    """`dtype` as vLLM takes it: `native` becomes this host's (`native_dtype`)."""
    if dtype != NATIVE:
        return dtype
    resolved = native_dtype(gpu)
    if resolved == "float32":
        logger.info("engine.dtype native: float32 (this CPU has no bf16 matrix instructions)")
    return resolved
