"""Collective data planes: block bytes over a two-rank communicator per producer/consumer pair.

The plane's logic is the same whatever library moves the bytes; a `Backend` is the thin layer
that differs: `nccl` (GPU caches, nccl.py) and `gloo` (CPU caches, gloo.py — the same plane on
any machine, which is how its logic runs in CI).

Pairing is lazy: on its first pull from a producer, a consumer worker makes a pair id
(`Backend.new_id`) and sends it in the Handshake; both sides then join a two-rank communicator
(producer rank 0, consumer rank 1) and keep it, named by a pair key (a digest of the id), for
later pulls, which send the key instead. One pull at a time uses a communicator (a lock on each
side), so sends and receives pair up in order: one message per block of every layer, in the same
order on both sides. (Per block, not per run of consecutive blocks: the two sides' runs differ —
remote blocks 1, 2, 7 may land in local blocks 0, 3, 4 — and a collective's send and receive
must be the same size.)

Deadlines on every wait: joining (a peer that never joins), taking the pair's lock (a pull that
hangs), and the transfer itself. A wait past its deadline aborts the pair's communicator and
forgets it on that side (the next pull pairs afresh; the other side, whose own wait then fails
or whose key is unknown, does the same), and the pull fails as a timeout, which the decode
node's failure policy handles.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pdserve_core.kv.transport.plane import DataPlane
from pdserve_core.kv.wire import ProtocolError, TransferError

logger = logging.getLogger(__name__)

PRODUCER_RANK, CONSUMER_RANK = 0, 1
JOIN_TIMEOUT_S = 10.0
"""How long joining a communicator may take when the caller gives no deadline."""
POLL_S = 0.0005


def pair_key(pair_id: bytes) -> bytes:
    return hashlib.sha256(pair_id).digest()[:16]


class Backend(ABC):
    """The library under a collective plane: ids, communicators, transfers, abort."""

    id_bytes: int = 128
    """Length of a pair id on the wire (the Handshake's `nccl_unique_id`)."""

    @abstractmethod
    def new_id(self, local_host: str) -> bytes:
        """Consumer, first contact: a fresh pair id (`local_host`: this side's address as the
        producer sees it)."""

    @abstractmethod
    def join(self, pair_id: bytes, rank: int, local_host: str, deadline: float) -> Any:
        """Join the two-rank communicator of `pair_id` as `rank`; returns once both joined, or
        raises TimeoutError at `deadline` (monotonic)."""

    @abstractmethod
    def move(self, comm: Any, runs: list[Any], peer_rank: int, send: bool, deadline: float):
        """Send (or receive into) these contiguous byte tensors, in order; TimeoutError past
        `deadline`."""

    @abstractmethod
    def abort(self, comm: Any) -> None:
        """Tear the communicator down (pending operations end)."""


@dataclass
class Link:
    """One two-rank communicator and the lock that keeps its operations in order."""

    comm: Any
    peer_rank: int
    key: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)


def wait_until(done: Callable[[], bool], deadline: float) -> None:
    """Poll `done` until it is true, or raise TimeoutError at `deadline` (monotonic)."""
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("collective transfer passed its deadline")
        time.sleep(POLL_S)


def call_before(deadline: float, call: Callable[[], Any], what: str) -> Any:
    """`call()` in a helper thread, its result if it returns before `deadline`; otherwise
    TimeoutError (for library calls that cannot be given a deadline of their own; the thread is
    left to end when the call does)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as error:  # handed to the waiting thread
            box["error"] = error

    thread = threading.Thread(target=run, name=f"pdserve-{what}", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise TimeoutError(f"{what} passed its deadline")
    if "error" in box:
        raise box["error"]
    return box["result"]


class Pairing:
    """The pairing state of one worker over `backend`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._by_peer: dict[tuple[str, int], tuple[bytes, Link | None]] = {}
        self._by_key: dict[bytes, Link] = {}

    def consumer_fields(self, peer: tuple[str, int], local_host: str = "") -> dict[str, bytes]:
        with self._lock:
            known = self._by_peer.get(peer)
            if known and known[1] is not None:
                return {"nccl_pair_key": known[0]}
            pair_id = self.backend.new_id(local_host)
            self._by_peer[peer] = (pair_key(pair_id), None)
            return {"nccl_unique_id": pair_id}

    def consumer_link(
        self,
        peer: tuple[str, int],
        fields: dict[str, bytes],
        local_host: str = "",
        deadline: float | None = None,
    ) -> Link:
        if "nccl_pair_key" in fields:
            return self._by_key[fields["nccl_pair_key"]]
        pair_id = fields["nccl_unique_id"]
        link = self._join(pair_id, CONSUMER_RANK, PRODUCER_RANK, local_host, deadline)
        with self._lock:
            self._by_peer[peer] = (pair_key(pair_id), link)
        return link

    def producer_link(
        self, fields: dict[str, bytes], local_host: str = "", deadline: float | None = None
    ) -> Link:
        """`fields`: the consumer's pairing fields from its Handshake (an id or a pair key)."""
        pair_id = fields.get("nccl_unique_id")
        if pair_id:
            if len(pair_id) != self.backend.id_bytes:
                raise ProtocolError(f"nccl_unique_id must be {self.backend.id_bytes} bytes")
            return self._join(pair_id, PRODUCER_RANK, CONSUMER_RANK, local_host, deadline)
        with self._lock:
            link = self._by_key.get(fields.get("nccl_pair_key", b""))
        if link is None:
            raise ProtocolError("unknown pair key: the consumer must pair again")
        return link

    def _join(
        self, pair_id: bytes, rank: int, peer_rank: int, local_host: str, deadline: float | None
    ) -> Link:
        deadline = deadline if deadline is not None else time.monotonic() + JOIN_TIMEOUT_S
        comm = self.backend.join(pair_id, rank, local_host, deadline)
        link = Link(comm, peer_rank, pair_key(pair_id))
        with self._lock:
            self._by_key[link.key] = link
        return link

    def forget(self, peer: tuple[str, int]) -> None:
        with self._lock:
            self._by_peer.pop(peer, None)

    def abort(self, link: Link) -> None:
        """Tear a stalled pair down: its communicator aborted, both sides forgotten."""
        with self._lock:
            self._by_key.pop(link.key, None)
            for peer in [p for p, (key, _) in self._by_peer.items() if key == link.key]:
                del self._by_peer[peer]
        try:
            self.backend.abort(link.comm)
        except Exception as error:  # it is being discarded either way
            logger.warning("aborting a %s communicator: %r", type(self.backend).__name__, error)


class CollectivePlane(DataPlane):
    """A data plane whose bytes move on a paired two-rank communicator (`make_backend`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pairing = Pairing(self.make_backend())

    @abstractmethod
    def make_backend(self) -> Backend: ...

    def consumer_pairing(self, peer, local_host: str = ""):
        return self.pairing.consumer_fields(peer, local_host)

    def consumer_link(self, peer, pairing, local_host: str = "", deadline: float | None = None):
        try:
            return self.pairing.consumer_link(peer, pairing, local_host, deadline)
        except Exception as error:
            self.pairing.forget(peer)
            raise TransferError("handshake", f"pairing with {peer} failed: {error}") from None

    def producer_link(self, pairing, local_host: str = "", deadline: float | None = None):
        return self.pairing.producer_link(pairing, local_host, deadline)

    def runs(self, block_ids: list[int]) -> Iterator[Any]:
        """One slice per block, layer by layer: the same message sizes on both sides."""
        for layer in self.layers:
            for block in block_ids:
                yield layer[block : block + 1]

    def _move(self, runs: Iterator[Any], link: Link, send: bool, deadline: float) -> None:
        if not link.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the pair is busy past the deadline")
        import torch

        try:
            flat = [run.reshape(-1).view(torch.uint8) for run in runs]
            self.pairing.backend.move(link.comm, flat, link.peer_rank, send, deadline)
        except BaseException:
            self.pairing.abort(link)
            raise
        finally:
            link.lock.release()

    def send_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        self._move(self.runs(blocks), link, True, deadline)

    def recv_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        self._move(self.runs(blocks), link, False, deadline)
