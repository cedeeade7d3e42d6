"""A pool of engine nodes: choosing one and calling it under a deadline.

`Pool.stream` is where a request reaches a node (the admin paths — give-back, prefetch, ending a
follow — are plain calls beside it): it counts the call against the node (requests and prompt
tokens in flight, which the policies read), enforces the request's deadline, turns a node
failure into `NodeFailed` naming the pool and node (and takes the node out of the pool), and
cancels the node-side request when the caller stops listening (client gone, deadline, error),
which aborts it in vLLM and frees its blocks. Who is in the pool is router/membership.py's
business; a call that sees a node die takes it out at once.

A node can also fall **silent**: its host's link is cut, or the host is gone without a word, and
Ray takes tens of seconds to say so. A node that has neither streamed a delta nor answered a
health check for `silence_s` (a few check intervals) is treated as lost: it leaves its pool, and
every stream open on it ends with `NodeFailed`, so the retry policy resumes the stream elsewhere
instead of waiting on the node. A silent node that answers again rejoins like any other.
Silence is counted only while the router could hear (`Hearing`): not across a stall of the
router's own event loop (an overloaded router hears nobody for a while), and not while every node
is silent at once (then the router, or its host, is what stopped).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from pdserve_core.engine.legs import Leg, computes_prompt
from pdserve_core.engine.types import NodeInfo, RequestRejected, TokenDelta
from router import clock
from router.decides.policies import RoutingPolicy
from router.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NodeFailed,
    PoolUnavailable,
    RequestError,
)
from router.links.nodes import Node

logger = logging.getLogger(__name__)

GIVE_BACK_S = 10.0
"""How long an admin call to a node (give-back, prefetch, ending a follow) may take."""
LAG_S = 0.5
"""A timer that fires this much later than asked means the router's own loop was stalled."""


class Hearing:
    """What the router has heard, shared by its pools: when it last heard any node, and when its
    event loop last came back from a stall. A node's silence is counted from the later of its
    own last word and that return, and only while some node is heard."""

    def __init__(self) -> None:
        self.heard_any = clock.now()
        self.resumed_at = 0.0

    def heard(self, node: Node) -> None:
        node.last_heard = self.heard_any = clock.now()

    def woke(self, asked_s: float, slept_s: float) -> None:
        """A timer asked to wait `asked_s` waited `slept_s`: late enough, the loop was stalled."""
        if slept_s > asked_s + LAG_S:
            self.resumed_at = clock.now()

    def silent_for(self, node: Node, bound_s: float) -> float:
        """Seconds the node has been silent beyond `bound_s` (0: not silent)."""
        now = clock.now()
        if now - self.heard_any > bound_s / 2:
            return 0.0  # nobody is heard: the router is what stopped hearing
        quiet = now - max(node.last_heard, self.resumed_at)
        return quiet if quiet > bound_s else 0.0


class _Watch:
    """A stream's one timer over its node and its deadline. Every quarter of `silence_s` it looks
    whether the node fell silent or its engine is stuck, and if so while the stream waits for
    the node (`armed`), it cancels the stream's task, which the stream turns into `failure` (as
    `asyncio.timeout` turns its cancel into TimeoutError). At `deadline` (monotonic) it cancels
    the task whatever it waits on, the failure `DeadlineExceeded`. One timer per stream, none
    per delta."""

    def __init__(self, pool: Pool, node: Node, deadline: float, what: str) -> None:
        self.pool, self.node = pool, node
        self.deadline, self.what = deadline, what
        self.task = asyncio.current_task()
        self.armed = False
        self.failure: RequestError | None = None
        self._poll_s = pool.silence_s / 4
        self._timer: asyncio.TimerHandle | None = None
        self._schedule()

    def _schedule(self) -> None:
        self._asked = clock.now()
        self._wait = min(self._poll_s, self.deadline - self._asked)
        self._timer = asyncio.get_running_loop().call_later(max(0.0, self._wait), self._look)

    def _look(self) -> None:
        now = clock.now()
        if now >= self.deadline:
            self.failure = DeadlineExceeded(f"request {self.what} passed its deadline")
            self.task.cancel()
            return
        self.pool.hearing.woke(self._wait, now - self._asked)
        if self.armed:
            quiet = self.pool.silent_for(self.node)
            if quiet:
                self.failure = NodeFailed(f"silent for {quiet:.1f} s (host or link down?)")
            elif self.node.stuck:  # the request may be what hung it
                self.failure = NodeFailed("its engine is stuck", died=True)
            if self.failure is not None:
                self.task.cancel()
                return
        self._schedule()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class Pool:
    def __init__(
        self,
        name: str,
        nodes: list[Node],
        policy: RoutingPolicy,
        *,
        silence_s: float,
        hearing: Hearing | None = None,
    ) -> None:
        self.name = name
        self.nodes = nodes
        self.policy = policy
        self.silence_s = silence_s
        self.hearing = hearing or Hearing()

    def healthy_nodes(self) -> list[Node]:
        return [node for node in self.nodes if node.healthy]

    def pick(self, exclude: tuple[Node, ...] = (), prefix: Any = None) -> Node:
        """A healthy node not in `exclude`, by the pool's policy; with a `prefix`
        (router/decides/prefixes.py), weighing what each node holds of it."""
        candidates = [node for node in self.healthy_nodes() if node not in exclude]
        if not candidates:
            raise PoolUnavailable(f"no healthy node in the {self.name} pool")
        if prefix is None:
            return self.policy.choose(candidates)
        uncached = [len(prefix) - node.cached_tokens(prefix) for node in candidates]
        return self.policy.choose_for(candidates, uncached)

    def mark_failed(self, node: Node, why: str) -> None:
        if node.healthy:
            logger.error("%s node %s left the pool: %s", self.name, node.name, why)
        node.healthy = False

    async def stream(self, node: Node, leg: Leg, deadline: float) -> AsyncIterator[TokenDelta]:
        """Yield the deltas of `leg` run on `node` until the leg finishes or `deadline`
        (monotonic) passes; a node silent for `silence_s` (or whose engine is stuck) while the
        stream waits for it ends the stream with `NodeFailed`."""
        prompt_token_ids, request_id = leg.prompt_token_ids, leg.request_id
        node.outstanding += 1
        node.outstanding_prompt_tokens += len(prompt_token_ids)
        computing = len(prompt_token_ids) if computes_prompt(leg) else 0
        node.prefilling_tokens += computing
        deltas = node.client.stream(leg)
        watch = _Watch(self, node, deadline, request_id)
        try:  # closing the node's stream (below) cancels the call on the node
            while True:
                watch.armed = True
                try:
                    delta = await anext(deltas)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if watch.failure is None or watch.task.uncancel():
                        raise  # not the watch's doing (the caller left)
                    raise watch.failure from None
                finally:
                    watch.armed = False
                self.hearing.heard(node)
                node.prefilling_tokens -= computing
                computing = 0
                yield delta
        except RequestRejected as error:
            raise InvalidRequest(error.message) from None
        except NodeFailed as error:
            self.mark_failed(node, error.message)
            raise NodeFailed(
                f"{self.name} node {node.name} failed: {error.message}",
                pool=self.name,
                died=error.died,
            ) from None
        finally:
            watch.close()
            node.outstanding -= 1
            node.outstanding_prompt_tokens -= len(prompt_token_ids)
            node.prefilling_tokens -= computing
            await deltas.aclose()

    async def give_back(self, node: Node, handle: Any) -> None:
        """Ask `node` to free the KV it keeps under `handle` (no decode leg will read it); a node
        that does not answer in time keeps it until the lease ends."""
        try:
            async with asyncio.timeout(GIVE_BACK_S):
                freed = await node.client.give_back(handle)
            logger.debug("%s node %s: KV given back (%s)", self.name, node.name, freed)
        except Exception as error:  # the lease frees it instead
            logger.info("%s node %s: giving KV back failed: %r", self.name, node.name, error)

    async def end_follow(self, node: Node, key: str) -> None:
        """Tell `node` the prefill `key` names will not run there; one that does not answer in
        time lets its follower wait until the follow's deadline."""
        try:
            async with asyncio.timeout(GIVE_BACK_S):
                await node.client.end_follow(key)
        except Exception as error:
            logger.info("%s node %s: ending a follow failed: %r", self.name, node.name, error)

    async def prefetch(self, node: Node, key: str, source: NodeInfo, num_tokens: int) -> None:
        """Ask `node` to follow the prefill `key` names on the `source` node and stage its KV; a
        node that declines or does not answer in time pulls after the prefill instead."""
        try:
            async with asyncio.timeout(GIVE_BACK_S):
                started = await node.client.prefetch(
                    key, source.kv_host, source.kv_ports, num_tokens, source.block_size
                )
            logger.debug("%s node %s: prefetch %s… (%s)", self.name, node.name, key[:8], started)
        except Exception as error:  # it pulls instead
            logger.info("%s node %s: prefetch failed: %r", self.name, node.name, error)

    def silent_for(self, node: Node) -> float:
        """Seconds the node has been silent beyond `silence_s` (0: not silent, or the router
        could not have heard it)."""
        return self.hearing.silent_for(node, self.silence_s)
