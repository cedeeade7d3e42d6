"""KV transfer statistics: counted in the worker, carried to the engine's stat loggers by vLLM.

`TransferStats` is what a worker accumulates between two engine steps; `snapshot()` turns it into
the plain dict vLLM carries (worker → scheduler → `SchedulerStats.kv_connector_stats` → stat
loggers; `pdserve_core.kv.connector.PDServeKVStats` is the vLLM-facing wrapper). The engine actor
folds every snapshot into `KVTotals`, which crosses Ray with the node's stats. The dict's keys
are the field names of `KVCounters` and `KVGauges`, written and read only in this module.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any

FAILURE_REASONS = (
    "connect",
    "auth",
    "handshake",
    "unknown_request",
    "lease_expired",
    "bad_blocks",
    "connection_reset",
    "timeout",
    "bad_handle",
)


@dataclass
class KVCounters:
    """Counters of one worker or engine (deltas in a snapshot, totals in `KVTotals`)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_sent: float = 0.0
    seconds_received: float = 0.0
    transfers_sent: int = 0
    transfers_received: int = 0
    leases_expired: int = 0
    """Offers whose lease ended before a completed pull (their blocks were freed)."""
    releases: int = 0
    """Handles a consumer gave back unread because it had every block cached."""
    blocks_received: int = 0
    """Blocks a consumer loaded from a producer (pulled, or copied from a prefetch)."""
    blocks_cached: int = 0
    """Blocks of handed-over prompts a consumer had in its own prefix cache: not loaded."""
    prefetches_used: int = 0
    """Pulls served from KV streamed while the prefill ran (decode_node/staging.py)."""
    prefetches_missed: int = 0
    """Prefetches that could not serve their pull (failed, unfinished, not the handle's)."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed pulls by reason (FAILURE_REASONS)."""

    def add(self, other: KVCounters) -> None:
        for f in fields(self):
            if f.name != "failures":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for reason, count in other.failures.items():
            self.failures[reason] = self.failures.get(reason, 0) + count

    def is_zero(self) -> bool:
        return self == KVCounters()


@dataclass
class KVGauges:
    in_flight: int = 0
    """Pulls in progress (consumer)."""
    blocks_held: int = 0
    """Blocks kept for consumers under leases (producer)."""
    requests_held: int = 0

    def add(self, other: KVGauges) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class KVTotals:
    """One engine's KV transfer totals and latest gauges, as the router sees them."""

    counters: KVCounters = field(default_factory=KVCounters)
    gauges: KVGauges = field(default_factory=KVGauges)

    def observe(self, snapshot: dict[str, Any] | None) -> list[tuple[str, str, str]]:
        """Fold one (possibly aggregated) snapshot in; returns its failed pulls as
        (request id, reason, message)."""
        if not snapshot:
            return []
        self.counters.add(KVCounters(**snapshot["counters"]))
        self.gauges = KVGauges(**snapshot["gauges"])
        return [tuple(item) for item in snapshot.get("failed_requests", ())]


def merge_snapshots(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two workers' snapshots as one (tensor-parallel ranks of one engine)."""
    if not a or not b:
        return dict(a or b or {})
    counters, other = KVCounters(**a["counters"]), KVCounters(**b["counters"])
    counters.add(other)
    gauges = KVGauges(**a["gauges"])
    gauges.add(KVGauges(**b["gauges"]))
    return {
        "counters": asdict(counters),
        "gauges": asdict(gauges),
        "failed_requests": [*a.get("failed_requests", ()), *b.get("failed_requests", ())],
    }


class TransferStats:
    """Thread-safe accumulator in one worker (pulls and the KV server run on helper threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = KVCounters()
        self._failed: list[tuple[str, str, str]] = []
        self.in_flight = 0

    def transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        """A finished transfer; `direction` is "sent" or "received"."""
        with self._lock:
            c = self._counters
            setattr(c, f"bytes_{direction}", getattr(c, f"bytes_{direction}") + nbytes)
            setattr(c, f"seconds_{direction}", getattr(c, f"seconds_{direction}") + seconds)
            setattr(c, f"transfers_{direction}", getattr(c, f"transfers_{direction}") + 1)

    def failure(self, reason: str, request_id: str | None = None, message: str = "") -> None:
        with self._lock:
            failures = self._counters.failures
            failures[reason] = failures.get(reason, 0) + 1
            if request_id is not None:
                self._failed.append((request_id, reason, message))

    def leases_expired(self, count: int) -> None:
        with self._lock:
            self._counters.leases_expired += count

    def prefetch(self, used: bool) -> None:
        with self._lock:
            if used:
                self._counters.prefetches_used += 1
            else:
                self._counters.prefetches_missed += 1

    def blocks(self, received: int, cached: int) -> None:
        """A hand-over loaded `received` blocks and found `cached` in this engine's cache."""
        with self._lock:
            self._counters.blocks_received += received
            self._counters.blocks_cached += cached

    def released(self) -> None:
        with self._lock:
            self._counters.releases += 1

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def ended(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def snapshot(self, gauges: KVGauges) -> dict[str, Any]:
        """Take the counters since the last snapshot, with the current gauges."""
        with self._lock:
            gauges = KVGauges(self.in_flight, gauges.blocks_held, gauges.requests_held)
            data = {
                "counters": asdict(self._counters),
                "gauges": asdict(gauges),
                "failed_requests": list(self._failed),
            }
            self._counters = KVCounters()
            self._failed.clear()
        return data


def is_empty(snapshot: dict[str, Any] | None) -> bool:
    """Nothing counted and every gauge at zero."""
    return not snapshot or (
        KVCounters(**snapshot["counters"]).is_zero()
        and not snapshot.get("failed_requests")
        and KVGauges(**snapshot["gauges"]) == KVGauges()
    )
