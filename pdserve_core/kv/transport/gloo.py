"""gloo under the collective plane (collective.py): CPU caches, a two-rank torch.distributed gloo
process group per producer/consumer pair — the same plane as NCCL's, on any machine.

- a pair id names a rendezvous the consumer hosts: "host|port|key" (its address as the producer
  reached it, a TCPStore it listens on, a random key), padded to 128 bytes;
- joining builds the gloo group on that store, bound to this side's own address (gloo would
  otherwise use the address the machine's hostname resolves to, which a host in a private
  network namespace may not reach), under the caller's deadline;
- a transfer posts one send (or receive) per run and waits for each under the pull's deadline;
- abort ends the group.
Chosen with `transport: gloo` (CPU engines on separate hosts, and the tests of the plane).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pdserve_core.kv.transport.collective import Backend, CollectivePlane
from pdserve_core.kv.wire import ProtocolError

ID_BYTES = 128


@dataclass
class GlooComm:
    group: Any
    store: Any


def _left(deadline: float) -> timedelta:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("gloo wait passed its deadline")
    return timedelta(seconds=left)


def _named(error: RuntimeError, deadline: float, what: str) -> Exception:
    """gloo's RuntimeError as the failure class the KV client maps: a timeout, or a lost peer."""
    if time.monotonic() >= deadline or "imeout" in str(error):
        return TimeoutError(f"{what}: {error}")
    return ConnectionError(f"{what}: {error}")


def parse_id(pair_id: bytes) -> tuple[str, int, str]:
    try:
        host, port, key = pair_id.rstrip(b"\0").decode("ascii").split("|")
        number = int(port)
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("malformed gloo pair id") from None
    if not (0 < number < 65536) or not key.isalnum() or not host:
        raise ProtocolError("malformed gloo pair id")
    return host, number, key


class GlooBackend(Backend):
    id_bytes = ID_BYTES

    def __init__(self) -> None:
        self._hosted: dict[bytes, Any] = {}
        """Stores this side listens on for pairs it proposed and has not joined yet."""

    def new_id(self, local_host: str) -> bytes:
        from torch.distributed import TCPStore

        host = local_host or "127.0.0.1"
        store = TCPStore(host, 0, 2, True, timedelta(seconds=30), wait_for_workers=False)
        pair_id = f"{host}|{store.port}|{secrets.token_hex(8)}".encode().ljust(ID_BYTES, b"\0")
        self._hosted[pair_id] = store
        return pair_id

    def join(self, pair_id: bytes, rank: int, local_host: str, deadline: float) -> GlooComm:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        host, port, key = parse_id(pair_id)
        store = self._hosted.pop(pair_id, None)
        try:
            if store is None:
                store = TCPStore(host, port, 2, False, _left(deadline))
            options = ProcessGroupGloo._Options()
            options._timeout = _left(deadline)
            options._devices = [ProcessGroupGloo.create_device(hostname=local_host or host)]
            group = ProcessGroupGloo(PrefixStore(key, store), rank, 2, options)
        except RuntimeError as error:  # gloo and the store speak RuntimeError
            raise _named(error, deadline, "gloo join") from None
        return GlooComm(group, store)

    def move(self, comm: GlooComm, runs: list[Any], peer_rank: int, send: bool, deadline: float):
        post = comm.group.send if send else comm.group.recv
        pending = [post([run], peer_rank, 0) for run in runs]
        for work in pending:
            try:
                work.wait(_left(deadline))
            except RuntimeError as error:
                raise _named(error, deadline, "gloo transfer") from None

    def abort(self, comm: GlooComm) -> None:
        comm.group.abort()


class GlooPlane(CollectivePlane):
    name = "gloo"

    def make_backend(self) -> Backend:
        if self.layers and self.layers[0].device.type != "cpu":
            raise ValueError("the gloo KV transport moves CPU KV caches; use nccl between GPUs")
        return GlooBackend()
