"""Routing policies: which node of a pool takes the next request.

A policy sees the pool's healthy nodes with the router's own live counts (requests and prompt
tokens it has in flight there) and each node's last reported engine stats, and returns one node.
How a node's load is measured depends on what the pool does, named explicitly by its role:
`prefill` (queued prompt tokens), `decode` (sequences in flight and KV pressure), `colocated`
(both).
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Callable

from router.links.nodes import Node

WAITING_PROMPT_TOKENS = 512
"""Prompt tokens counted for each request waiting in a prefill engine's queue."""


def prefill_load(node: Node) -> float:
    """Prompt tokens queued at a prefill node (its engine computes them in order)."""
    return node.outstanding_prompt_tokens + node.stats.waiting * WAITING_PROMPT_TOKENS


def decode_load(node: Node) -> float:
    """Sequences on a decode node, with KV cache pressure as the tie-breaker: the router's own,
    exact and current, plus the others its last health check found there (`elsewhere`: another
    router's, with several). Not the engine's reported count itself: that is this router's
    sequences again, up to a second old (adding it counted each twice, and ones that had
    ended)."""
    return node.outstanding + node.elsewhere + node.stats.kv_cache_usage


def colocated_load(node: Node) -> float:
    """An engine that prefills and decodes: its sequences, plus its queued prompts in units of
    the prompt tokens one waiting request stands for."""
    return decode_load(node) + prefill_load(node) / WAITING_PROMPT_TOKENS


LOADS: dict[str, Callable[[Node], float]] = {
    "prefill": prefill_load,
    "decode": decode_load,
    "colocated": colocated_load,
}

HISTORY_TOKENS_PER_SEQUENCE = 128
"""Uncached prompt tokens that weigh as much as one more sequence on a decode or colocated node."""
UNCACHED_TOKEN_COST: dict[str, float] = {
    "prefill": 1.0,
    "decode": 1.0 / HISTORY_TOKENS_PER_SEQUENCE,
    "colocated": 1.0 / HISTORY_TOKENS_PER_SEQUENCE,
}
"""What one prompt token a node does not hold in its prefix cache adds to its load, in the
role's load units. A prefill node's load is the prompt tokens queued there, so a token to
compute counts one — Dynamo's KV router's cost (prefill blocks to compute plus queued work),
in tokens. A decode or colocated node's load counts sequences, and `HISTORY_TOKENS_PER_SEQUENCE`
uncached tokens count as one more: a conversation whose 940-token history one node holds stays
there while the other nodes are less loaded by fewer than 7 sequences. Moving it costs more
than one turn's balance: its whole history is computed or sent again and stored twice, and the
turn that its node would have computed from its cache (placement's `cached_prefix`) becomes a
prefill and a hand-over. Measured with the router's own code on two decode nodes (fake engines,
12 conversations × 6 turns, tests/logic/test_prefixes.py): 1/512 per token kept 70–73 % of
turns on their node, 1/128 kept 87–100 %, by load alone 40–58 %; the conversations split 4–7 of
12 per node.
SGLang's gateway takes the longest match above a ratio unless the load imbalance passes a
threshold — two rules where this is one cost."""


class RoutingPolicy(ABC):
    def __init__(self, load: Callable[[Node], float], uncached_cost: float = 0.0) -> None:
        self.load = load
        self.uncached_cost = uncached_cost

    @abstractmethod
    def choose(self, nodes: list[Node]) -> Node:
        """Pick one of `nodes` (never empty)."""

    def choose_for(self, nodes: list[Node], uncached: list[int]) -> Node:
        """Pick one of `nodes` for a prompt of which each node lacks `uncached[i]` tokens: the
        least `load + uncached_cost × uncached`, ties by the policy. Where every node lacks the
        same (no node holds any of it, or all do), the policy alone chooses."""
        if not self.uncached_cost or len(set(uncached)) == 1:
            return self.choose(nodes)
        costs = [
            self.load(n) + self.uncached_cost * u for n, u in zip(nodes, uncached, strict=True)
        ]
        best = min(costs)
        tied = [n for n, cost in zip(nodes, costs, strict=True) if cost == best]
        return tied[0] if len(tied) == 1 else self.choose(tied)


class LeastOutstanding(RoutingPolicy):
    """The least loaded node; ties go round robin so equal nodes share the work."""

    def __init__(self, load: Callable[[Node], float], uncached_cost: float = 0.0) -> None:
        super().__init__(load, uncached_cost)
        self._turn = itertools.count()

    def choose(self, nodes: list[Node]) -> Node:
        turn = next(self._turn)
        return min(enumerate(nodes), key=lambda n: (self.load(n[1]), (n[0] - turn) % len(nodes)))[1]


class PowerOfTwo(RoutingPolicy):
    """The less loaded of two nodes drawn at random (cheap, and avoids herding on stale stats)."""

    def __init__(
        self,
        load: Callable[[Node], float],
        uncached_cost: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(load, uncached_cost)
        self._rng = rng or random.Random()

    def choose(self, nodes: list[Node]) -> Node:
        if len(nodes) == 1:
            return nodes[0]
        a, b = self._rng.sample(nodes, 2)
        return a if self.load(a) <= self.load(b) else b


class RoundRobin(RoutingPolicy):
    def __init__(self, load: Callable[[Node], float], uncached_cost: float = 0.0) -> None:
        super().__init__(load, uncached_cost)
        self._turn = itertools.count()

    def choose(self, nodes: list[Node]) -> Node:
        return nodes[next(self._turn) % len(nodes)]


POLICIES = {
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwo,
    "round_robin": RoundRobin,
}


def make_policy(name: str, role: str) -> RoutingPolicy:
    """Policy `name` measuring load as a pool of `role` ("prefill", "decode", "colocated"),
    weighing what each node holds of a prompt when it is told (`UNCACHED_TOKEN_COST`)."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    if role not in LOADS:
        raise ValueError(f"unknown pool role {role!r}; known: {', '.join(LOADS)}")
    return POLICIES[name](LOADS[role], UNCACHED_TOKEN_COST[role])
