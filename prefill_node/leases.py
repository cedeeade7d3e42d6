"""Blocks a producer holds for consumers, under leases.

Life of an offer (producer worker process):
1. The scheduler side finishes a prefill and keeps its blocks; the next step's metadata tells the
   worker, which calls `offer(request_id, block_ids, deadline)`.
2. A consumer's pull `claim`s the offer (waiting briefly if the pull outran the metadata), reads
   the blocks, and `release`s it. An offer allows `readers` completed pulls (1 usually; n when a
   request's n sequences decode from one prefill): after the last, its blocks may be freed.
3. An offer nobody completes before its deadline expires in `collect_done`; an offer that is
   being read never expires under the reader (no block is freed while it is read).
A pull may outrun step 1 (the worker hears of an offer one engine step after the handle left):
it then carries the scheduler's signed lease (`grant`), which stands in for the offer; the
notice that comes later for a request already settled is ignored. A settled request is
remembered until its lease's deadline has passed, so no replayed lease can revive it (after
the deadline the lease itself is refused).
`collect_done` hands the finished request ids to vLLM (`finished_sending`), which frees the blocks.
4. The router may `abandon` an offer nobody will read (its client left between the prefill and
   the decode leg): it is done at once — freed at the next collection, or when the pull reading
   it ends. An abandon that outruns the offer is remembered until the offer comes.
5. The prefill node may `abandon_leg` when the router stopped a prefill leg before its end (the
   client left, or its deadline passed): the router never got the handle and cannot give it
   back, yet vLLM may have finished the prefill and kept its KV an instant before. The engine
   knows the request by the leg's id plus a suffix of its own (`of_leg`); whatever it kept for
   that leg is abandoned, now or when its offer comes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

SETTLED_GRACE_S = 60.0
"""How long past its deadline a settled request is remembered (a late pull hears "expired")."""
MAX_ABANDONED = 4096
"""Abandons remembered for offers not yet heard of (each until its lease's deadline)."""


ENGINE_SUFFIX_LEN = 8
"""vLLM's engine names a request `<id>-<8 random hex digits>` (or `<id>` with its request id
randomization turned off)."""


def suffixed_leg(request_id: str) -> str | None:
    """The leg id the engine's request `request_id` names with vLLM's suffix, if it has one."""
    head, dash, tail = request_id.rpartition("-")
    return head if dash and len(tail) == ENGINE_SUFFIX_LEN else None


def of_leg(request_id: str, leg_id: str) -> bool:
    """Whether the engine's request `request_id` is the one vLLM made of the leg `leg_id`."""
    return request_id == leg_id or suffixed_leg(request_id) == leg_id


class ClaimError(Exception):
    """Why a pull cannot be served: `reason` is unknown_request, lease_expired or bad_blocks."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Offer:
    block_ids: tuple[int, ...]
    deadline: float
    reads_left: int = 1
    """Completed pulls still allowed."""
    reading: int = 0
    """Pulls in progress."""

    @property
    def done(self) -> bool:
        return self.reads_left <= 0


class ProducerTable:
    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._offers: dict[str, _Offer] = {}
        self._settled: dict[str, tuple[bool, float]] = {}
        """Request id -> (its lease expired, its deadline), kept until past the deadline."""
        self._abandoned: dict[str, float] = {}
        """Request id -> its lease's deadline, for abandons that came before the offer."""
        self._abandoned_legs: dict[str, float] = {}
        """Leg id -> until when an offer of it is abandoned on arrival."""
        self._cond = threading.Condition()
        self.leases_expired = 0

    def offer(
        self, request_id: str, block_ids: list[int], deadline: float, readers: int = 1
    ) -> None:
        with self._cond:
            if request_id not in self._offers and request_id not in self._settled:
                abandoned = self._abandoned.pop(request_id, None) is not None
                abandoned |= self._leg_abandoned(request_id)
                reads = 0 if abandoned else readers
                self._offers[request_id] = _Offer(tuple(block_ids), deadline, reads)
            self._cond.notify_all()

    def abandon(self, request_id: str, deadline: float) -> None:
        """Nobody will read this offer: no further pull may claim it, and its blocks go at the
        next collection (or when a pull reading them now ends)."""
        with self._cond:
            offer = self._offers.get(request_id)
            if offer is not None:
                offer.reads_left = 0
            elif request_id not in self._settled and len(self._abandoned) < MAX_ABANDONED:
                self._abandoned[request_id] = deadline

    def abandon_leg(self, leg_id: str, until: float) -> int:
        """The router stopped the leg `leg_id` before its end: nobody will read what the engine
        kept for it. Abandons its offer (see `abandon`), or the one that comes before `until`
        (wall clock); returns the offers abandoned now."""
        with self._cond:
            found = [rid for rid in self._offers if of_leg(rid, leg_id)]
            for rid in found:
                self._offers[rid].reads_left = 0
            if not found and len(self._abandoned_legs) < MAX_ABANDONED:
                self._abandoned_legs[leg_id] = until
            return len(found)

    def _leg_abandoned(self, request_id: str) -> bool:
        """Whether the offer `request_id` is of a leg abandoned before it came (forgotten now)."""
        if not self._abandoned_legs:
            return False
        legs = (request_id, suffixed_leg(request_id))
        return any(self._abandoned_legs.pop(leg, None) is not None for leg in legs if leg)

    def claim(
        self,
        request_id: str,
        block_ids: list[int],
        wait_s: float,
        grant: tuple[list[int], float, int] | None = None,
    ) -> None:
        """Mark the offer as being read, after checking it holds `block_ids`. `grant` (blocks
        held, deadline, readers) is a verified lease from the scheduler, used if no offer is known
        yet."""
        give_up = time.monotonic() + wait_s
        with self._cond:
            if grant is not None and request_id not in self._settled:
                blocks, deadline, readers = grant
                self._offers.setdefault(request_id, _Offer(tuple(blocks), deadline, readers))
            while request_id not in self._offers:
                if request_id in self._settled:
                    raise ClaimError("lease_expired", f"lease of {request_id} has ended")
                left = give_up - time.monotonic()
                if left <= 0:
                    raise ClaimError("unknown_request", f"no KV held for request {request_id}")
                self._cond.wait(left)
            offer = self._offers[request_id]
            if offer.done or self._clock() > offer.deadline:
                raise ClaimError("lease_expired", f"lease of {request_id} expired")
            missing = set(block_ids) - set(offer.block_ids)
            if missing:
                raise ClaimError("bad_blocks", f"{request_id} holds no blocks {sorted(missing)}")
            offer.reading += 1

    def release(self, request_id: str, completed: bool) -> None:
        """A read ended; the last completed read the lease allows lets the blocks go."""
        with self._cond:
            offer = self._offers.get(request_id)
            if offer is None:
                return
            offer.reading -= 1
            if completed:
                offer.reads_left -= 1

    def collect_done(self) -> set[str]:
        """Request ids whose blocks may be freed now: completed, or expired with no reader."""
        now = self._clock()
        with self._cond:
            done = {
                rid
                for rid, offer in self._offers.items()
                if offer.reading == 0 and (offer.done or now > offer.deadline)
            }
            for rid in done:
                offer = self._offers.pop(rid)
                self.leases_expired += not offer.done
                self._settled[rid] = (not offer.done, offer.deadline)
            stale = now - SETTLED_GRACE_S
            for rid in [r for r, (_, deadline) in self._settled.items() if deadline < stale]:
                del self._settled[rid]
            for rid in [r for r, deadline in self._abandoned.items() if deadline < now]:
                del self._abandoned[rid]
            for leg in [g for g, until in self._abandoned_legs.items() if until < now]:
                del self._abandoned_legs[leg]
            return done

    def blocks_held(self) -> int:
        with self._cond:
            return sum(len(offer.block_ids) for offer in self._offers.values())

    def requests_held(self) -> int:
        with self._cond:
            return len(self._offers)
