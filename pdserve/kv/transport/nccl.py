"""NCCL data plane: block bytes over a two-rank NCCL communicator per producer/consumer pair.

Pairing is lazy: on its first pull from a producer, a consumer worker creates an ncclUniqueId and
sends it in the Handshake; both join `ncclCommInitRank(2, id, rank)` (producer rank 0, consumer
rank 1) and keep the communicator, named by a pair key (SHA-256 of the id), for later pulls. One
pull at a time uses a communicator (a lock on each side), so sends and receives pair up in order.
Only imported when `transport: nccl` is chosen; needs CUDA caches and libnccl (through vLLM's
NCCL wrapper).

Watchdog: NCCL operations never time out by themselves, and a peer that died leaves them waiting
forever (holding the pair's lock, so every later pull between the two waits too). Each transfer
therefore waits for its CUDA event under the pull's deadline; past it, the pair's communicator
is aborted and forgotten (the next pull pairs afresh), and the pull fails as a timeout, which the
decode node's failure policy handles.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv.transport.plane import DataPlane
from pdserve.kv.wire import ProtocolError, TransferError

logger = logging.getLogger(__name__)

PRODUCER_RANK, CONSUMER_RANK = 0, 1
UNIQUE_ID_BYTES = 128
POLL_S = 0.0005


def pair_key(unique_id: bytes) -> bytes:
    return hashlib.sha256(unique_id).digest()[:16]


@dataclass
class Link:
    """One two-rank communicator and the lock that keeps its operations in order."""

    comm: Any
    peer_rank: int
    key: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pairing:
    """The pairing state of one worker; `library` is vLLM's NCCLLibrary (or a test double with
    ncclGetUniqueId / unique_id_from_bytes / ncclCommInitRank)."""

    def __init__(self, library: Any) -> None:
        self.library = library
        self._lock = threading.Lock()
        self._by_peer: dict[tuple[str, int], tuple[bytes, Link | None]] = {}
        self._by_key: dict[bytes, Link] = {}

    def consumer_fields(self, peer: tuple[str, int]) -> dict[str, bytes]:
        with self._lock:
            known = self._by_peer.get(peer)
            if known and known[1] is not None:
                return {"nccl_pair_key": known[0]}
            unique_id = bytes(self.library.ncclGetUniqueId().internal)
            self._by_peer[peer] = (pair_key(unique_id), None)
            return {"nccl_unique_id": unique_id}

    def consumer_link(self, peer: tuple[str, int], fields: dict[str, bytes]) -> Link:
        if "nccl_pair_key" in fields:
            return self._by_key[fields["nccl_pair_key"]]
        unique_id = fields["nccl_unique_id"]
        link = self._join(unique_id, CONSUMER_RANK, PRODUCER_RANK)
        with self._lock:
            self._by_peer[peer] = (pair_key(unique_id), link)
        return link

    def producer_link(self, fields: dict[str, bytes]) -> Link:
        """`fields`: the consumer's pairing fields from its Handshake (an id or a pair key)."""
        unique_id = fields.get("nccl_unique_id")
        if unique_id:
            if len(unique_id) != UNIQUE_ID_BYTES:
                raise ProtocolError("nccl_unique_id must be 128 bytes")
            return self._join(unique_id, PRODUCER_RANK, CONSUMER_RANK)
        with self._lock:
            link = self._by_key.get(fields.get("nccl_pair_key", b""))
        if link is None:
            raise ProtocolError("unknown NCCL pair key: the consumer must pair again")
        return link

    def _join(self, unique_id: bytes, rank: int, peer_rank: int) -> Link:
        comm = self.library.ncclCommInitRank(2, self.library.unique_id_from_bytes(unique_id), rank)
        link = Link(comm, peer_rank, pair_key(unique_id))
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
            self.library.ncclCommAbort(link.comm)
        except Exception as error:  # it is being discarded either way
            logger.warning("aborting an NCCL communicator: %r", error)


def wait_until(done: Callable[[], bool], deadline: float) -> None:
    """Poll `done` until it is true, or raise TimeoutError at `deadline` (monotonic)."""
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("NCCL transfer passed its deadline")
        time.sleep(POLL_S)


class NcclPlane(DataPlane):
    name = "nccl"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import torch
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        if self.layers and self.layers[0].device.type != "cuda":
            raise ValueError("the nccl KV transport needs CUDA KV caches; use transport: tcp")
        self._torch = torch
        self._library = NCCLLibrary()
        self.pairing = Pairing(self._library)

    def consumer_pairing(self, peer):
        return self.pairing.consumer_fields(peer)

    def consumer_link(self, peer, pairing):
        try:
            return self.pairing.consumer_link(peer, pairing)
        except Exception as error:
            self.pairing.forget(peer)
            raise TransferError("handshake", f"NCCL pairing with {peer} failed: {error}") from None

    def producer_link(self, pairing):
        return self.pairing.producer_link(pairing)

    def _move(self, runs: Iterator[Any], link: Link, send: bool, deadline: float) -> None:
        torch = self._torch
        device = self.layers[0].device
        if not link.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the NCCL pair is busy past the deadline")
        try:
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device)
                self._library.ncclGroupStart()
                for run in runs:
                    flat = run.reshape(-1).view(torch.uint8)
                    op = self._library.ncclSend if send else self._library.ncclRecv
                    op(
                        flat.data_ptr(),
                        flat.numel(),
                        0,
                        link.peer_rank,
                        link.comm,
                        stream.cuda_stream,
                    )
                self._library.ncclGroupEnd()
                finished = torch.cuda.Event()
                finished.record(stream)
                wait_until(finished.query, deadline)
        except BaseException:
            self.pairing.abort(link)
            raise
        finally:
            link.lock.release()

    def send_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        self._move(self.runs(blocks), link, True, deadline)

    def recv_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        self._move(self.runs(blocks), link, False, deadline)
