"""The KV handle: what a prefill engine returns and a decode engine is given.

It travels in vLLM's `kv_transfer_params` (a JSON-able dict) through the OpenAI response or the
`RequestOutput`; `KVHandle` is the typed form used inside pdserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REMOTE_DECODE = "do_remote_decode"
REMOTE_PREFILL = "do_remote_prefill"


class HandleError(ValueError):
    """kv_transfer_params that do not describe a pull."""


READERS = "remote_readers"
MAX_READERS = 256


def producer_params(readers: int = 1) -> dict[str, Any]:
    """kv_transfer_params for the prefill leg: "keep the KV for `readers` remote decodes"."""
    return {REMOTE_DECODE: True, READERS: readers}


def readers_of(params: dict[str, Any]) -> int:
    """How many completed pulls a prefill's lease allows (1 unless the router asked for more)."""
    try:
        return min(MAX_READERS, max(1, int(params.get(READERS, 1))))
    except (TypeError, ValueError):
        return 1


@dataclass(frozen=True)
class KVHandle:
    host: str
    ports: tuple[int, ...]
    """KV server port of each tensor-parallel rank of the producer."""
    request_id: str
    """The producer's own request id (vLLM suffixes ids per instance)."""
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_deadline: float
    """Unix time after which the producer may free the blocks."""
    engine_id: str
    transport: str
    lease_token: bytes = b""
    """The producer scheduler's HMAC over the lease; see wire.lease_token."""
    readers: int = 1
    """Completed pulls the lease allows."""

    def to_params(self) -> dict[str, Any]:
        return {
            REMOTE_PREFILL: True,
            "remote_host": self.host,
            "remote_ports": list(self.ports),
            "remote_request_id": self.request_id,
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "lease_deadline": self.lease_deadline,
            "remote_engine_id": self.engine_id,
            "transport": self.transport,
            "lease_token": self.lease_token.hex(),
            READERS: self.readers,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> KVHandle:
        try:
            handle = cls(
                host=str(params["remote_host"]),
                ports=tuple(int(p) for p in params["remote_ports"]),
                request_id=str(params["remote_request_id"]),
                block_ids=tuple(int(b) for b in params["remote_block_ids"]),
                num_tokens=int(params["remote_num_tokens"]),
                lease_deadline=float(params["lease_deadline"]),
                engine_id=str(params.get("remote_engine_id", "")),
                transport=str(params.get("transport", "tcp")),
                lease_token=bytes.fromhex(str(params.get("lease_token", ""))),
                readers=readers_of(params),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise HandleError(f"kv_transfer_params is not a pdserve KV handle: {error!r}") from None
        if not handle.ports or not handle.block_ids or handle.num_tokens < 1:
            raise HandleError("kv_transfer_params names no blocks or no ports")
        return handle


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get(REMOTE_DECODE))


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get(REMOTE_PREFILL))
