"""Rates over a node's recent stats: the one estimator every reader of a node's speed uses.

The pools' health checks keep each node's recent counters (`Node.history`, router/pools.py); a
`Window` is their rates between the oldest sample within a span and the newest. The balance signal
and the autoscaler (router/metrics/balance.py, router/decides/autoscale.py) read a few checks' span;
placement's prefill rate (router/decides/placement.py) a longer one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve_core.engine.types import NodeStats

COUNTERS = (
    "estimated_flops_total",
    "estimated_bytes_total",
    "busy_seconds_total",
    "prompt_busy_seconds_total",
    "predicted_busy_seconds_total",
    "busy_steps_total",
    "prompt_tokens_computed_total",
    "requests_started_total",
)
"""The stats counters a rate window needs (all a node's history keeps)."""


def counters(stats: NodeStats) -> dict[str, float]:
    return {key: getattr(stats, key) for key in COUNTERS}


@dataclass(frozen=True)
class Window:
    """Rates over a node's recent stats samples (oldest and newest within the window)."""

    seconds: float
    flops: float
    bytes: float
    busy: float
    prompt_busy: float
    predicted_busy: float = 0.0
    """Seconds per second the node's step-time model says its steps cost."""
    steps: float = 0.0
    prompt_tokens: float = 0.0
    """Prompt tokens computed per second."""
    requests: float = 0.0
    """Requests started per second."""

    @classmethod
    def of(cls, history: Sequence[tuple[float, dict]], window_s: float) -> Window | None:
        if len(history) < 2:
            return None
        now, newest = history[-1]
        oldest_t, oldest = next((t, s) for t, s in history if now - t <= window_s)
        if (now - oldest_t) <= 0:
            oldest_t, oldest = history[-2]
        dt = now - oldest_t

        def delta(key: str) -> float:
            return max(0.0, newest.get(key, 0.0) - oldest.get(key, 0.0)) / dt

        return cls(dt, *(delta(key) for key in COUNTERS))
