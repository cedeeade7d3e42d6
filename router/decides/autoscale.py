"""Pools that follow the balance: when to move an engine from one role to the other.

The signal is each pool's pressure in calibrated cost (router/metrics/balance.py,
`cost_pressure`): a prefill node's share of time its prompt steps take by its step-time model, a
decode node's predicted step time against the TPOT budget — each the fraction of its budget the
pool's work uses. Their ratio says which pool is the bottleneck. The rule, checked every
`interval_s`:

1. within `cooldown_s` of the last move → hold (`cooldown`): a move needs time to show in the
   signal; a move that would undo the last one waits `reversal_s` (`reversal`): when both pools
   are short of capacity the signal swings with whichever starved last, and moving back and
   forth costs more than it gains;
2. prefill ÷ decode > `high`, the prefill pool's pressure ≥ `min_pressure`, and the decode pool
   above its minimum and the prefill pool below its maximum → one decode node becomes a prefill
   node (`to_prefill`);
3. prefill ÷ decode < 1 / `high`, the decode pool's pressure ≥ `min_pressure`, within bounds →
   one prefill node becomes a decode node (`to_decode`);
4. otherwise hold: `balanced`, `idle` (the heavier pool has slack anyway) or `at_bounds`.
One node per decision: the signal after a move says whether another is needed.

A move needs engines that play either role (vLLM's kv_both, pdserve/flex.py): such an engine
keeps serving what it has and takes new work in its new role, with no reload. `PoolScaler` runs
the rule in the router (`pools.autoscale`); `pdserve simulate --autoscale` on the simulated
cluster. Every check is counted in `pdserve_autoscale_decisions_total{action, reason}`; a move is
logged with the ratio and the pools' sizes after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from router import clock
from router.decides.rates import Window
from router.metrics.balance import cost_pressure, pool_load

logger = logging.getLogger(__name__)

Action = Literal[
    "to_prefill",
    "to_decode",
    "add_prefill",
    "add_decode",
    "remove_prefill",
    "remove_decode",
    "hold",
]
REASONS = (
    "moved",
    "added",
    "removed",
    "cooldown",
    "reversal",
    "balanced",
    "idle",
    "at_bounds",
    "no_resources",
    "changing",
    "no_signal",
)
OUTCOMES = {
    "moved": ("to_prefill", "to_decode"),
    "added": ("add_prefill", "add_decode"),
    "removed": ("remove_prefill", "remove_decode"),
}
"""Reason → the actions it goes with (every other reason is a hold)."""
MOVES = {"to_prefill": "to_decode", "to_decode": "to_prefill"}


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    ratio: float | None


class Autoscaler:
    """The rule above over `pools.autoscale` as configured (pdserve_core.config.AutoscaleConfig,
    read by attribute: its fields, defaults and bounds are defined and checked there, once)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.last_change: float | None = None
        self.last_move: Action | None = None
        self.idle_since: float | None = None

    def decide(
        self,
        now: float,
        prefill_pressure: float | None,
        decode_pressure: float | None,
        prefill_nodes: int,
        decode_nodes: int,
        changing: bool = False,
        can_add: Callable[[str], bool] = lambda role: True,
    ) -> Decision:
        """One check: pool pressures (None: no signal yet), pool sizes, whether a node is still
        being added or drained, and whether the cluster has room for one more node of a role."""
        p = self.policy
        if prefill_pressure is None or decode_pressure is None:
            return Decision("hold", "no_signal", None)
        ratio = max(prefill_pressure, 1e-3) / max(decode_pressure, 1e-3)
        idle = (
            p.remove_below is not None and max(prefill_pressure, decode_pressure) < p.remove_below
        )
        if not idle:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        if changing:
            return Decision("hold", "changing", ratio)
        if self.last_change is not None and now - self.last_change < p.cooldown_s:
            return Decision("hold", "cooldown", ratio)
        sizes = {"prefill": prefill_nodes, "decode": decode_nodes}
        bounds = {
            "prefill": (p.min_prefill, p.max_prefill),
            "decode": (p.min_decode, p.max_decode),
        }
        heavier = "prefill" if prefill_pressure >= decode_pressure else "decode"
        lighter = "decode" if heavier == "prefill" else "prefill"
        if p.add_above is not None and min(prefill_pressure, decode_pressure) >= p.add_above:
            top = bounds[heavier][1]
            if top is None or sizes[heavier] < top:
                if not can_add(heavier):
                    return Decision("hold", "no_resources", ratio)
                self.last_change = now
                return Decision(f"add_{heavier}", "added", ratio)
        if idle:
            if now - self.idle_since < p.remove_after_s:
                return Decision("hold", "idle", ratio)
            for role in (lighter, heavier):  # the lighter pool first, either above its minimum
                if sizes[role] > bounds[role][0]:
                    self.last_change, self.idle_since = now, None
                    return Decision(f"remove_{role}", "removed", ratio)
            return Decision("hold", "idle", ratio)
        if ratio > p.high:
            action: Action = "to_prefill"
            short, bounded = (
                prefill_pressure,
                decode_nodes <= p.min_decode
                or (p.max_prefill is not None and prefill_nodes >= p.max_prefill),
            )
        elif ratio < 1 / p.high:
            action = "to_decode"
            short, bounded = (
                decode_pressure,
                prefill_nodes <= p.min_prefill
                or (p.max_decode is not None and decode_nodes >= p.max_decode),
            )
        else:
            return Decision("hold", "balanced", ratio)
        if short < p.min_pressure:
            return Decision("hold", "idle", ratio)
        if bounded:
            return Decision("hold", "at_bounds", ratio)
        undoes = self.last_move is not None and MOVES[action] == self.last_move
        if undoes and self.last_change is not None and now - self.last_change < p.reversal_s:
            return Decision("hold", "reversal", ratio)
        self.last_change, self.last_move = now, action
        return Decision(action, "moved", ratio)


class NodeFactory(Protocol):
    """Starts and stops nodes that can take either role (pdserve.serve's, over Ray)."""

    def can_add(self, role: str) -> bool:
        """Whether the cluster has the resources for one more node of `role`'s pool."""

    async def add(self, role: str) -> Any:
        """Start a node with `role`'s pool resources; return its router `Node` once serving."""

    async def remove(self, node: Any) -> None:
        """Stop a node that has left its pool and drained."""


DRAIN_TIMEOUT_S = 600.0
"""How long a node leaving the cluster may take to finish what it runs before it is stopped."""


class PoolScaler:
    """The rule applied to the router's prefill and decode pools: every `interval_s`, each pool's
    pressure over the last few checks' stats, a decision, and its effect — a move hands the least
    busy node of the lighter pool to the other (both pools' `nodes` lists; its calls in flight
    finish where they are); an add starts a node through `factory` and puts it in the pool once
    it serves; a remove takes the least busy node of the lighter pool out at once and stops it
    once drained. One change at a time."""

    def __init__(
        self,
        prefill: Any,
        decode: Any,
        policy: Any,
        tpot_target_s: float,
        on_decision: Callable[[Decision], None] | None = None,
        factory: NodeFactory | None = None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.policy = policy
        self.tpot_target_s = tpot_target_s
        self.autoscaler = Autoscaler(policy)
        self.on_decision = on_decision
        self.factory = factory
        self.window_s = max(3.0, 3 * policy.interval_s)
        self._task: asyncio.Task | None = None
        self._change: asyncio.Task | None = None

    def pressure(self, pool: Any, role: str) -> float | None:
        """The pool's mean pressure over its nodes with a window of stats (a node that just
        joined has none yet: it would read as idle)."""
        values = []
        for node in pool.healthy_nodes():
            window = Window.of(node.history, self.window_s) if node.reported else None
            if window is not None:
                values.append(cost_pressure(role, window, self.tpot_target_s, node.stats))
        return pool_load(values)

    def _pool(self, role: str) -> Any:
        return self.prefill if role == "prefill" else self.decode

    def check(self, now: float | None = None) -> Decision:
        now = clock.now() if now is None else now
        decision = self.autoscaler.decide(
            now,
            self.pressure(self.prefill, "prefill"),
            self.pressure(self.decode, "decode"),
            len(self.prefill.healthy_nodes()),
            len(self.decode.healthy_nodes()),
            changing=self._change is not None and not self._change.done(),
            can_add=lambda role: self.factory is not None and self.factory.can_add(role),
        )
        action = decision.action
        if action in MOVES:
            source, target = (
                (self.decode, self.prefill)
                if action == "to_prefill"
                else (self.prefill, self.decode)
            )
            node = self._least_busy(source)
            source.nodes.remove(node)
            target.nodes.append(node)
            self._log(f"{node.name} moves from the {source.name} pool to the {target.name} pool",
                      decision)  # fmt: skip
        elif action.startswith("add_"):
            role = action.removeprefix("add_")
            self._log(f"starting a {role} node", decision)
            self._change = asyncio.get_running_loop().create_task(self._add(role))
        elif action.startswith("remove_"):
            pool = self._pool(action.removeprefix("remove_"))
            node = self._least_busy(pool)
            pool.nodes.remove(node)
            self._log(f"{node.name} leaves the {pool.name} pool (stopped once drained)", decision)
            self._change = asyncio.get_running_loop().create_task(self._remove(node))
        else:
            logger.debug("autoscale: hold (%s, ratio %s)", decision.reason, decision.ratio)
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision

    @staticmethod
    def _least_busy(pool: Any) -> Any:
        return min(pool.healthy_nodes(), key=lambda n: (n.outstanding, n.stats.running))

    def _log(self, what: str, decision: Decision) -> None:
        logger.info(
            "autoscale: %s (prefill / decode pressure %.2f); now %d prefill, %d decode",
            what,
            decision.ratio,
            len(self.prefill.nodes),
            len(self.decode.nodes),
        )

    async def _add(self, role: str) -> None:
        try:
            node = await self.factory.add(role)
        except Exception as error:
            logger.error("autoscale: starting a %s node failed: %r", role, error)
            return
        self._pool(role).nodes.append(node)
        self.autoscaler.last_change = clock.now()  # the cool-down runs from the join
        logger.info(
            "autoscale: %s joined the %s pool; now %d prefill, %d decode",
            node.name,
            role,
            len(self.prefill.nodes),
            len(self.decode.nodes),
        )

    async def _remove(self, node: Any) -> None:
        deadline = clock.now() + DRAIN_TIMEOUT_S
        while True:  # a poll's pause first: routers that follow this one hear of it meanwhile
            await asyncio.sleep(0.5)
            if clock.now() >= deadline or not await self._busy(node):
                break
        try:
            await self.factory.remove(node)
            logger.info("autoscale: %s drained and stopped", node.name)
        except Exception as error:
            logger.error("autoscale: stopping %s failed: %r", node.name, error)

    @staticmethod
    async def _busy(node: Any) -> bool:
        """Whether requests are still on a node that left its pool: this process's own, or any
        router's as the node reports them (it is no longer health-checked: asked here)."""
        if node.outstanding:
            return True
        try:
            stats = await node.client.stats()
        except Exception:  # it cannot say (gone, or going): nothing to wait for
            return False
        return stats.running + stats.waiting > 0

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                self.check()
            except Exception:  # never let one bad check end the loop (or the router)
                logger.exception("autoscale check failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        for task in (self._task, self._change):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._change = None
