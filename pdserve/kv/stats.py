"""KV transfer statistics: counted in the worker, carried to the engine's stat loggers by vLLM.

`TransferStats` is what a worker accumulates between two engine steps (counters as deltas,
gauges as the latest value, and one (bytes, seconds) record per finished transfer).
`PDServeKVStats` wraps it in vLLM's `KVConnectorStats` shape so it rides vLLM's own path
(worker → scheduler → `SchedulerStats.kv_connector_stats` → stat loggers), where the engine
actor totals it (`KVStatsTotals`) for the metrics.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

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


class TransferStats:
    """Thread-safe accumulator in one worker (pulls run on helper threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._transfers: list[tuple[int, float]] = []
        self._failed: list[tuple[str, str, str]] = []
        self.in_flight = 0

    def count(self, name: str, amount: int | float = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def failure(self, reason: str, request_id: str | None = None, message: str = "") -> None:
        with self._lock:
            self._counters[f"failures_{reason}"] += 1
            if request_id is not None:
                self._failed.append((request_id, reason, message))

    def transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._counters[f"bytes_{direction}"] += nbytes
            self._counters[f"transfers_{direction}"] += 1
            self._counters[f"seconds_{direction}"] += seconds
            if direction == "received":
                self._transfers.append((nbytes, seconds))

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def ended(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def snapshot(self, gauges: dict[str, float]) -> dict[str, Any] | None:
        """Take the deltas since the last snapshot (None when nothing happened or changed)."""
        with self._lock:
            gauges = {**gauges, "in_flight": self.in_flight}
            data = {
                "counters": dict(self._counters),
                "transfers": list(self._transfers),
                "failed_requests": list(self._failed),
                "gauges": gauges,
            }
            self._counters.clear()
            self._transfers.clear()
            self._failed.clear()
        return data


@dataclass
class PDServeKVStats(KVConnectorStats):
    """vLLM-facing wrapper: `data` is one `TransferStats.snapshot`, possibly aggregated."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data or (
            not self.data.get("counters")
            and not self.data.get("transfers")
            and not any(self.data.get("gauges", {}).values())
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = Counter(self.data.get("counters", {}))
        merged.update(other.data.get("counters", {}))
        gauges = Counter(self.data.get("gauges", {}))
        gauges.update(other.data.get("gauges", {}))
        self.data = {
            "counters": dict(merged),
            "transfers": [*self.data.get("transfers", []), *other.data.get("transfers", [])],
            "failed_requests": [
                *self.data.get("failed_requests", []),
                *other.data.get("failed_requests", []),
            ],
            "gauges": dict(gauges),
        }
        return self

    def reduce(self) -> dict[str, int | float]:
        counters = self.data.get("counters", {})
        return {**counters, **self.data.get("gauges", {})}


@dataclass
class KVStatsTotals:
    """Running totals for one engine, fed with every `kv_connector_stats` dict vLLM reports."""

    counters: Counter = field(default_factory=Counter)
    gauges: dict[str, float] = field(default_factory=dict)
    failed_requests: dict[str, tuple[str, str]] = field(default_factory=dict)
    """vLLM request id -> (reason, message) of recent failed pulls."""

    def observe(self, data: dict[str, Any] | None) -> None:
        if not data:
            return
        self.counters.update(data.get("counters", {}))
        self.gauges.update(data.get("gauges", {}))
        for request_id, reason, message in data.get("failed_requests", []):
            self.failed_requests[request_id] = (reason, message)
        while len(self.failed_requests) > 1000:
            self.failed_requests.pop(next(iter(self.failed_requests)))

    def failure_of(self, request_id: str) -> tuple[str, str] | None:
        """Why the pull for `request_id` (the caller's id; vLLM adds a suffix) failed, if known."""
        for internal, why in reversed(self.failed_requests.items()):
            if internal == request_id or internal.startswith(request_id + "-"):
                return why
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "gauges": dict(self.gauges),
        }
