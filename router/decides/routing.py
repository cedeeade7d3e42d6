"""Where a request runs: one decision, made once before it runs, returned as one value.

`Routing.route(prompt_tokens, params)` reads the pools as they are now and returns a `Route`: the
node that serves the request whole, or the prefill node that computes its prompt and the decode node
that decodes it; where its first token is sampled (router/decides/seam.py); why (the reason the
metrics count); and, for an adaptive placement, the estimate it compared — computed for the very
nodes the route names. The dispatcher (router/dispatch.py) only carries a route out, the metrics
read it as data, and the simulator (pdserve/sim/cluster.py) routes with this same code.

Disaggregated, in this order:
1. No healthy decode node: a prefill node serves the request whole (`no_decode_node`).
2. `max_tokens: 1`: nothing to hand over, a prefill node serves it whole (`one_token`).
3. A decode node is chosen (the pool's policy), then where the prompt is computed:
   prompt logprobs need the engine that computes the prompt, so the decode node serves it whole
   (`one_engine`); with no healthy prefill node the decode node prefills for itself
   (`no_prefill_node`, a 503 instead with `router.prefill_fallback` off); otherwise a prefill
   node is chosen (its pool's policy) and `router/decides/placement.py` decides for that pair: while
   nothing needs splitting, one of the two serves it whole (`spread`); else local or remote
   (its reasons: `mode`, `short`, `long`, `cached_prefix`, `remote_in_time`,
   `prefill_backlog`, `remote_faster`, `stall`).
With a prompt's `Prefix`, each pool's choice weighs what its nodes hold of the prompt
(router/decides/policies.py, `choose_for`), and placement compares the tokens each side would
compute. Colocated: the pool's chosen node serves it whole (`colocated`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.decides import seam
from router.decides.placement import DECISIONS, LOCAL, REMOTE, Estimate, Placement
from router.decides.prefixes import Prefix
from router.errors import PoolUnavailable
from router.links.nodes import Node
from router.pools import Pool

WHOLE_REASONS = ("colocated", "no_decode_node", "one_token", "one_engine", "no_prefill_node")
"""Why a request runs whole on one node, outside the placement rule's own reasons."""


@dataclass(frozen=True)
class Route:
    """Where one request runs and why."""

    node: Node
    """The node that serves the request whole, or (split) the decode node."""
    pool: str
    """`node`'s pool."""
    reason: str
    """Why this route: one of `WHOLE_REASONS`, or the placement rule's reason."""
    prefill: Node | None = None
    """Split: the prefill node that computes the prompt and hands its KV over."""
    first_token: seam.Placement = seam.ONE_ENGINE
    """Split: which leg samples the first token (router/decides/seam.py)."""
    estimate: Estimate | None = None
    """An adaptive placement's numbers, for `node` and `prefill`."""
    cached_tokens: int = 0
    """Prompt tokens the node that computes the prompt is taken to hold in its prefix cache
    (router/decides/prefixes.py): what it skips."""

    @property
    def split(self) -> bool:
        return self.prefill is not None

    @property
    def where(self) -> str:
        """Where the prompt is computed, as the placement metric labels it."""
        return REMOTE if self.split else LOCAL

    def legs(self) -> list[tuple[str, str]]:
        """(pool, node) of each leg, in order (what `pdserve_routing_decisions_total` counts)."""
        if self.prefill is None:
            return [(self.pool, self.node.name)]
        return [("prefill", self.prefill.name), (self.pool, self.node.name)]

    def placed(self, mode: str) -> bool:
        """Whether the placement rule decided this route (`mode`'s reasons), rather than a
        fallback or the request's own shape."""
        return self.reason in DECISIONS[mode]


class Routing:
    """The one routing decision over a colocated pool, or a prefill and a decode pool."""

    def __init__(
        self,
        decode: Pool,
        prefill: Pool | None = None,
        placement: Placement | None = None,
        *,
        prefill_fallback: bool,
    ) -> None:
        if prefill is not None and placement is None:
            raise ValueError("a prefill pool needs a placement rule")
        self.decode, self.prefill = decode, prefill
        self.placement = placement
        self.prefill_fallback = prefill_fallback

    def check_available(self) -> None:
        """Refuse (503) a request no node could serve now."""
        decode = self.decode.healthy_nodes()
        if self.prefill is None:
            if not decode:
                raise PoolUnavailable(f"no healthy node in the {self.decode.name} pool")
            return
        prefill = self.prefill.healthy_nodes()
        if not decode and not prefill:
            raise PoolUnavailable("no healthy node in either pool")
        if not prefill and not self.prefill_fallback:
            raise PoolUnavailable("no healthy node in the prefill pool (fallback is off)")

    def route(self, prompt_tokens: int, params: Any, prefix: Prefix | None = None) -> Route:
        """Where a request of `prompt_tokens` with sampling `params` runs, now; `prefix`: the
        prompt's blocks (router/decides/prefixes.py), for the pools to weigh what each node holds of
        it and placement to count only what is not cached."""

        def whole(pool: Pool, reason: str, node: Node | None = None, **more: Any) -> Route:
            node = node or pool.pick(prefix=prefix)
            return Route(node, pool.name, reason, cached_tokens=node.cached_tokens(prefix), **more)

        if self.prefill is None:
            return whole(self.decode, "colocated")
        self.placement.arrived(prompt_tokens)
        prefill = self.prefill.healthy_nodes()
        no_decode = not self.decode.healthy_nodes()
        if prefill and (no_decode or params.max_tokens == 1):
            return whole(self.prefill, "no_decode_node" if no_decode else "one_token")
        decode = self.decode.pick(prefix=prefix)
        first_token = seam.placement(params)
        if first_token == seam.ONE_ENGINE:
            return whole(self.decode, "one_engine", decode)
        if not prefill:
            if not self.prefill_fallback:
                raise PoolUnavailable("no healthy node in the prefill pool")
            return whole(self.decode, "no_prefill_node", decode)
        target = self.prefill.pick(prefix=prefix)
        cached_d, cached_p = decode.cached_tokens(prefix), target.cached_tokens(prefix)
        spread = self.placement.spread(prompt_tokens, decode, target, cached_d, cached_p)
        if spread is target:
            return whole(self.prefill, "spread", target)
        if spread is decode:
            return whole(self.decode, "spread", decode)
        decision = self.placement.decide(prompt_tokens, decode, target, cached_d, cached_p)
        if decision.where == LOCAL:
            return whole(self.decode, decision.reason, decode, estimate=decision.estimate)
        return Route(
            decode,
            self.decode.name,
            decision.reason,
            prefill=target,
            first_token=first_token,
            estimate=decision.estimate,
            cached_tokens=cached_p,
        )
