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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from router.metrics.balance import Window, cost_pressure, pool_load

logger = logging.getLogger(__name__)

Action = Literal["to_prefill", "to_decode", "hold"]
REASONS = ("moved", "cooldown", "reversal", "balanced", "idle", "at_bounds", "no_signal")


@dataclass(frozen=True)
class AutoscalePolicy:
    interval_s: float = 5.0
    cooldown_s: float = 30.0
    reversal_s: float = 120.0
    """A move back the other way waits this long after the last one."""
    high: float = 1.5
    """Move when one pool's pressure is this many times the other's."""
    min_pressure: float = 0.5
    """The bottleneck pool must use at least this share of its budget (else nothing is short)."""
    min_prefill: int = 1
    min_decode: int = 1
    max_prefill: int | None = None
    max_decode: int | None = None

    def __post_init__(self) -> None:
        if self.high <= 1:
            raise ValueError("autoscale high must be above 1")
        if self.min_prefill < 0 or self.min_decode < 1:
            raise ValueError("autoscale needs at least one decode node (min_decode >= 1)")
        if self.interval_s <= 0 or self.cooldown_s < 0:
            raise ValueError("autoscale interval must be positive and cooldown not negative")


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    ratio: float | None


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy) -> None:
        self.policy = policy
        self.last_move: float | None = None
        self.last_action: Action | None = None

    def decide(
        self,
        now: float,
        prefill_pressure: float | None,
        decode_pressure: float | None,
        prefill_nodes: int,
        decode_nodes: int,
    ) -> Decision:
        """One check: pool pressures (None: no signal yet) and pool sizes → what to do."""
        p = self.policy
        if prefill_pressure is None or decode_pressure is None:
            return Decision("hold", "no_signal", None)
        ratio = max(prefill_pressure, 1e-3) / max(decode_pressure, 1e-3)
        if self.last_move is not None and now - self.last_move < p.cooldown_s:
            return Decision("hold", "cooldown", ratio)
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
        undoes = self.last_action is not None and action != self.last_action
        if undoes and self.last_move is not None and now - self.last_move < p.reversal_s:
            return Decision("hold", "reversal", ratio)
        self.last_move, self.last_action = now, action
        return Decision(action, "moved", ratio)


class PoolScaler:
    """The rule applied to the router's prefill and decode pools: every `interval_s`, each pool's
    pressure over the last few checks' stats, a decision, and for a move the least busy node of
    the lighter pool handed to the other (both pools' `nodes` lists; a node's calls in flight
    finish where they are)."""

    def __init__(
        self,
        prefill: Any,
        decode: Any,
        policy: AutoscalePolicy,
        tpot_target_s: float,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.policy = policy
        self.tpot_target_s = tpot_target_s
        self.autoscaler = Autoscaler(policy)
        self.on_decision = on_decision
        self.window_s = max(3.0, 3 * policy.interval_s)
        self._task: asyncio.Task | None = None

    def pressure(self, pool: Any, role: str) -> float | None:
        values = [
            cost_pressure(role, Window.of(n.history, self.window_s), self.tpot_target_s, n.stats)
            for n in pool.healthy_nodes()
            if n.reported
        ]
        return pool_load(values)

    def check(self, now: float | None = None) -> Decision:
        now = time.monotonic() if now is None else now
        decision = self.autoscaler.decide(
            now,
            self.pressure(self.prefill, "prefill"),
            self.pressure(self.decode, "decode"),
            len(self.prefill.healthy_nodes()),
            len(self.decode.healthy_nodes()),
        )
        if decision.action != "hold":
            source, target = (
                (self.decode, self.prefill)
                if decision.action == "to_prefill"
                else (self.prefill, self.decode)
            )
            node = min(source.healthy_nodes(), key=lambda n: (n.outstanding, n.stats.running))
            source.nodes.remove(node)
            target.nodes.append(node)
            logger.info(
                "autoscale: %s moves from the %s pool to the %s pool (prefill / decode pressure "
                "%.2f); now %d prefill, %d decode",
                node.name,
                source.name,
                target.name,
                decision.ratio,
                len(self.prefill.nodes),
                len(self.decode.nodes),
            )
        else:
            logger.debug("autoscale: hold (%s, ratio %s)", decision.reason, decision.ratio)
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision

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
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
