"""The planner behind `serve`'s defaults: the chunk size for the device the engines run on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pdserve_core.roofline.model import recommended_chunk
from pdserve_core.roofline.specs import DEVICES, model_from_hf_config

logger = logging.getLogger(__name__)

# Substrings of torch.cuda.get_device_name() → catalog names (most specific first).
_CUDA_NAMES = (
    ("H200", "h200"),
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("A100", "a100-sxm-80gb"),
    ("L40S", "l40s"),
    ("B200", "b200"),
)


def detect_device() -> str | None:
    """Catalog name of the local CUDA device, or None (no GPU, or one the catalog lacks)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        cuda_name = torch.cuda.get_device_name(0)
    except Exception:  # torch missing or CUDA broken: no detection, no planner default
        return None
    return next((name for part, name in _CUDA_NAMES if part in cuda_name), None)


VLLM_CPU_CHUNK_TOKENS = 2048
"""vLLM's own chunk on a CPU (its OpenAI server's `max_num_batched_tokens`)."""

CPU_CHUNK_TOKENS = 256
"""Prompt tokens a CPU engine whose steps carry streams (colocated, decode) computes in one step
when the config sets no chunk; vLLM's own default is 2,048. On a CPU a step's cost grows with its
tokens from a few dozen on, so a smaller chunk costs little (a step's fixed part, ≈ 5 ms, against
≈ 150 ms for 256 tokens on a 2-core EPYC), while prompts that arrive together finish one after
another instead of all at the end of one long step, and the streams beside them step between
the chunks. Measured on conversations whose turns come back together (docs/design.md, "Running
on CPUs")."""


VLLM_CPU_BLOCK_TOKENS = 128
"""vLLM's own KV block on a CPU (its `block_size` default there)."""

CPU_BLOCK_TOKENS = 32
"""Tokens per KV block of a CPU engine when the config sets none (`engine.block_size`); vLLM's
own default there is 128. The prefix cache gives back whole blocks only, so a prompt that comes
back with what was computed before (a conversation's next turn: the history, the answer, a new
message) computes again the part of the history past its last whole block: 64 tokens on average
at 128, 16 at 32. The CPU attention kernels take multiples of 32. Every CPU engine takes the same
default, so a prefill engine's blocks and a decode engine's line up. Measured on conversations
(docs/design.md, "Running on CPUs")."""


def cpu_block_size(configured: int | None) -> int:
    """The KV block a CPU engine runs with: the config's, else `CPU_BLOCK_TOKENS`."""
    return configured or CPU_BLOCK_TOKENS


def cpu_chunk_size(configured: int | None, max_num_seqs: int, role: str) -> int | None:
    """The chunk a CPU engine of `role` runs with: the config's; else `CPU_CHUNK_TOKENS` (never
    below `max_num_seqs`, which vLLM requires of a step's token budget) where streams step
    beside the prompts; else None, vLLM's own: on a prefill node no stream waits for a step,
    and vLLM runs a prompt it has begun before the ones waiting, so smaller steps would add
    only their fixed parts."""
    if configured:
        return configured
    return None if role == "prefill" else max(CPU_CHUNK_TOKENS, max_num_seqs)


def default_chunk_size(model_dir: Path, device: str | None, max_num_seqs: int) -> int | None:
    """Planner's chunk size for `device` (detected when None); None keeps vLLM's own default."""
    device = device or detect_device()
    if device is None:
        return None
    if device not in DEVICES:
        raise ValueError(
            f"engine.device {device!r} is not in the planner's catalog: {list(DEVICES)}"
        )
    spec = model_from_hf_config(json.loads((model_dir / "config.json").read_text()), model_dir.name)
    chunk = max(recommended_chunk(spec, DEVICES[device]), max_num_seqs)
    logger.info("chunk size %d tokens from the roofline planner for %s", chunk, device)
    return chunk
