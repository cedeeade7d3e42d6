"""TCP data plane: KV block bytes follow the control messages on the same socket.

CPU caches are sent from and received into the paged KV cache's own memory (no staging copy),
many runs per system call (`sendmsg` / `recvmsg_into` scatter-gather; over TLS, which has no
scatter-gather, one run per call); device caches go through a host buffer per run. The bytes are
the blocks exactly as stored, so both sides must share a layout (checked in the handshake).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from typing import Any

import torch

from pdserve_core.kv.transport.plane import DataPlane, block_runs
from pdserve_core.kv.wire import recv_exact_into

IOV_BATCH = 512
"""Buffers per sendmsg / recvmsg_into call (Linux allows up to 1024)."""
SOCKET_BUFFER_BYTES = 8 << 20


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _settimeout(conn: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("KV transfer deadline passed")
    conn.settimeout(left)


class TcpPlane(DataPlane):
    name = "tcp"
    follows = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        on_cpu = all(layer.device.type == "cpu" for layer in self.layers)
        self._views = [_as_bytes(layer) for layer in self.layers] if on_cpu else None

    def _buffers(self, block_ids: list[int]) -> Iterator[memoryview]:
        """Byte views of the runs to move, layer by layer, straight into the cache memory."""
        size = self.layout.block_bytes
        runs = block_runs(block_ids)
        for view in self._views:
            for first, count in runs:
                yield view[first * size : (first + count) * size]

    def send_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        _tune(conn)
        if self._views is None:
            return self._send_staged(conn, self.runs(blocks), deadline)
        started, sent = time.monotonic(), 0
        batch: list[memoryview] = []
        per_call = 1 if self.rate_limit else IOV_BATCH  # pace run by run when rate-limited
        for buffer in self._buffers(blocks):
            batch.append(buffer)
            if len(batch) == per_call:
                sent += _sendmsg_all(conn, batch, deadline)
                batch = []
                self.pace(started, sent)
        if batch:
            _sendmsg_all(conn, batch, deadline)

    def recv_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        _tune(conn)
        if self._views is None:
            return self._recv_staged(conn, self.runs(blocks), deadline)
        batch: list[memoryview] = []
        for buffer in self._buffers(blocks):
            batch.append(buffer)
            if len(batch) == IOV_BATCH:
                _recvmsg_all(conn, batch, deadline)
                batch = []
        if batch:
            _recvmsg_all(conn, batch, deadline)

    def send_layer(self, conn: socket.socket, layer: int, blocks: list[int], deadline: float):
        _tune(conn)
        if self._views is None:
            cache = self.layers[layer]
            runs = (cache[first : first + count] for first, count in block_runs(blocks))
            return self._send_staged(conn, runs, deadline)
        size, view = self.layout.block_bytes, self._views[layer]
        runs = [view[first * size : (first + count) * size] for first, count in block_runs(blocks)]
        _sendmsg_all(conn, runs, deadline)

    def recv_layer(self, conn: socket.socket, into: memoryview, deadline: float) -> None:
        _tune(conn)
        _recvmsg_all(conn, [into], deadline)

    def _send_staged(self, conn: socket.socket, runs: Iterator[Any], deadline: float) -> None:
        started, sent = time.monotonic(), 0
        for run in runs:
            _settimeout(conn, deadline)
            view = _as_bytes(run.to("cpu"))
            conn.sendall(view)
            sent += len(view)
            self.pace(started, sent)

    def _recv_staged(self, conn: socket.socket, runs: Iterator[Any], deadline: float) -> None:
        for run in runs:
            _settimeout(conn, deadline)
            staging = torch.empty(run.shape, dtype=run.dtype, device="cpu")
            _recvmsg_all(conn, [_as_bytes(staging)], deadline)
            run.copy_(staging)


def _tune(conn: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            conn.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def _advance(buffers: list[memoryview], start: int, moved: int) -> int:
    """Consume `moved` bytes from buffers[start:]; returns the first unfinished index."""
    while start < len(buffers) and moved >= len(buffers[start]):
        moved -= len(buffers[start])
        start += 1
    if moved:
        buffers[start] = buffers[start][moved:]
    return start


def _sendmsg_all(conn: socket.socket, buffers: list[memoryview], deadline: float) -> int:
    total = sum(len(b) for b in buffers)
    if isinstance(conn, ssl.SSLSocket):
        for buffer in buffers:
            _settimeout(conn, deadline)
            conn.sendall(buffer)
        return total
    start = 0
    while start < len(buffers):
        _settimeout(conn, deadline)
        start = _advance(buffers, start, conn.sendmsg(buffers[start:]))
    return total


def _recvmsg_all(conn: socket.socket, buffers: list[memoryview], deadline: float) -> None:
    if isinstance(conn, ssl.SSLSocket):
        for buffer in buffers:
            _settimeout(conn, deadline)
            recv_exact_into(conn, buffer)
        return
    start = 0
    while start < len(buffers):
        _settimeout(conn, deadline)
        got = conn.recvmsg_into(buffers[start:])[0]
        if got == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        start = _advance(buffers, start, got)
