"""The data-plane interface: how block bytes move once the control conversation said "go".

The control conversation (authentication, layout handshake, lease claim, done) is the same for
every transport and lives with the two roles: the producer's in `prefill_node/kv_server.py`, the
consumer's in `decode_node/kv_client.py`. A data plane only moves bytes:

- producer side (prefill worker): `send_blocks(conn, block_ids, deadline, link)`;
- consumer side (decode worker): `recv_blocks(conn, block_ids, deadline, link)`;
- a followed prefill's pieces (prefill_node/progress.py), one layer at a time on the control
  socket: `send_layer` / `recv_layer` (`follows`: the TCP plane only);
- optional per-peer pairing, negotiated inside the handshake: `consumer_pairing` adds fields to
  it (a new plane puts its own in `plane_fields`, a map the protocol leaves to the planes);
  `consumer_link` and `producer_link` return the link both sides then use (the NCCL
  communicator, collective.py; whether the consumer still needs the producer's NIXL metadata,
  nixl.py); TCP needs none and uses the control socket itself;
- anything a plane says on the control socket after an OK PullReply is its own (nixl sends a
  `NixlOffer`), as long as the consumer's PullDone ends it.

A run is a contiguous tensor slice: consecutive block ids of one layer, moved as one piece.
"""

from __future__ import annotations

import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from pdserve_core.kv.layout import KVLayout


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive block ids as (first, count) runs: [3,4,5,9] -> [(3,3),(9,1)]."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def paired_runs(first: list[int], second: list[int]) -> list[tuple[int, int, int]]:
    """(first id, second id, count) runs where both lists go up by one together:
    ([1,2,7], [0,1,4]) -> [(1,0,2), (7,4,1)]."""
    runs: list[list[int]] = []
    for a, b in zip(first, second, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return [tuple(run) for run in runs]


class DataPlane(ABC):
    name = "base"

    def __init__(
        self, layout: KVLayout, kv_caches: dict[str, Any], rate_limit: float | None = None
    ) -> None:
        self.layout = layout
        self.rate_limit = rate_limit
        """Bytes per second a producer sends at most per transfer (None: no cap)."""
        self.layer_names = sorted(kv_caches)
        self.layers = [kv_caches[name] for name in self.layer_names]

    @classmethod
    def from_settings(cls, layout: KVLayout, kv_caches: dict[str, Any], settings: Any) -> DataPlane:
        """The plane a connector with these `ConnectorSettings` uses (a plane with settings of
        its own reads them here)."""
        return cls(layout, kv_caches, rate_limit=settings.send_rate_limit_bytes_per_s)

    follows = False
    """Can stream a running prefill's layers as they are written (`send_layer`, `recv_layer`)."""

    def send_layer(self, conn: socket.socket, layer: int, blocks: list[int], deadline: float):
        """Producer: these blocks of one layer, on the control socket."""
        raise NotImplementedError(f"the {self.name} plane cannot follow a prefill")

    def recv_layer(self, conn: socket.socket, into: memoryview, deadline: float) -> None:
        """Consumer: one layer's blocks (as `send_layer` sent them) into `into`."""
        raise NotImplementedError(f"the {self.name} plane cannot follow a prefill")

    @abstractmethod
    def send_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        """Producer: move these blocks of every layer, layer by layer, to the consumer."""

    @abstractmethod
    def recv_blocks(self, conn: socket.socket, blocks: list[int], deadline: float, link: Any):
        """Consumer: fill these blocks of every layer, in the same order, with the bytes."""

    def consumer_pairing(self, peer: tuple[str, int], local_host: str = "") -> dict[str, bytes]:
        """Consumer: extra Handshake fields for this peer (default: none). `local_host`: this
        side's address on the connection to the peer."""
        return {}

    def consumer_link(
        self,
        peer: tuple[str, int],
        pairing: dict[str, bytes],
        local_host: str = "",
        deadline: float | None = None,
    ) -> Any:
        """Consumer, after an accepted handshake: the data link to this peer (default: none),
        made before `deadline`."""
        return None

    def producer_link(
        self, pairing: dict[str, bytes], local_host: str = "", deadline: float | None = None
    ) -> Any:
        """Producer, after an accepted handshake: the link to this consumer (default: none),
        made before `deadline`."""
        return None

    def runs(self, block_ids: list[int]) -> Iterator[Any]:
        """Tensor slices to move, layer by layer (sorted layer names), runs in block-id order."""
        grouped = block_runs(block_ids)
        for layer in self.layers:
            for first, count in grouped:
                yield layer[first : first + count]

    def pace(self, started: float, sent: int) -> None:
        """Sleep so that `sent` bytes since `started` stay under the rate limit, if any."""
        if self.rate_limit:
            ahead = sent / self.rate_limit - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)

    def payload_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.layout.block_bytes * self.layout.num_layers
