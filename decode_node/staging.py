"""KV a decode node received while the prefill ran (a prefetch), held until its request arrives.

The router names a request's decode node before its prefill starts; the node's workers then
follow the prefill (`KVClient.follow`, prefill_node/progress.py) and stage each layer of its
blocks in host memory as the prefill writes it. When the decode leg arrives with the handle, its
pull is served from here: the staged blocks are copied into the request's fresh blocks (a memory
copy, not a network transfer), and the producer is told to free its lease.

Staged KV is used only when it is complete and is the handle's: the same producer request id and
exactly the block ids the lease names (blocks are not reused while a lease holds them, so bytes
read from them during the prefill are the bytes a pull would read). Anything else — a prefetch
that failed, is still running past the pull's deadline, or does not match — is dropped and the
request pulls as it would have without one.

Memory is bounded: at most `budget_bytes` staged at once (a prefetch that does not fit is not
started), and an entry nobody takes is dropped `keep_s` after it ended.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import torch

from pdserve_core.kv.transport.plane import paired_runs
from pdserve_core.kv.wire import TransferError


class StagedKV:
    """One followed prefill's blocks: [layer, place among the request's blocks, block bytes]."""

    def __init__(self, key: str, num_layers: int, capacity: int, block_bytes: int) -> None:
        self.key = key
        self.capacity = capacity
        self.data = torch.empty((num_layers, capacity, block_bytes), dtype=torch.uint8)
        self._got = torch.zeros((num_layers, capacity), dtype=torch.bool)
        self.request_id = ""
        self.block_ids: tuple[int, ...] = ()
        self.error = ""
        self.ended = threading.Event()
        self.ended_at = 0.0
        self.nbytes = self.data.numel()
        self._conn: Any = None
        self._lock = threading.Lock()

    def attach(self, conn: Any) -> None:
        """The connection the prefetch arrives on (`drop` cuts it)."""
        with self._lock:
            if self.error:
                conn.shutdown(socket.SHUT_RDWR)
            self._conn = conn

    def drop(self, why: str) -> None:
        """Nobody will use this prefetch: end it now, cutting its connection if it still runs
        (its thread and memory are not held until its deadline)."""
        with self._lock:
            self.error = self.error or why
            conn, self._conn = self._conn, None
        if conn is not None and not self.ended.is_set():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def room(self, layer: int, first: int, count: int) -> memoryview:
        """Where `count` blocks of `layer` from place `first` go; a piece outside the staged
        shape is the producer's error and ends the prefetch."""
        if not (0 <= layer < self.data.shape[0] and count > 0 and first + count <= self.capacity):
            raise TransferError("handshake", f"piece (layer {layer}, {first}+{count}) out of range")
        return memoryview(self.data[layer, first : first + count].numpy()).cast("B")

    def received(self, layer: int, first: int, count: int) -> None:
        self._got[layer, first : first + count] = True

    def complete(self, request_id: str, block_ids: list[int]) -> None:
        """The producer's last piece: the prefill's request id and blocks. Every layer of every
        block must have come."""
        if not block_ids or len(block_ids) > self.capacity:
            raise TransferError("handshake", f"prefetch ended with {len(block_ids)} blocks")
        if not bool(self._got[:, : len(block_ids)].all()):
            raise TransferError("handshake", "prefetch ended with blocks missing")
        self.request_id, self.block_ids = request_id, tuple(block_ids)
        self._end()

    def fail(self, why: str) -> None:
        self.error = why
        self._end()

    def _end(self) -> None:
        self.ended_at = time.monotonic()
        self.ended.set()

    def places(self, request_id: str, held: tuple[int, ...], wanted: list[int]) -> list[int] | None:
        """The places of the `wanted` producer blocks, when this is the complete prefetch of the
        handle (`request_id`, `held` blocks); else None."""
        if self.error or self.request_id != request_id or self.block_ids != tuple(held):
            return None
        index = {block: place for place, block in enumerate(self.block_ids)}
        places = [index.get(block) for block in wanted]
        return None if None in places else places

    def copy_into(self, layers: list[torch.Tensor], places: list[int], local: list[int]) -> int:
        """Write the staged blocks at `places` into the cache blocks `local`; returns bytes.
        CPU caches are written run by run with plain memory copies (no torch op: its thread pool
        belongs to the engine, whose step waits for this); device caches one copy per run."""
        runs = paired_runs(places, local)
        staged = self.data.numpy()
        for layer, cache in enumerate(layers):
            blocks = cache.reshape(cache.shape[0], -1).view(torch.uint8)
            if cache.device.type == "cpu":
                target = blocks.numpy()
                for source, dest, count in runs:
                    target[dest : dest + count] = staged[layer, source : source + count]
            else:
                for source, dest, count in runs:
                    run = self.data[layer, source : source + count]
                    blocks[dest : dest + count].copy_(run, non_blocking=False)
        return len(local) * self.data.shape[0] * self.data.shape[2]


class Staging:
    """The prefetches of one decode worker, by key."""

    def __init__(self, budget_bytes: int, keep_s: float) -> None:
        self.budget_bytes = budget_bytes
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._staged: dict[str, StagedKV] = {}

    def reserve(
        self, key: str, num_layers: int, capacity: int, block_bytes: int
    ) -> StagedKV | None:
        """Room for a prefetch, or None: the key is taken or the budget is spent."""
        need = num_layers * capacity * block_bytes
        with self._lock:
            self._expire()
            if key in self._staged or self.held_bytes() + need > self.budget_bytes:
                return None
            staged = self._staged[key] = StagedKV(key, num_layers, capacity, block_bytes)
            return staged

    def take(self, key: str) -> StagedKV | None:
        with self._lock:
            return self._staged.pop(key, None)

    def held_bytes(self) -> int:
        return sum(staged.nbytes for staged in self._staged.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for key, staged in list(self._staged.items()):
            if staged.ended.is_set() and now - staged.ended_at > self.keep_s:
                del self._staged[key]
