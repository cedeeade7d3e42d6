"""A decode node: a Ray actor hosting vLLM whose KV connector plays the consumer.

Life of a request here:
1. The router sends a `Decode` leg (pdserve_core/engine/legs.py): the prompt, the first token if the
   prefill node sampled it, and the KV handle.
2. With a first token, the node runs prompt + first token with the rest of the client's budget
   (`max_tokens - 1`); without (the router's seam policy, router/decides/seam.py), the bare prompt
   with the whole budget, so this engine samples every token, the first included, with all of the
   request's sampling state. The consumer half of the connector (`kv_consumer.py`) pulls the
   prompt's KV blocks into this engine's paged cache (`kv_client.py`): with `kv_transfer.load: sync`
   (the default) at the start of the step that admits the request, which then decodes it; with
   `async` beside the steps, the request waiting in WAITING_FOR_REMOTE_KVS meanwhile. Decoding then
   continues exactly as one engine would after its own prefill (without a first token, vLLM
   recomputes the last prompt position to sample from).
3. If the pull fails, `kv_transfer.failure_policy` decides: `recompute` computes the prefill
   here (the client sees nothing), `fail` ends the request with `KVLoadFailed` naming the reason.
Without a handle — the router's fallback when no prefill node is healthy — the node serves the
whole request itself (`generate`, from the engine actor).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from pdserve_core.engine import budget
from pdserve_core.engine.actor import EngineActor
from pdserve_core.engine.legs import Decode, leg_params
from pdserve_core.engine.types import KVLoadFailed, TokenDelta

FAILURE_REASON_WAIT_S = 2.0
"""How long to wait for the connector's reason for a failed pull (it arrives with the same or
the next engine step's stats)."""


def decode_params(params: Any, handle: dict[str, Any], first_tokens: int) -> Any:
    """The client's sampling parameters for what follows the first tokens already sampled,
    loading the KV through `handle`."""
    return leg_params(params, budget.after(params, first_tokens), handle)


class DecodeNode(EngineActor):
    ROLE = "decode"

    def handler(self, leg: Any) -> Callable[[Any], AsyncIterator[TokenDelta]]:
        return self.decode if type(leg) is Decode else super().handler(leg)

    async def decode(self, leg: Decode) -> AsyncIterator[TokenDelta]:
        """The request's tokens after `leg.first_token_ids` (all of them when that is empty),
        decoded from the prefill node's KV."""
        prompt, first = leg.prompt_token_ids, leg.first_token_ids
        params = decode_params(leg.params, leg.handle, len(first))
        # the text continues after the client's prompt, not after the first tokens (they may
        # end halfway through a character: pdserve_core/engine/text.py)
        async for delta in self._run(leg.request_id, prompt + first, params, len(prompt)):
            if delta.finish_reason == "error":
                raise await self._kv_failure(leg.request_id)
            yield replace(delta, num_prompt_tokens=len(prompt))

    async def prefetch(
        self, key: str, host: str, ports: list[int], num_tokens: int, block_size: int
    ) -> bool:
        """Start following the prefill `key` names on `host` (its KV server's `ports`), a prompt of
        `num_tokens`: its KV is staged here as it is written, for the decode leg that follows
        (decode_node/staging.py). False when the workers will not (`ConsumerWorker.prefetch`)."""
        if self._engine is None:
            return False
        args = (key, host, list(ports), num_tokens, block_size)
        started = await self._engine.collective_rpc("pdserve_prefetch", args=args)
        return all(started)

    async def _kv_failure(self, request_id: str) -> KVLoadFailed:
        """The reason the connector recorded for this request's failed pull (vLLM suffixes the
        request id it sees)."""
        deadline = time.monotonic() + FAILURE_REASON_WAIT_S
        while time.monotonic() < deadline:
            for internal, why in reversed(self._collector.kv_failures.items()):
                if internal == request_id or internal.startswith(request_id + "-"):
                    return KVLoadFailed(*why)
            await asyncio.sleep(0.02)
        return KVLoadFailed("unknown", "the engine reported a KV load failure")
