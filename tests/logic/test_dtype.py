"""The engines' `native` dtype: bf16 only where the device multiplies bf16 matrices in hardware."""

from __future__ import annotations

import pytest

from pdserve_core.engine.dtype import cpu_flags, native_dtype, resolve

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GENOA = "flags\t\t: avx2 avx512f avx512_bf16\n"
NEOVERSE_V1 = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm sve\n"
NEOVERSE_N1 = "processor\t: 0\nFeatures\t: fp asimd crc32 atomics\n"


def test_flags_are_read_from_the_first_cpu():
    assert cpu_flags(ZEN3) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert "bf16" in cpu_flags(NEOVERSE_V1)
    assert cpu_flags("") == set()


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [
        (ZEN3, "float32"),
        (SAPPHIRE_RAPIDS, "bfloat16"),
        (GENOA, "bfloat16"),
        (NEOVERSE_V1, "bfloat16"),
        (NEOVERSE_N1, "float32"),
        ("", "float32"),
    ],
)
def test_a_cpu_takes_bf16_only_with_bf16_instructions(cpuinfo, expected):
    assert native_dtype(gpu=False, cpuinfo=cpuinfo) == expected


def test_a_gpu_takes_bf16_whatever_its_host_cpu():
    assert native_dtype(gpu=True, cpuinfo=ZEN3) == "bfloat16"


def test_only_native_is_resolved():
    for explicit in ("bfloat16", "float16", "float32", "auto"):
        assert resolve(explicit, gpu=False) == explicit
    assert resolve("native", gpu=True) == "bfloat16"
    assert resolve("native", gpu=False) in ("bfloat16", "float32")
