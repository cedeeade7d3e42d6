"""TCP transport: KV block bytes follow the control messages on the same socket.

CPU caches are sent from and received into the paged KV cache's own memory (no staging copy);
device caches go through a host buffer per run. The bytes are the blocks exactly as stored, so
both sides must share a layout (checked in the handshake).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import torch

from pdserve.kv.transport.base import KVTransport
from pdserve.kv.wire import recv_exact_into


def _as_bytes(run: torch.Tensor) -> memoryview:
    return memoryview(run.reshape(-1).view(torch.uint8).numpy())


def _settimeout(conn: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("KV transfer deadline passed")
    conn.settimeout(left)


class TcpTransport(KVTransport):
    name = "tcp"

    def _send_blocks(
        self, conn: socket.socket, runs: Iterator[Any], deadline: float, link: Any
    ) -> None:
        started, sent = time.monotonic(), 0
        for run in runs:
            _settimeout(conn, deadline)
            host = run if run.device.type == "cpu" else run.to("cpu")
            view = _as_bytes(host)
            conn.sendall(view)
            sent += len(view)
            self.pace(started, sent)

    def _recv_blocks(
        self, conn: socket.socket, runs: Iterator[Any], deadline: float, link: Any
    ) -> None:
        for run in runs:
            _settimeout(conn, deadline)
            if run.device.type == "cpu":
                recv_exact_into(conn, _as_bytes(run))
            else:
                staging = torch.empty(run.shape, dtype=run.dtype, device="cpu")
                recv_exact_into(conn, _as_bytes(staging))
                run.copy_(staging)
