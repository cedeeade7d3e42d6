"""Pools of engine nodes as the router sees them: handles, live load, health, one streaming call.

`Pool.stream` is the only place the router talks to an engine actor: it opens Ray's streaming
generator, enforces the request's deadline, turns Ray's actor failures into `NodeFailed`, and
cancels the engine-side request when the caller stops listening (client gone, deadline, error),
which aborts it in vLLM and frees its blocks.

`Pool.watch` keeps membership live: every interval it asks each node for health and stats. A node
that fails leaves the pool at once (also when a call sees it die); a node Ray restarted comes back
without an engine, is started again, and rejoins when healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from pdserve.engine import TokenDelta
from router.errors import DeadlineExceeded, EngineFailed, PoolUnavailable
from router.metrics.balance import counters
from router.policies import RoutingPolicy, make_policy

logger = logging.getLogger(__name__)

NODE_FAILURES = (ActorDiedError, ActorUnavailableError, RayActorError)
HEALTH_TIMEOUT_S = 10.0
MISSED_CHECKS_TO_EVICT = 3
"""A node busy enough to miss a health check is not dead: it leaves its pool after this many
missed checks in a row, or at once when Ray says the actor died."""
STATS_HISTORY = 120
"""Stats samples kept per node (two minutes at the 1 s health-check interval)."""


class NodeFailed(EngineFailed):
    """The node died or became unreachable while serving (the caller may retry elsewhere)."""


@dataclass
class Node:
    name: str
    handle: Any  # ray.actor.ActorHandle
    info: dict = field(default_factory=dict)
    healthy: bool = True
    outstanding: int = 0
    outstanding_prompt_tokens: int = 0
    stats: dict = field(default_factory=dict)
    restarting: bool = False
    missed_checks: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=STATS_HISTORY))
    """(monotonic time, counters) of recent health checks: the metrics' rate windows."""


class Pool:
    def __init__(
        self, name: str, nodes: list[Node], policy: str | RoutingPolicy = "least_outstanding"
    ):
        self.name = name
        self.nodes = nodes
        self.policy = make_policy(policy, name) if isinstance(policy, str) else policy
        self._watcher: asyncio.Task | None = None
        self.metrics = None
        """The router's `RouterMetrics` (routing decisions, retries), when it has one."""

    def healthy_nodes(self) -> list[Node]:
        return [node for node in self.nodes if node.healthy]

    def pick(self, exclude: tuple[Node, ...] = ()) -> Node:
        candidates = [node for node in self.healthy_nodes() if node not in exclude]
        if not candidates:
            raise PoolUnavailable(f"no healthy node in the {self.name} pool")
        node = self.policy.choose(candidates)
        if self.metrics is not None:
            self.metrics.routed.labels(pool=self.name, node=node.name).inc()
        return node

    def mark_failed(self, node: Node, why: str) -> None:
        if node.healthy:
            logger.error("%s node %s left the pool: %s", self.name, node.name, why)
        node.healthy = False

    async def stream(
        self, node: Node, request_id: str, token_ids: list[int], params: Any, deadline: float
    ) -> AsyncIterator[TokenDelta]:
        """Yield the engine's deltas for one request until it finishes or `deadline` (monotonic)."""
        node.outstanding += 1
        node.outstanding_prompt_tokens += len(token_ids)
        stream = node.handle.generate.options(num_returns="streaming").remote(
            request_id, token_ids, params
        )
        finished = False
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                async for ref in stream:
                    delta: TokenDelta = await ref
                    finished = delta.finish_reason is not None
                    yield delta
        except TimeoutError:
            raise DeadlineExceeded(f"request {request_id} passed its deadline") from None
        except NODE_FAILURES as error:
            self.mark_failed(node, type(error).__name__)
            raise NodeFailed(
                f"{self.name} node {node.name} failed: {type(error).__name__}"
            ) from None
        finally:
            node.outstanding -= 1
            node.outstanding_prompt_tokens -= len(token_ids)
            if not finished:
                ray.cancel(stream)
                logger.info("request %s cancelled on %s", request_id, node.name)

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
        while True:
            await asyncio.gather(*(self.refresh(node) for node in self.nodes))
            await asyncio.sleep(interval_s)

    async def refresh(self, node: Node) -> None:
        """One health check: refresh stats, drop a failed node, restart a revived one."""
        if node.restarting:
            return
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                healthy = await node.handle.check_health.remote()
                node.stats = await node.handle.stats.remote()
                node.history.append((time.monotonic(), counters(node.stats)))
        except NODE_FAILURES as error:  # the actor died or is restarting: out of the pool now
            self.mark_failed(node, f"health check: {type(error).__name__}")
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
        if not healthy:  # Ray restarted the actor: it is up, but its engine is not built
            node.restarting = True
            asyncio.get_running_loop().create_task(self._restart(node))
            return
        if not node.healthy:
            logger.info("%s node %s rejoined the pool", self.name, node.name)
        node.healthy = True

    async def _restart(self, node: Node) -> None:
        logger.warning("%s node %s is back without an engine; starting it", self.name, node.name)
        try:
            node.info = await asyncio.wait_for(node.handle.start.remote(), 600)
        except Exception as error:
            self.mark_failed(node, f"restart: {type(error).__name__}")
        finally:
            node.restarting = False
