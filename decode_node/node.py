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
4. The node checks that the KV crossed: the engine's first output says how many prompt tokens
   it found in place (`num_cached_tokens`); a hand-over whose prompt the engine computed itself
   (more than the one token a hand-over leaves) is counted (`NodeStats.handovers_recomputed_total`,
   `pdserve_kv_handovers_total{outcome="recomputed"}`), shown on the router's /health and logged
   with the transport and the prefill node it should have come from. A failed pull under
   `recompute` is one; so is KV that silently never crosses (a decode engine without the
   connector, a handle it ignores) — the split that stops splitting while the output stays right.
Without a handle — the router's fallback when no prefill node is healthy — the node serves the
whole request itself (`generate`, from the engine actor).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from pdserve_core.engine import budget
from pdserve_core.engine.actor import EngineActor
from pdserve_core.engine.legs import Decode, leg_params
from pdserve_core.engine.stats import LogEvery
from pdserve_core.engine.types import KVLoadFailed, TokenDelta

logger = logging.getLogger(__name__)

FAILURE_REASON_WAIT_S = 2.0
"""How long to wait for the connector's reason for a failed pull (it arrives with the same or
the next engine step's stats)."""
LEFT_TO_COMPUTE = 1
"""Prompt tokens a decode engine computes itself on a good hand-over: the last position (the
first token's, or the prompt's last when this node samples the first token)."""
RECOMPUTE_LOG_EVERY_S = 10.0
PRODUCER_HITS = "remote_prefill_cached_tokens"
"""What vLLM adds to a producer's handle: its own prompt cache hits."""


def decode_params(params: Any, handle: dict[str, Any], first_tokens: int) -> Any:
    """The client's sampling parameters for what follows the first tokens already sampled,
    loading the KV through `handle`."""
    return leg_params(params, budget.after(params, first_tokens), handle)


class DecodeNode(EngineActor):
    ROLE = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recompute_log = LogEvery(RECOMPUTE_LOG_EVERY_S)
        """Lets a "KV did not cross" line through at most every `RECOMPUTE_LOG_EVERY_S`."""

    def handler(self, leg: Any) -> Callable[[Any], AsyncIterator[TokenDelta]]:
        return self.decode if type(leg) is Decode else super().handler(leg)

    async def decode(self, leg: Decode) -> AsyncIterator[TokenDelta]:
        """The request's tokens after `leg.first_token_ids` (all of them when that is empty),
        decoded from the prefill node's KV."""
        prompt, first = leg.prompt_token_ids, leg.first_token_ids
        handle = leg.handle
        if isinstance(handle, dict) and PRODUCER_HITS in handle:
            # vLLM would report the producer's cache hits as this engine's found tokens; the
            # hand-over check needs this engine's own (the router reports the producer's)
            handle = {key: value for key, value in handle.items() if key != PRODUCER_HITS}
        params = decode_params(leg.params, handle, len(first))
        # the text continues after the client's prompt, not after the first tokens (they may
        # end halfway through a character: pdserve_core/engine/text.py)
        found = None
        run = self._run(leg.request_id, prompt + first, params, len(prompt))
        async with aclosing(run) as deltas:  # a stopped leg is aborted in vLLM before it ends
            async for delta in deltas:
                if delta.finish_reason == "error" and (
                    failed := await self._kv_failure(leg.request_id)
                ):
                    raise failed
                # any other error the engine ended the request with (its log says why: a
                # grammar that rejects the token it sampled) reaches the client as it would
                # from one engine
                if found is None:
                    found = delta.num_cached_tokens
                yield replace(delta, num_prompt_tokens=len(prompt))
        if found is not None:
            self._check_handover(leg, len(prompt) + len(first), found)

    def _check_handover(self, leg: Decode, prompt_tokens: int, found: int) -> None:
        """Count the finished hand-over. One whose prompt the engine computed itself — more than
        `LEFT_TO_COMPUTE` tokens not found in place, or a failed pull (vLLM counts the tokens it
        planned to load as found) — is also named in the stats and a log line (at most one per
        `RECOMPUTE_LOG_EVERY_S`, with the count since the last)."""
        stats = self._stats
        stats.handovers_total += 1
        computed = prompt_tokens - found
        failure = self._failure_of(leg.request_id)
        if computed <= LEFT_TO_COMPUTE and failure is None:
            return
        stats.handovers_recomputed_total += 1
        handle = leg.handle if isinstance(leg.handle, dict) else {}
        source = f"{handle.get('remote_host', '?')}:{handle.get('remote_ports', '?')}"
        what = (
            f"the pull failed ({failure[0]}: {failure[1]}), the prompt was computed here"
            if failure
            else f"{computed} of {prompt_tokens} prompt tokens computed here, not loaded"
        )
        stats.last_recompute = (
            f"request {leg.request_id}: {what} (KV transport {handle.get('transport', '?')}, "
            f"from {source})"
        )
        if recomputes := self._recompute_log.count(time.monotonic()):
            logger.warning(
                "%s: KV did not cross for %d hand-over(s) since the last report; last: %s",
                self._name,
                recomputes,
                stats.last_recompute,
            )

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

    def _failure_of(self, request_id: str) -> tuple[str, str] | None:
        """(reason, message) the connector recorded for this request's failed pull, if any
        (vLLM suffixes the request id it sees)."""
        for internal, why in reversed(self._collector.kv_failures.items()):
            if internal == request_id or internal.startswith(request_id + "-"):
                return why
        return None

    async def _kv_failure(self, request_id: str) -> KVLoadFailed | None:
        """The failed pull that ended this request with an error, waiting for it to arrive with
        the step's stats; None when the connector recorded none (the error was the engine's
        own)."""
        deadline = time.monotonic() + FAILURE_REASON_WAIT_S
        while time.monotonic() < deadline:
            if why := self._failure_of(request_id):
                return KVLoadFailed(*why)
            await asyncio.sleep(0.02)
        return None
