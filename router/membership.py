"""Who is in a pool: every interval each node's health and stats are read, and a node comes and
goes by what they say.

One check is in flight per node: a node that does not answer never delays the others. A node
that dies leaves the pool at once (also when a call sees it die, router/pools.py); one that
misses checks leaves after `MISSED_CHECKS_TO_EVICT` in a row; a node silent for the pool's
`silence_s` while its check hangs leaves then; a node whose engine holds requests and has not
stepped for `stall_s` is stuck: it leaves, its streams end with `NodeFailed` (and go elsewhere),
and its engine is ended; a node Ray restarted comes back without an engine, is started again,
and rejoins when healthy; a build that fails is tried again after a wait that doubles with each
failure in a row (`RESTART_BACKOFF_S`).
"""

from __future__ import annotations

import asyncio
import logging

from router import clock
from router.decides.rates import counters
from router.errors import NodeFailed
from router.links.nodes import Node
from router.pools import Pool

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
"""How often each node's health and stats are read."""
HEALTH_TIMEOUT_S = 10.0
MISSED_CHECKS_TO_EVICT = 3
"""A node busy enough to miss a health check is not dead: it leaves its pool after this many
missed checks in a row, or at once when Ray says the actor died."""
RESTART_TIMEOUT_S = 600.0
RESTART_BACKOFF_S = (2.0, 300.0)
"""A node whose engine build failed waits before the next: the first, doubled after each
failure in a row, at most the second (a model that cannot load is not rebuilt every second)."""


class Membership:
    """The health checks of one pool's nodes (`start` / `stop`), and what each one decides."""

    def __init__(self, pool: Pool, *, stall_s: float, prefix_aware: bool) -> None:
        self.pool = pool
        self.stall_s = stall_s
        """How long an engine holding requests may go without a step before it is stuck
        (`router.engine_stall_s`)."""
        self.prefix_aware = prefix_aware
        """Read each node's block log with its health check (`router.prefix_aware`)."""
        self._watcher: asyncio.Task | None = None

    def start(self, interval_s: float = CHECK_INTERVAL_S) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(interval_s))

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None

    async def _watch(self, interval_s: float) -> None:
        try:
            while True:
                for node in list(self.pool.nodes):
                    self._check(node)
                slept = clock.now()
                await asyncio.sleep(interval_s)
                self.pool.hearing.woke(interval_s, clock.now() - slept)
        finally:
            checks = [node.checking for node in self.pool.nodes if node.checking is not None]
            for check in checks:
                check.cancel()
            await asyncio.gather(*checks, return_exceptions=True)

    def _check(self, node: Node) -> None:
        """Start a health check of `node` unless one is in flight; a node silent for too long
        leaves the pool while its check hangs."""
        if node.checking is not None and not node.checking.done():
            quiet = self.pool.silent_for(node)
            if quiet and node.healthy:
                self.pool.mark_failed(node, f"silent for {quiet:.1f} s (host or link down?)")
            return
        node.checking = asyncio.get_running_loop().create_task(self.refresh(node))

    async def refresh(self, node: Node) -> None:
        """One health check: refresh stats, drop a failed node, restart a revived one."""
        if node.restarting:
            return
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                # what any router's requests left there, read with the health and the stats
                seen = node.blocks_seen if self.prefix_aware else None
                asked = clock.now()
                healthy, node.stats, blocks = await node.client.checkup(seen)
                node.stats_asked = asked
                self.pool.hearing.heard(node)
                held = node.stats.running + node.stats.waiting
                node.elsewhere = max(0, held - node.outstanding)
                if blocks is not None:
                    node.blocks_seen, logged = blocks
                    for hashes in logged:
                        node.prefixes.record_blocks(node.info, hashes)
                node.history.append((clock.now(), counters(node.stats)))
                if healthy and self._stalled(node):
                    await self._drop_stuck_engine(node)
                    return
        except NodeFailed as error:  # the actor died or is restarting: out of the pool now
            self.pool.mark_failed(node, f"health check: {error.message}")
            return
        except Exception as error:  # a timeout or a failing engine: out after repeated misses
            node.missed_checks += 1
            logger.warning(
                "%s node %s missed a health check (%d in a row): %s",
                self.pool.name,
                node.name,
                node.missed_checks,
                type(error).__name__,
            )
            if node.missed_checks >= MISSED_CHECKS_TO_EVICT:
                self.pool.mark_failed(node, f"{node.missed_checks} missed health checks")
            return
        node.missed_checks = 0
        if not healthy:  # restarted by Ray, or its engine died: the actor is up, no engine
            if clock.now() < node.next_start:
                return  # its last build failed: waiting before the next
            self.pool.mark_failed(node, "no engine; building one")
            node.restarting = True
            asyncio.get_running_loop().create_task(self._restart(node))
            return
        if not node.healthy:
            logger.info("%s node %s rejoined the pool", self.pool.name, node.name)
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
        self.pool.mark_failed(
            node,
            f"engine stuck: no step in {clock.now() - node.steps_seen[1]:.0f} s with "
            f"{stats.running} running, {stats.waiting} waiting, {node.outstanding} open here",
        )
        try:
            await node.client.drop_engine()
        except Exception as error:  # unreachable too: its health checks will say so
            logger.error(
                "%s node %s: ending its stuck engine: %r", self.pool.name, node.name, error
            )
        node.steps_seen = (-1, 0.0)

    async def _restart(self, node: Node) -> None:
        logger.warning(
            "%s node %s is back without an engine; starting it", self.pool.name, node.name
        )
        try:
            node.info = await asyncio.wait_for(node.client.start(), RESTART_TIMEOUT_S)
            node.failed_starts = 0
        except Exception as error:
            node.failed_starts += 1
            first, most = RESTART_BACKOFF_S
            wait = min(most, first * 2 ** (node.failed_starts - 1))
            node.next_start = clock.now() + wait
            self.pool.mark_failed(node, f"restart: {type(error).__name__}")
            logger.error(
                "%s node %s: building its engine failed %d time(s) in a row (%s); next try in "
                "%.0f s",
                self.pool.name,
                node.name,
                node.failed_starts,
                error,
                wait,
            )
        finally:
            node.restarting = False
