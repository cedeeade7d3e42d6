"""How a prepared request is served: colocated (one pool) or disaggregated (prefill then decode).

Disaggregated, the life of one request:
1. A decode node is chosen first (none healthy: 503 before anything runs).
2. A prefill node runs the prompt with `max_tokens=1` and `do_remote_decode`; its one token goes
   to the client at once (the time to first token is the prefill's), with the KV handle kept.
   If the prompt already finished there (EOS or a stop string, or max_tokens == 1), that is all.
3. The decode node gets the prompt plus that token, `max_tokens - 1`, and the handle; it pulls the
   KV and streams the rest.
With no healthy prefill node, the decode node serves the whole request (`prefill_fallback`).

Faults: a node that dies before any token reached the client is retried on another node of its
pool; after that the request ends with an explicit error (`NodeFailed`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from pdserve.engine import KVLoadFailed, TokenDelta
from pdserve.kv.handle import producer_params
from router.errors import EngineFailed, PoolUnavailable
from router.frontend import PreparedRequest
from router.pools import Node, NodeFailed, Pool

logger = logging.getLogger(__name__)


class KVTransferFailed(EngineFailed):
    kind = "kv_transfer_failed"


async def _stream_with_retry(
    pool: Pool,
    request_id: str,
    token_ids: list[int],
    params: Any,
    deadline: float,
    first: Node | None = None,
) -> AsyncIterator[TokenDelta]:
    """Stream from one node of `pool`; if it dies before its first delta, try another."""
    tried: list[Node] = []
    node = first or pool.pick()
    while True:
        started = False
        try:
            async for delta in pool.stream(node, request_id, token_ids, params, deadline):
                started = True
                yield delta
            return
        except NodeFailed:
            if started:
                raise
            tried.append(node)
            node = pool.pick(exclude=tuple(tried))  # PoolUnavailable when none is left
            if pool.metrics is not None:
                pool.metrics.retries.labels(pool=pool.name).inc()
            logger.warning("retrying %s on %s node %s", request_id, pool.name, node.name)
        except KVLoadFailed as error:
            raise KVTransferFailed(str(error)) from None


class Colocated:
    mode = "colocated"

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.pools = {pool.name: pool}

    def check_available(self) -> None:
        if not self.pool.healthy_nodes():
            raise PoolUnavailable(f"no healthy node in the {self.pool.name} pool")

    def deltas(self, prepared: PreparedRequest, deadline: float) -> AsyncIterator[TokenDelta]:
        return _stream_with_retry(
            self.pool,
            prepared.request_id,
            prepared.prompt_token_ids,
            prepared.sampling_params,
            deadline,
        )


def _prefill_params(params: Any) -> Any:
    first = params.clone()
    first.max_tokens = 1
    first.min_tokens = min(params.min_tokens, 1)
    first.extra_args = {**(params.extra_args or {}), "kv_transfer_params": producer_params()}
    return first


def _decode_params(params: Any, handle: dict | None) -> Any:
    rest = params.clone()
    rest.max_tokens = params.max_tokens - 1
    rest.min_tokens = max(0, params.min_tokens - 1)
    extra = dict(params.extra_args or {})
    if handle:
        extra["kv_transfer_params"] = handle
    rest.extra_args = extra or None
    return rest


class Disaggregated:
    mode = "disaggregated"

    def __init__(self, prefill: Pool, decode: Pool, prefill_fallback: bool = True) -> None:
        self.prefill, self.decode = prefill, decode
        self.pools = {prefill.name: prefill, decode.name: decode}
        self.prefill_fallback = prefill_fallback

    def check_available(self) -> None:
        if not self.decode.healthy_nodes():
            raise PoolUnavailable("no healthy node in the decode pool")
        if not self.prefill.healthy_nodes() and not self.prefill_fallback:
            raise PoolUnavailable("no healthy node in the prefill pool (fallback is off)")

    async def deltas(self, prepared: PreparedRequest, deadline: float) -> AsyncIterator[TokenDelta]:
        params, prompt = prepared.sampling_params, prepared.prompt_token_ids
        decode_node = self.decode.pick()
        if params.max_tokens == 1 and self.prefill.healthy_nodes():
            # nothing to hand over: the prefill node does it all
            async for delta in _stream_with_retry(
                self.prefill, prepared.request_id, prompt, params, deadline
            ):
                yield delta
            return
        try:
            if not self.prefill.healthy_nodes():
                raise PoolUnavailable("no healthy node in the prefill pool")
            first = await self._prefill(prepared, deadline)
        except PoolUnavailable:
            if not self.prefill_fallback:
                raise
            logger.warning(
                "%s: no healthy prefill node; the decode node prefills", prepared.request_id
            )
            if self.decode.metrics is not None:
                self.decode.metrics.fallbacks.inc()
            async for delta in _stream_with_retry(
                self.decode, prepared.request_id, prompt, params, deadline, decode_node
            ):
                yield delta
            return
        yield replace(first, kv_transfer_params=None)
        if first.finish_reason == "stop":
            return  # EOS or a stop string at the first token (the producer's lease frees its KV)
        async for delta in _stream_with_retry(
            self.decode,
            f"{prepared.request_id}-d",
            prompt + first.token_ids,
            _decode_params(params, first.kv_transfer_params),
            deadline,
            decode_node,
        ):
            yield replace(delta, num_prompt_tokens=len(prompt), kv_transfer_params=None)

    async def _prefill(self, prepared: PreparedRequest, deadline: float) -> TokenDelta:
        """Run the prefill leg to its end and fold its deltas into one (the first token)."""
        tokens, text, last = [], [], None
        async for delta in _stream_with_retry(
            self.prefill,
            f"{prepared.request_id}-p",
            prepared.prompt_token_ids,
            _prefill_params(prepared.sampling_params),
            deadline,
        ):
            tokens += delta.token_ids
            text.append(delta.text)
            last = delta
        if last is None:
            raise EngineFailed("the prefill node returned no output")
        finish = last.finish_reason if last.finish_reason == "stop" else None
        return TokenDelta(
            token_ids=tokens,
            text="".join(text),
            finish_reason=finish,
            stop_reason=last.stop_reason if finish else None,
            num_prompt_tokens=len(prepared.prompt_token_ids),
            kv_transfer_params=last.kv_transfer_params,
        )
