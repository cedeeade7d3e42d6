"""Pool balance (docs/design.md, "Metrics"): a node's **load** is its demand against its capacity,
    load = max(compute pressure, memory pressure) + queue pressure
- compute pressure: the share of wall time the engine spent computing prompt tokens (prefill is
  compute-bound, so this is the compute capacity prompts use up);
- memory pressure: max(KV cache usage, running sequences ÷ max_num_seqs) — decode is bound by the
  KV cache and batch slots it holds, not by time (one more sequence in a decode batch is nearly
  free until memory or slots run out);
- queue pressure: waiting requests ÷ max_num_seqs, demand the node has no room for yet.
A pool's load is the mean over its healthy nodes; ≥ 1 means requests queue. The balance signal is
prefill load ÷ decode load: above 1 the prefill pool is the bottleneck (move the P:D ratio toward
prefill), below 1 the decode pool is.

The same question in calibrated cost (`pdserve_pool_balance_cost_ratio`), each node's steps priced
by its step-time model (pdserve_core.roofline.stepmodel), as the share of its budget its work uses:
- a prefill (or colocated) node: predicted step seconds per second — its compute time (1 while
  it has requests in flight and no step ended in the window: a step longer than the window, as a
  long prompt on a slow CPU takes, is running);
- a decode node: its predicted mean step time ÷ the TPOT target (`router.tpot_target_s`), or
  its batch slots and KV cache if fuller — a decode node is short of capacity when its steps
  approach the time each token may take or it has no room for more streams, not when it is busy
  (it is busy whenever one stream decodes);
- either: plus the requests waiting in its engine ÷ `max_num_seqs` (demand it has no room for).
Pool pressure is the mean over healthy nodes; prefill ÷ decode above 1: prefill is the
bottleneck. This is the signal `router/decides/autoscale.py` acts on.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve_core.engine.types import NodeStats
from router.decides.rates import Window

BALANCE_FLOOR = 0.01
"""Loads below this count as this much in the balance ratio (two idle pools read as 1)."""


def node_load(stats: NodeStats, window: Window | None) -> float:
    """Demand against capacity for one node (see the module docstring)."""
    slots = max(1, stats.max_num_seqs or 1)
    compute = min(1.0, window.prompt_busy) if window else 0.0
    memory = max(stats.kv_cache_usage, stats.running / slots)
    queue = stats.waiting / slots
    return max(compute, memory) + queue


def step_times(window: Window | None) -> tuple[float, float] | None:
    """(measured, predicted) mean step time over the window; None without steps in it."""
    if window is None or window.steps <= 0:
        return None
    return window.busy / window.steps, window.predicted_busy / window.steps


def cost_pressure(
    role: str, window: Window | None, tpot_target_s: float, stats: NodeStats | None = None
) -> float:
    """The share of its budget a node's work uses in calibrated cost (module docstring)."""
    slots = max(1, stats.max_num_seqs or 1) if stats else 1
    queue = stats.waiting / slots if stats else 0.0
    if role == "decode":
        times = step_times(window)
        steps = times[1] / tpot_target_s if times else 0.0
        room = max(stats.kv_cache_usage, stats.running / slots) if stats else 0.0
        return max(steps, room) + queue
    busy = window.predicted_busy if window else 0.0
    if (
        stats
        and stats.requests_started_total > stats.requests_finished_total
        and not (window and window.steps)
    ):
        busy = 1.0  # work in flight and no step ended in the window: one step outlasts it
    return busy + queue


def pool_load(loads: Iterable[float]) -> float | None:
    loads = list(loads)
    return sum(loads) / len(loads) if loads else None


def balance_ratio(prefill_load: float, decode_load: float) -> float:
    return max(prefill_load, BALANCE_FLOOR) / max(decode_load, BALANCE_FLOOR)
