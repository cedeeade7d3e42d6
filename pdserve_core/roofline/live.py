"""Live utilization: the roofline model applied to what each engine step actually ran.

Every engine step reports how many prompt tokens and decode tokens it processed (vLLM's
iteration details) and how long it took. `step_work` turns that into the FLOPs the step performed
and the bytes it moved, with the same formulas the planner uses (docs/design.md, "Metrics"):
linear layers cost 2·tokens·d_in·d_out FLOPs and read their weights once per step, attention
reads each sequence's KV cache, and new tokens write theirs. Summed over time and divided by the
device's peaks, these give the metrics' compute utilization (achieved FLOP/s ÷ peak FLOP/s),
bandwidth utilization (achieved bytes/s ÷ peak bytes/s) and arithmetic intensity (FLOPs ÷ bytes).

The peaks come from the planner's device catalog on a known GPU, from the config, or — on a CPU,
which has no datasheet entry — from a short measurement when the engine starts (`measure_peaks`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve_core.roofline.specs import ModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepWork:
    flops: float
    bytes: float


@dataclass(frozen=True)
class Peaks:
    """What one node's device can do at most, and where the figures came from."""

    flops: float
    """FLOP/s."""
    mem_bandwidth: float
    """Bytes/s."""
    source: str
    """"catalog:<device>", "config" or "measured"."""


def step_work(
    m: ModelSpec,
    prompt_tokens: int,
    prompt_sequences: int,
    decode_tokens: int,
    decode_sequences: int,
    decode_context_tokens: int,
) -> StepWork:
    """FLOPs and bytes of one engine step.

    `prompt_tokens` were computed for `prompt_sequences` prompts (a prompt chunk attends to itself
    causally); `decode_tokens` new tokens for `decode_sequences` sequences whose KV caches hold
    `decode_context_tokens` tokens together (each decode token attends to its whole sequence).
    """
    from pdserve_core.roofline.stepmodel import step_cost

    cost = step_cost(
        m, prompt_tokens, prompt_sequences, decode_tokens, decode_sequences, decode_context_tokens
    )
    return StepWork(cost.linear_flops + cost.attention_flops, cost.bytes)


def measure_peaks(
    threads: int | None = None, dtype: str = "bfloat16", seconds: float = 0.5
) -> Peaks:
    """Measure this machine's FLOP/s (a matrix product in the engine's `dtype`: on a CPU without
    bf16 instructions a bf16 product is a slow fallback the engine never runs, float32 is what it
    runs) and memory bandwidth (a large copy) with the threads the engine uses. A CPU has no
    datasheet figures in the planner's catalog; the measured ones make its utilization read as
    "share of what this core can do" (the collector raises them to any step that did more:
    pdserve_core/engine/stats.py)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    n = 1024
    kind = getattr(torch, dtype, torch.bfloat16)
    a = torch.randn(n, n, dtype=kind)
    b = torch.randn(n, n, dtype=kind)
    flops_rate = _best_rate(lambda: torch.mm(a, b), 2.0 * n**3, seconds / 2)
    size = 64 * 2**20  # 64 MiB: well past the caches
    src = torch.empty(size, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    bytes_rate = _best_rate(lambda: dst.copy_(src), 2.0 * size, seconds / 2)  # read + write
    peaks = Peaks(flops_rate, bytes_rate, "measured")
    logger.info(
        "measured peaks: %.1f GFLOP/s (%s matmul), %.1f GB/s (copy)",
        peaks.flops / 1e9,
        dtype,
        peaks.mem_bandwidth / 1e9,
    )
    return peaks


def _best_rate(work, amount: float, budget_s: float) -> float:
    """Highest amount/second over repetitions of `work` within `budget_s` (at least 3 runs)."""
    work()  # warm-up
    best, spent, runs = 0.0, 0.0, 0
    while runs < 3 or spent < budget_s:
        started = time.perf_counter()
        work()
        took = time.perf_counter() - started
        best = max(best, amount / took)
        spent += took
        runs += 1
    return best


def resolve_peaks(
    device: str | None = None,
    flops: float | None = None,
    mem_bandwidth: float | None = None,
    threads: int | None = None,
    dtype: str = "bfloat16",
) -> Peaks:
    """This node's peaks: both given in the config; else the catalog entry for `device` (or the
    detected GPU), with any one given figure overriding it; else measured here (a CPU), in the
    engine's `dtype` with its `threads`."""
    from pdserve_core.roofline.serving import detect_device
    from pdserve_core.roofline.specs import DEVICES

    if flops and mem_bandwidth:
        return Peaks(flops, mem_bandwidth, "config")
    name = device or detect_device()
    if name in DEVICES:
        spec = DEVICES[name]
        return Peaks(
            flops or spec.peak_flops, mem_bandwidth or spec.mem_bandwidth, f"catalog:{name}"
        )
    measured = measure_peaks(threads, dtype)
    return Peaks(flops or measured.flops, mem_bandwidth or measured.mem_bandwidth, "measured")
