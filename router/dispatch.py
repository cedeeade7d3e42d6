"""Where a prepared request runs: colocated (one pool) or disaggregated (prefill, then decode).

A dispatcher runs a request once, on the nodes it places it on, and yields its deltas; it never
retries (router/retry.py decides whether a failed run runs again).

Disaggregated, the life of one request (`RouterService.open` already refused it with 503 if no
node could serve it):
1. A decode node is chosen first, then where the prompt is computed (router/placement.py):
   `local` — the decode node serves the whole request as one engine would, and steps 2–3 do not
   happen; `remote` — steps 2 and 3.
2. A prefill node runs the prompt (`PrefillNode.prefill`) and keeps its KV for the decode leg
   (for `n` legs when the request asks for n sequences). Where the seam policy (router/seam.py)
   says the prefill samples the first token, that token goes to the client at once (the time to
   first token is the prefill's); if the request finished there (EOS or a stop token), that is
   all.
3. The decode node gets the prompt, the first token when there is one, and the handle
   (`DecodeNode.decode`); it pulls the KV and streams the rest — or, without a first token,
   every token.
`max_tokens: 1` is served by a prefill node alone, and a request that needs prompt logprobs by
the decode node alone. Degraded: with no healthy prefill node, the decode node serves the whole
request itself (`prefill_fallback`, or 503 when it is off); with no healthy decode node, a
prefill node does. 503 only when neither pool has a healthy node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from pdserve.engine.types import KVLoadFailed, TokenDelta
from router import seam
from router.errors import EngineFailed, KVTransferFailed, PoolUnavailable
from router.nodes import Node
from router.placement import LOCAL, Placement
from router.pools import Pool
from router.request import PreparedRequest

logger = logging.getLogger(__name__)


class Colocated:
    mode = "colocated"

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.pools = {pool.name: pool}

    def check_available(self) -> None:
        if not self.pool.healthy_nodes():
            raise PoolUnavailable(f"no healthy node in the {self.pool.name} pool")

    def deltas(self, prepared: PreparedRequest, deadline: float) -> AsyncIterator[TokenDelta]:
        return _relay(self.pool, self.pool.pick(), "generate", prepared, deadline)


class Disaggregated:
    mode = "disaggregated"

    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        prefill_fallback: bool,
        on_fallback: Any = None,
        placement: Placement | None = None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.pools = {prefill.name: prefill, decode.name: decode}
        self.prefill_fallback = prefill_fallback
        self.placement = placement or Placement("remote")
        self._giving_back: set[asyncio.Task] = set()
        """KV being given back to prefill nodes (kept: a task nobody holds may be collected)."""
        self.on_fallback = on_fallback
        """Called once per request the decode node prefills for itself (a metric)."""
        self.on_degraded = None
        """Called once per request a prefill node serves whole for want of a decode node."""
        self.on_placement = None
        """Called with each placement `Decision` (a metric)."""
        self.on_handover = None
        """Called with each hand-over gap in seconds: the prefill's end to the decode node's
        first token (a metric)."""

    def check_available(self) -> None:
        decode, prefill = self.decode.healthy_nodes(), self.prefill.healthy_nodes()
        if not decode and not prefill:
            raise PoolUnavailable("no healthy node in either pool")
        if not prefill and not self.prefill_fallback:
            raise PoolUnavailable("no healthy node in the prefill pool (fallback is off)")

    async def deltas(self, prepared: PreparedRequest, deadline: float) -> AsyncIterator[TokenDelta]:
        rid, prompt = prepared.request_id, prepared.prompt_token_ids
        leg_id = prepared.internal_id
        logger.debug("%s: its legs run as %s", rid, leg_id)
        params = prepared.sampling_params
        no_decode = not self.decode.healthy_nodes()
        if (params.max_tokens == 1 or no_decode) and self.prefill.healthy_nodes():
            # nothing to hand over, or nobody to hand over to: a prefill node does it all
            if no_decode:
                logger.warning("%s: no healthy decode node; a prefill node serves it", rid)
                if self.on_degraded is not None:
                    self.on_degraded()
            async for delta in _relay(
                self.prefill, self.prefill.pick(), "generate", prepared, deadline
            ):
                yield delta
            return
        decode_node = self.decode.pick()
        placement = seam.placement(params)
        local = placement == seam.ONE_ENGINE
        if not local:
            decision = self.placement.decide(len(prompt), decode_node, self.prefill.healthy_nodes())
            local = decision.where == LOCAL
            if decision.reason == "no_prefill_node":
                if not self.prefill_fallback:
                    raise PoolUnavailable("no healthy node in the prefill pool")
                logger.warning("%s: no healthy prefill node; the decode node prefills", rid)
                if self.on_fallback is not None:
                    self.on_fallback()
            elif self.on_placement is not None:
                self.on_placement(decision)
        if local:
            async for delta in _relay(self.decode, decode_node, "generate", prepared, deadline):
                yield delta
            return
        sample_first = placement == seam.FIRST_ON_PREFILL
        prefill_node, first = await self._prefill(prepared, deadline, sample_first)
        handed_over = time.monotonic()
        first_tokens: list[int] = []
        ended = False  # the decode leg ran to its end (it read the KV, or had none to read)
        try:
            if sample_first:
                yield replace(first, handle=None)
                if first.finish_reason == "stop":
                    ended = True
                    return  # EOS or a stop token at the first token: no KV was kept
                first_tokens = first.token_ids
            leg = self.decode.stream(
                decode_node,
                "decode",
                f"{leg_id}-d",
                prompt,
                params,
                first_tokens,
                first.handle,
                deadline=deadline,
            )
            async with aclosing(leg):
                async for delta in leg:
                    if handed_over is not None and delta.token_ids:
                        self._handover(time.monotonic() - handed_over)
                        handed_over = None
                    if delta.num_cached_tokens is not None:
                        # the prompt was computed on the prefill node: its cache hits count
                        cached = None if sample_first else first.num_cached_tokens
                        delta = replace(delta, num_cached_tokens=cached)
                    yield delta
            ended = True
        except KVLoadFailed as error:
            raise KVTransferFailed(str(error)) from None
        finally:
            if not ended and first.handle is not None:
                # the client left, the decode node failed, or its pull did: whatever the decode
                # leg did not read by now, nobody will. The prefill node frees it at once, not
                # at the lease's end (blocks being read go when the read ends).
                self._give_back(prefill_node, first.handle)

    def _give_back(self, node: Node, handle: Any) -> None:
        task = asyncio.get_running_loop().create_task(self.prefill.give_back(node, handle))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    def _handover(self, seconds: float) -> None:
        self.placement.observe_handover(seconds)
        if self.on_handover is not None:
            self.on_handover(seconds)

    async def _prefill(
        self, prepared: PreparedRequest, deadline: float, sample_first: bool
    ) -> tuple[Node, TokenDelta]:
        """Run the prefill leg to its end and fold its deltas into one: the first token (when
        `sample_first`) and the handle for the decode leg(s); with the node that ran it."""
        tokens, text, logprobs, first, last = [], [], [], None, None
        params = prepared.sampling_params
        node = self.prefill.pick()
        leg = self.prefill.stream(
            node,
            "prefill",
            f"{prepared.internal_id}-p",
            prepared.prompt_token_ids,
            params,
            sample_first,
            params.n,
            deadline=deadline,
        )
        async with aclosing(leg):
            async for delta in leg:
                tokens += delta.token_ids
                text.append(delta.text)
                logprobs += delta.logprobs or []
                first, last = first or delta, delta
        if last is None:
            raise EngineFailed("the prefill node returned no output")
        finish = last.finish_reason if last.finish_reason == "stop" else None
        return node, TokenDelta(
            token_ids=tokens,
            text="".join(text),
            finish_reason=finish,
            stop_reason=last.stop_reason if finish else None,
            num_prompt_tokens=len(prepared.prompt_token_ids),
            handle=last.handle,
            logprobs=logprobs if params.logprobs is not None else None,
            num_cached_tokens=first.num_cached_tokens,
        )


async def _relay(
    pool: Pool, node: Node, method: str, prepared: PreparedRequest, deadline: float
) -> AsyncIterator[TokenDelta]:
    """A whole request on one node (`method` "generate")."""
    leg = pool.stream(
        node,
        method,
        prepared.internal_id,
        prepared.prompt_token_ids,
        prepared.sampling_params,
        deadline=deadline,
    )
    async with aclosing(leg):
        async for delta in leg:
            yield delta
