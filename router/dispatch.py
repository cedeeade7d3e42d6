"""Carrying out a request's route: one node whole, or a prefill leg then a decode leg.

A dispatcher asks `Routing` (router/decides/routing.py) where a request runs — the one decision —
and runs it there once, yielding its deltas; it never retries (router/decides/retry.py decides
whether a failed run runs again, and each run is routed anew). An observer (the router's metrics) is
told each route and each hand-over's gap, as data.

A split route, step by step:
1. The prefill node runs the prompt (`PrefillNode.prefill`) and keeps its KV for the decode leg (for
   `n` legs when the request asks for n sequences). Where the route says the prefill samples the
   first token (router/decides/seam.py), that token goes to the client at once (the time to first
   token is the prefill's); if the request finished there (EOS or a stop token), that is all.
2. The decode node gets the prompt, the first token when there is one, and the handle
   (`DecodeNode.decode`); it pulls the KV and streams the rest — or, without a first token,
   every token.
KV the prefill node keeps for a decode leg that will not read it to the end (the client left,
the decode node failed) is given back at once.
Where the decode node takes prefetches, it is asked to follow the prefill as the prefill starts
(`prefetch`: a random key names the prefill on both nodes): the KV crosses while the prompt is
computed, and the decode leg's pull is a local copy (decode_node/staging.py) — unless the decode
node holds the prompt's start in its prefix cache: a follow streams every block, the pull after
the prefill only those the decode node lacks.
With `prefix_aware`, each prompt's blocks are recorded on the nodes its legs run on, and a
request that ran to its end records its output on the node that decoded it
(router/decides/prefixes.py): the next turn of a conversation is routed to where its history is.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any, Protocol

from pdserve_core.engine.legs import Decode, Prefill, Whole
from pdserve_core.engine.types import KVLoadFailed, TokenDelta
from router import clock
from router.decides import seam
from router.decides.placement import Placement
from router.decides.prefixes import Prefix
from router.decides.routing import Route, Routing
from router.errors import EngineFailed, KVTransferFailed
from router.links.nodes import Node
from router.pools import Pool
from router.request import PreparedRequest, num_logprobs

logger = logging.getLogger(__name__)


class RouteObserver(Protocol):
    def routed(self, route: Route) -> None:
        """A request is about to run on `route`."""

    def handed_over(self, seconds: float) -> None:
        """A hand-over's gap: the prefill leg's end to the decode node's first token."""


class Dispatcher:
    def __init__(
        self, routing: Routing, observer: RouteObserver | None, *, prefix_aware: bool
    ) -> None:
        self.routing = routing
        self.observer = observer
        self.prefix_aware = prefix_aware
        """Route by what each node holds of a prompt (router/decides/prefixes.py), recording where
        each prompt and each finished request's output went."""
        self.prefill, self.decode = routing.prefill, routing.decode
        self.mode = "colocated" if routing.prefill is None else "disaggregated"
        self.pools = {pool.name: pool for pool in (routing.prefill, routing.decode) if pool}
        self._aside_tasks: set[asyncio.Task] = set()
        """KV being given back to prefill nodes, prefetches being asked for (kept: a task nobody
        holds may be collected)."""

    @classmethod
    def colocated(
        cls, pool: Pool, observer: RouteObserver | None = None, *, prefix_aware: bool
    ) -> Dispatcher:
        """Over one pool of engines that prefill and decode."""
        return cls(Routing(pool, prefill_fallback=False), observer, prefix_aware=prefix_aware)

    @classmethod
    def disaggregated(
        cls,
        prefill: Pool,
        decode: Pool,
        prefill_fallback: bool,
        placement: Placement,
        observer: RouteObserver | None = None,
        *,
        prefix_aware: bool,
    ) -> Dispatcher:
        """Over a prefill pool and a decode pool."""
        return cls(
            Routing(decode, prefill, placement, prefill_fallback=prefill_fallback),
            observer,
            prefix_aware=prefix_aware,
        )

    @property
    def placement(self) -> Placement | None:
        return self.routing.placement

    def check_available(self) -> None:
        self.routing.check_available()

    async def deltas(self, prepared: PreparedRequest, deadline: float) -> AsyncIterator[TokenDelta]:
        """Route the request now and run it there once."""
        params = prepared.sampling_params
        prefix = (
            Prefix(prepared.prompt_token_ids, prepared.cache_salt) if self.prefix_aware else None
        )
        route = self.routing.route(len(prepared.prompt_token_ids), params, prefix)
        if logger.isEnabledFor(logging.DEBUG):
            legs = route.legs()
            logger.debug(
                "%s: legs %s, %s (%s)", prepared.log_id, prepared.internal_id, legs, route.reason
            )
        if route.reason == "no_decode_node":
            logger.warning("%s: no healthy decode node; a prefill node serves it", prepared.log_id)
        elif route.reason == "no_prefill_node":
            logger.warning("%s: no healthy prefill node; the decode node prefills", prepared.log_id)
        if self.observer is not None:
            self.observer.routed(route)
        if route.split:  # before the record below says it holds this very prompt
            held = route.node.cached_tokens(prefix)
            run = self._split(route, prepared, deadline, held)
        else:
            whole = Whole(prepared.internal_id, prepared.prompt_token_ids, params)
            run = self.pools[route.pool].stream(route.node, whole, deadline)
        if prefix is not None:
            for node in filter(None, (route.prefill, route.node)):
                node.prefixes.record(node.info, prefix)
        output: list[int] = []
        async with aclosing(run):  # a caller leaving closes the legs now, not when collected
            async for delta in run:
                output += delta.token_ids
                yield delta
        if prefix is not None and params.n == 1 and len(output) > 1:
            # the node that ran it to its end holds its output's KV too (but the last token's:
            # that was sampled, never computed) — what a conversation's next turn sends back
            route.node.prefixes.record(route.node.info, prefix.extended(output[:-1]))

    async def _split(
        self, route: Route, prepared: PreparedRequest, deadline: float, held: int = 0
    ) -> AsyncIterator[TokenDelta]:
        """`held`: the prompt's tokens the decode node is taken to hold in its prefix cache."""
        sample_first = route.first_token == seam.FIRST_ON_PREFILL
        prefetch = ""
        if not held:
            # a follow streams every block; a decode node that holds the prompt's start pulls
            # only the rest once the prefill ends
            prefetch = self._prefetch(route, len(prepared.prompt_token_ids))
        try:
            prefill_node, first = await self._prefill(
                route.prefill, prepared, deadline, sample_first, prefetch
            )
        except BaseException:  # failed or cancelled: maybe before vLLM ever had the prefill
            if prefetch:
                self._aside(self.prefill.end_follow(route.prefill, prefetch))
            raise
        handed_over = clock.now()
        first_tokens: list[int] = []
        ended = False  # the decode leg ran to its end (it read the KV, or had none to read)
        try:
            if sample_first:
                yield replace(first, handle=None)
                if first.finish_reason == "stop":
                    ended = True
                    return  # EOS or a stop token at the first token: no KV was kept
                first_tokens = first.token_ids
            decode = Decode(
                f"{prepared.internal_id}-d",
                prepared.prompt_token_ids,
                prepared.sampling_params,
                first_tokens,
                first.handle,
            )
            leg = self.decode.stream(route.node, decode, deadline)
            async with aclosing(leg):
                async for delta in leg:
                    if handed_over is not None and delta.token_ids:
                        self._handover(clock.now() - handed_over)
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
        self._aside(self.prefill.give_back(node, handle))

    def _prefetch(self, route: Route, num_tokens: int) -> str:
        """Ask the route's decode node to follow its prefill, when both can; the key that names
        the prefill, or "" (the decode leg pulls after the prefill)."""
        source, target = route.prefill.info, route.node.info
        if source is None or target is None or not source.kv_host or not target.prefetch:
            return ""
        key = secrets.token_hex(16)
        self._aside(self.decode.prefetch(route.node, key, source, num_tokens))
        return key

    def _aside(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._aside_tasks.add(task)
        task.add_done_callback(self._aside_tasks.discard)

    def _handover(self, seconds: float) -> None:
        self.placement.observe_handover(seconds)
        if self.observer is not None:
            self.observer.handed_over(seconds)

    async def _prefill(
        self,
        node: Node,
        prepared: PreparedRequest,
        deadline: float,
        sample_first: bool,
        prefetch: str = "",
    ) -> tuple[Node, TokenDelta]:
        """Run the prefill leg on `node` to its end and fold its deltas into one: the first token
        (when `sample_first`) and the handle for the decode leg(s); with the node that ran it.
        `prefetch`: the key a decode node follows it under."""
        tokens, text, logprobs, first, last = [], [], [], None, None
        params = prepared.sampling_params
        prefill = Prefill(
            f"{prepared.internal_id}-p",
            prepared.prompt_token_ids,
            params,
            sample_first,
            readers=params.n,
            prefetch=prefetch,
        )
        leg = self.prefill.stream(node, prefill, deadline)
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
            logprobs=logprobs if num_logprobs(params) is not None else None,
            num_cached_tokens=first.num_cached_tokens,
        )
