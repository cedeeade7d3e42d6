"""Admission: how many requests the router serves at once (`router.max_outstanding_requests`).

Each admitted request holds one `Slot` until it ends, however it ends (completed, failed,
cancelled by a disconnecting client); `Slot.release` is idempotent, so an edge can release in
every exit path without counting twice. A full router refuses with `Overloaded` (HTTP 429 with
Retry-After, gRPC RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from router.errors import Overloaded


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.outstanding = 0

    def check(self) -> None:
        """`Overloaded` when a request would be refused now."""
        if self.outstanding >= self.limit:
            raise Overloaded(
                f"{self.outstanding} requests in flight (limit {self.limit}); retry later"
            )

    def admit(self) -> Slot:
        self.check()
        self.outstanding += 1
        return Slot(self)


class Slot:
    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.outstanding -= 1
            self._admission = None
