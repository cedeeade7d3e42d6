"""The KV handle: what a prefill engine returns and a decode engine is given.

It travels in vLLM's `kv_transfer_params` (a JSON-able dict) through the OpenAI response or the
`RequestOutput`; `KVHandle` is the typed form used inside pdserve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve_core.kv.transport import DEFAULT as DEFAULT_TRANSPORT

REMOTE_DECODE = "do_remote_decode"
REMOTE_PREFILL = "do_remote_prefill"


class HandleError(ValueError):
    """kv_transfer_params that do not describe a pull."""


READERS = "remote_readers"
MAX_READERS = 256
PREFETCH_KEY = "prefetch_key"
"""Names a prefill that a decode node follows while it runs (prefill_node/progress.py)."""
PREFETCH_KEY_CHARS = 32


def producer_params(readers: int = 1, prefetch: str = "") -> dict[str, Any]:
    """kv_transfer_params for the prefill leg: "keep the KV for `readers` remote decodes" (and,
    with a `prefetch` key, "a decode node follows this prefill under that key")."""
    params: dict[str, Any] = {REMOTE_DECODE: True, READERS: readers}
    if prefetch:
        params[PREFETCH_KEY] = prefetch
    return params


def prefetch_key(params: Any) -> str | None:
    """The prefetch key in kv_transfer_params, if it is one (32 hex digits), else None."""
    value = params.get(PREFETCH_KEY) if isinstance(params, dict) else None
    if not isinstance(value, str) or len(value) != PREFETCH_KEY_CHARS:
        return None
    try:
        bytes.fromhex(value)
    except ValueError:
        return None
    return value


def readers_of(params: dict[str, Any]) -> int:
    """How many completed pulls a prefill's lease allows (1 unless the router asked for more)."""
    value = params.get(READERS, 1) if isinstance(params, dict) else 1
    if isinstance(value, bool) or not isinstance(value, int):
        return 1
    return min(MAX_READERS, max(1, value))


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
    prefetch_key: str = ""
    """The key a decode node may have followed this prefill under ("" : none)."""

    def to_params(self) -> dict[str, Any]:
        prefetch = {PREFETCH_KEY: self.prefetch_key} if self.prefetch_key else {}
        return prefetch | {
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
    def from_params(cls, params: Any, peer_hosts: tuple[str, ...] | None = None) -> KVHandle:
        """The handle in `params`, every field checked for type and range (a handle is data from
        another process: it can fail one request, never the engine). `peer_hosts`: the hosts a
        handle may point to (None: any)."""
        if not isinstance(params, dict):
            raise HandleError("kv_transfer_params is not an object")
        host = _text(params, "remote_host", MAX_HOST)
        if not host or (peer_hosts is not None and host not in peer_hosts):
            raise HandleError(f"remote_host {host!r} is not a KV server of this cluster")
        ports = _ints(params, "remote_ports", 1, MAX_RANKS, 1, 65535)
        block_ids = _ints(params, "remote_block_ids", 1, MAX_BLOCKS, 0, MAX_INT)
        deadline = params.get("lease_deadline")
        if isinstance(deadline, bool) or not isinstance(deadline, int | float):
            raise HandleError("lease_deadline must be a number")
        if not math.isfinite(deadline):
            raise HandleError("lease_deadline must be finite")
        token = _text(params, "lease_token", 2 * MAX_TOKEN_BYTES, required=False)
        try:
            lease = bytes.fromhex(token)
        except ValueError:
            raise HandleError("lease_token must be hex") from None
        return cls(
            host=host,
            ports=ports,
            request_id=_text(params, "remote_request_id", MAX_ID),
            block_ids=block_ids,
            num_tokens=_int(params, "remote_num_tokens", 1, MAX_INT),
            lease_deadline=float(deadline),
            engine_id=_text(params, "remote_engine_id", MAX_ID, required=False),
            transport=_text(params, "transport", 16, required=False) or DEFAULT_TRANSPORT,
            lease_token=lease,
            readers=readers_of(params),
            prefetch_key=prefetch_key(params) or "",
        )


MAX_HOST, MAX_ID, MAX_TOKEN_BYTES = 255, 512, 64
MAX_RANKS, MAX_BLOCKS, MAX_INT = 64, 1 << 16, (1 << 31) - 1


def _text(params: dict, name: str, limit: int, required: bool = True) -> str:
    value = params.get(name, None if required else "")
    if not isinstance(value, str) or len(value) > limit or (required and not value):
        raise HandleError(f"{name} must be a string of 1 to {limit} characters")
    return value


def _int(params: dict, name: str, low: int, high: int) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HandleError(f"{name} must be an integer from {low} to {high}")
    return value


def _ints(params: dict, name: str, least: int, most: int, low: int, high: int) -> tuple[int, ...]:
    values = params.get(name)
    if not isinstance(values, list) or not least <= len(values) <= most:
        raise HandleError(f"{name} must be a list of {least} to {most} integers")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise HandleError(f"{name} must hold integers from {low} to {high}")
    return tuple(values)


def produced_tokens(params: Any, fallback: int) -> int:
    """`remote_num_tokens` of a handle, or `fallback` when it is not a usable count (the pull
    then fails as a bad handle, under the failure policy)."""
    value = params.get("remote_num_tokens") if isinstance(params, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
        return fallback
    return value


def wants_remote_decode(params: Any) -> bool:
    return isinstance(params, dict) and params.get(REMOTE_DECODE) is True


def wants_remote_prefill(params: Any) -> bool:
    return isinstance(params, dict) and params.get(REMOTE_PREFILL) is True
