"""Which layers of a running prefill are written, for consumers that follow it (prefetch).

When the router already knows a request's decode node as its prefill starts, the decode node
follows the prefill (`prefetch_key` in the prefill's kv_transfer_params): it connects to this
worker's KV server and receives each layer of the prompt's blocks as soon as the forward has
written it, so on a slow link the KV crosses while the prompt is computed, not after.

Producer worker process, per engine step:
1. `begin_step(writes)` (before the forward): the scheduler's word on which followed requests this
   step computes — their blocks so far and the tokens written in this step. Blocks of a prefix
   the engine had cached are written already: they are ready at once, every layer.
2. `layer_written(index)` after each attention layer (vLLM's `save_kv_layer`): that layer of the
   step's blocks is ready — one piece per followed request.
3. `step_done()` after the forward (`wait_for_save`): a request whose prompt this step finished is
   complete; the follower is told its block ids and goes.
`fail(key, why)` ends a follow early (the prefill was preempted or ended without a hand-over).
Pieces are kept until the follower has read them to the end, or for `KEEP_S` when nobody follows;
at most `MAX_FOLLOWED` prefills at once (the oldest is dropped). Nothing here holds a block: the
lease (leases.py) does that once the prefill ends, and the consumer checks the block ids it was
given against the handle's before it uses what it staged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

KEEP_S = 60.0
"""How long a followed prefill's record lives without being read to its end."""
MAX_FOLLOWED = 256
WAKE_S = 0.5
"""How often a follower waiting for its prefill checks that it is still wanted."""


@dataclass
class StepWrite:
    """Scheduler → worker: this step writes tokens [start, end) of a followed request."""

    request_id: str
    block_ids: list[int]
    """All of the request's blocks so far, in order."""
    start: int
    end: int
    block_size: int
    final: bool
    """This step computes the prompt's last token."""


@dataclass
class Piece:
    layer: int
    first_block: int
    """Its first block's place among the request's blocks."""
    block_ids: tuple[int, ...]
    ready: Any = None
    """A device event to wait on before the bytes are read (None on the CPU)."""


@dataclass
class _Followed:
    request_id: str
    block_ids: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    step: tuple[int, tuple[int, ...]] | None = None
    """(first block's place, block ids) this step writes, until `step_done`."""
    done: bool = False
    error: str = ""
    born: float = field(default_factory=time.monotonic)


class WriteProgress:
    def __init__(self, num_layers: int, event: Any = None) -> None:
        self.num_layers = num_layers
        self._event = event
        """Makes a device event recorded on the current stream (None: CPU caches, none needed)."""
        self._cond = threading.Condition()
        self._followed: dict[str, _Followed] = {}
        self._active: list[str] = []

    def begin_step(self, writes: dict[str, StepWrite]) -> None:
        with self._cond:
            self._expire()
            self._active = []
            for key, write in writes.items():
                entry = self._followed.get(key)
                if entry is None:
                    entry = _Followed(write.request_id)
                    self._followed[key] = entry
                    cached = tuple(write.block_ids[: write.start // write.block_size])
                    if cached:  # a prefix the engine had: written before this prefill
                        layers = range(self.num_layers)
                        entry.pieces += [Piece(layer, 0, cached) for layer in layers]
                if entry.done or entry.error or entry.request_id != write.request_id:
                    continue
                entry.block_ids = list(write.block_ids)
                first = write.start // write.block_size
                end = -(-write.end // write.block_size)
                entry.step = (first, tuple(write.block_ids[first:end]))
                entry.done = write.final  # takes effect in step_done
                self._active.append(key)
            self._cond.notify_all()

    def layer_written(self, layer: int) -> None:
        if not self._active:
            return
        ready = self._event() if self._event is not None else None
        with self._cond:
            for key in self._active:
                entry = self._followed[key]
                first, block_ids = entry.step
                entry.pieces.append(Piece(layer, first, block_ids, ready))
            self._cond.notify_all()

    def step_done(self) -> None:
        if not self._active:
            return
        with self._cond:
            for key in self._active:
                entry = self._followed[key]
                entry.step = None
                entry.born = time.monotonic()
            self._active = []
            self._cond.notify_all()

    def fail(self, key: str, why: str) -> None:
        """End a follow with `why` — also one whose prefill never ran (it was aborted while it
        waited), so its follower does not wait for it until its deadline."""
        with self._cond:
            entry = self._followed.setdefault(key, _Followed(""))
            if not entry.error:
                entry.error = why
                entry.done = False
                if key in self._active:
                    self._active.remove(key)
                self._cond.notify_all()

    def follow(self, key: str, deadline: float, gone=lambda: False):
        """Yield the pieces of `key`'s prefill as they become ready, then the entry itself once
        complete (`done`) or failed (`error`). Raises TimeoutError at `deadline` (monotonic), or
        ConnectionError once `gone()` says the follower left (asked every `WAKE_S` of waiting)."""
        read, entry = 0, None
        with self._cond:
            while True:
                entry = entry or self._followed.get(key)  # kept: expiry cannot take it mid-read
                if entry is not None and read < len(entry.pieces):
                    pieces, read = entry.pieces[read:], len(entry.pieces)
                    self._cond.release()  # never send while the engine's step may need the lock
                    try:
                        yield from pieces
                    finally:
                        self._cond.acquire()
                    continue
                if entry is not None and (entry.error or (entry.done and entry.step is None)):
                    if self._followed.get(key) is entry:
                        del self._followed[key]
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"prefill {key[:8]}… did not finish before the deadline")
                if gone():
                    raise ConnectionError(f"the follower of {key[:8]}… left")
                self._cond.wait(min(left, WAKE_S))
        yield entry

    def followed(self) -> int:
        with self._cond:
            return len(self._followed)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self._followed.items() if now - e.born > KEEP_S]:
            if key not in self._active:
                del self._followed[key]
        while len(self._followed) > MAX_FOLLOWED:
            del self._followed[next(iter(self._followed))]
