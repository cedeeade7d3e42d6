"""A pool of engine nodes: choosing one, calling it under a deadline, and keeping membership live.

`Pool.stream` is where a request reaches a node (the admin paths — health, stats, step records,
give-back — are plain calls beside it): it counts the call against the node
(requests and prompt tokens in flight, which the policies read), enforces the request's
deadline, turns a node failure into `NodeFailed` naming the pool and node (and takes the node out
of the pool), and cancels the node-side request when the caller stops listening (client gone,
deadline, error), which aborts it in vLLM and frees its blocks.

`Pool.watch` keeps membership live: every interval it asks each node for health and stats (one
check in flight per node: a node that does not answer never delays the others). A node that dies
leaves the pool at once (also when a call sees it die); one that misses checks leaves after
`MISSED_CHECKS_TO_EVICT` in a row; a node whose engine holds requests and has not stepped for
`stall_s` is stuck: it leaves, its streams end with `NodeFailed` (and go elsewhere), and its
engine is ended; a node Ray restarted comes back without an engine, is started
again, and rejoins when healthy; a build that fails is tried again after a wait that doubles
with each failure in a row (`RESTART_BACKOFF_S`).

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

from pdserve.engine.legs import Leg, computes_prompt
from pdserve.engine.types import NodeInfo, RequestRejected, TokenDelta
from router import clock
from router.errors import DeadlineExceeded, InvalidRequest, NodeFailed, PoolUnavailable
from router.nodes import Node
from router.policies import RoutingPolicy
from router.rates import counters

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
GIVE_BACK_S = 10.0
MISSED_CHECKS_TO_EVICT = 3
"""A node busy enough to miss a health check is not dead: it leaves its pool after this many
missed checks in a row, or at once when Ray says the actor died."""
RESTART_TIMEOUT_S = 600.0
RESTART_BACKOFF_S = (2.0, 300.0)
"""A node whose engine build failed waits before the next: the first, doubled after each
failure in a row, at most the second (a model that cannot load is not rebuilt every second)."""
SILENCE_S = 3.0
"""Default for `router.node_silence_s`: how long a node may say nothing before it is lost."""
STALL_S = 300.0
"""Default for `router.engine_stall_s`: how long an engine with requests may go without a step."""
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
    """A stream's watch over its node: every quarter of `silence_s` it looks whether the node
    fell silent or its engine is stuck, and if so while the stream waits for the node
    (`armed`), it cancels the stream's task, which the stream turns into `failure` (as
    `asyncio.timeout` turns its cancel into TimeoutError). One timer per stream, none per
    delta."""

    def __init__(self, pool: Pool, node: Node) -> None:
        self.pool, self.node = pool, node
        self.task = asyncio.current_task()
        self.armed = False
        self.failure: NodeFailed | None = None
        self._poll_s = pool.silence_s / 4
        self._timer: asyncio.TimerHandle | None = None
        self._schedule()

    def _schedule(self) -> None:
        self._asked = clock.now()
        self._timer = asyncio.get_running_loop().call_later(self._poll_s, self._look)

    def _look(self) -> None:
        self.pool.hearing.woke(self._poll_s, clock.now() - self._asked)
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
        silence_s: float = SILENCE_S,
        hearing: Hearing | None = None,
        stall_s: float = STALL_S,
    ) -> None:
        self.name = name
        self.nodes = nodes
        self.policy = policy
        self.silence_s = silence_s
        self.stall_s = stall_s
        self.hearing = hearing or Hearing()
        self._watcher: asyncio.Task | None = None

    def healthy_nodes(self) -> list[Node]:
        return [node for node in self.nodes if node.healthy]

    def pick(self, exclude: tuple[Node, ...] = (), prefix: Any = None) -> Node:
        """A healthy node not in `exclude`, by the pool's policy; with a `prefix`
        (router/prefixes.py), weighing what each node holds of it."""
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
        (monotonic) passes."""
        prompt_token_ids, request_id = leg.prompt_token_ids, leg.request_id
        node.outstanding += 1
        node.outstanding_prompt_tokens += len(prompt_token_ids)
        computing = len(prompt_token_ids) if computes_prompt(leg) else 0
        node.prefilling_tokens += computing
        deltas = node.client.stream(leg)
        try:  # closing the node's stream (below) cancels the call on the node
            async with asyncio.timeout(max(0.0, deadline - clock.now())):
                async for delta in self._while_heard(node, deltas):
                    node.prefilling_tokens -= computing
                    computing = 0
                    yield delta
        except TimeoutError:
            raise DeadlineExceeded(f"request {request_id} passed its deadline") from None
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

    async def _while_heard(
        self, node: Node, deltas: AsyncIterator[TokenDelta]
    ) -> AsyncIterator[TokenDelta]:
        """`deltas`, ended with `NodeFailed` once the node has been silent for `silence_s` (or
        its engine is stuck) while the router waits for its next delta."""
        watch = _Watch(self, node)
        try:
            while True:
                watch.armed = True
                try:
                    delta = await anext(deltas)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if watch.failure is None or watch.task.uncancel():
                        raise  # not the watch's doing (the caller left, a deadline)
                    raise watch.failure from None
                finally:
                    watch.armed = False
                self.hearing.heard(node)
                yield delta
        finally:
            watch.close()

    # ---- membership ----------------------------------------------------------------------------

    def start_watching(self, interval_s: float = 1.0) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(interval_s))

    async def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None

    async def _watch(self, interval_s: float) -> None:
        try:
            while True:
                for node in list(self.nodes):
                    self._check(node)
                slept = clock.now()
                await asyncio.sleep(interval_s)
                self.hearing.woke(interval_s, clock.now() - slept)
        finally:
            checks = [node.checking for node in self.nodes if node.checking is not None]
            for check in checks:
                check.cancel()
            await asyncio.gather(*checks, return_exceptions=True)

    def _check(self, node: Node) -> None:
        """Start a health check of `node` unless one is in flight; a node silent for too long
        leaves the pool while its check hangs."""
        if node.checking is not None and not node.checking.done():
            quiet = self.silent_for(node)
            if quiet and node.healthy:
                self.mark_failed(node, f"silent for {quiet:.1f} s (host or link down?)")
            return
        node.checking = asyncio.get_running_loop().create_task(self.refresh(node))

    async def refresh(self, node: Node) -> None:
        """One health check: refresh stats, drop a failed node, restart a revived one."""
        if node.restarting:
            return
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                healthy = await node.client.check_health()
                self.hearing.heard(node)
                node.stats = await node.client.stats()
                node.reported = True
                node.history.append((clock.now(), counters(node.stats)))
                if healthy and self._stalled(node):
                    await self._drop_stuck_engine(node)
                    return
        except NodeFailed as error:  # the actor died or is restarting: out of the pool now
            self.mark_failed(node, f"health check: {error.message}")
            return
        except Exception as error:  # a timeout or a failing engine: out after repeated misses
            node.missed_checks += 1
            logger.warning(
                "%s node %s missed a health check (%d in a row): %s",
                self.name,
                node.name,
                node.missed_checks,
                type(error).__name__,
            )
            if node.missed_checks >= MISSED_CHECKS_TO_EVICT:
                self.mark_failed(node, f"{node.missed_checks} missed health checks")
            return
        node.missed_checks = 0
        if not healthy:  # restarted by Ray, or its engine died: the actor is up, no engine
            if clock.now() < node.next_start:
                return  # its last build failed: waiting before the next
            self.mark_failed(node, "no engine; building one")
            node.restarting = True
            asyncio.get_running_loop().create_task(self._restart(node))
            return
        if not node.healthy:
            logger.info("%s node %s rejoined the pool", self.name, node.name)
        node.healthy, node.stuck = True, False

    def _stalled(self, node: Node) -> bool:
        """Whether the node's engine holds requests and has not stepped for `stall_s`."""
        stats, now = node.stats, clock.now()
        holds = node.outstanding > 0 or stats.running + stats.waiting > 0
        steps, since = node.steps_seen
        if stats.engine_steps_total != steps or not holds:
            node.steps_seen = (stats.engine_steps_total, now)
            return False
        return now - since > self.stall_s

    async def _drop_stuck_engine(self, node: Node) -> None:
        """Out of the pool, its streams ended (they go elsewhere), its engine ended: the next
        health check finds no engine and builds one."""
        stats = node.stats
        node.stuck = True
        self.mark_failed(
            node,
            f"engine stuck: no step in {clock.now() - node.steps_seen[1]:.0f} s with "
            f"{stats.running} running, {stats.waiting} waiting, {node.outstanding} open here",
        )
        try:
            await node.client.drop_engine()
        except Exception as error:  # unreachable too: its health checks will say so
            logger.error("%s node %s: ending its stuck engine: %r", self.name, node.name, error)
        node.steps_seen = (-1, 0.0)

    async def _restart(self, node: Node) -> None:
        logger.warning("%s node %s is back without an engine; starting it", self.name, node.name)
        try:
            node.info = await asyncio.wait_for(node.client.start(), RESTART_TIMEOUT_S)
            node.failed_starts = 0
        except Exception as error:
            node.failed_starts += 1
            first, most = RESTART_BACKOFF_S
            wait = min(most, first * 2 ** (node.failed_starts - 1))
            node.next_start = clock.now() + wait
            self.mark_failed(node, f"restart: {type(error).__name__}")
            logger.error(
                "%s node %s: building its engine failed %d time(s) in a row (%s); next try in "
                "%.0f s",
                self.name,
                node.name,
                node.failed_starts,
                error,
                wait,
            )
        finally:
            node.restarting = False
