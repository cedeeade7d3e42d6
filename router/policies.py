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

from router.nodes import Node

WAITING_PROMPT_TOKENS = 512
"""Prompt tokens counted for each request waiting in a prefill engine's queue."""


def prefill_load(node: Node) -> float:
    """Prompt tokens queued at a prefill node (its engine computes them in order)."""
    return node.outstanding_prompt_tokens + node.stats.waiting * WAITING_PROMPT_TOKENS


def decode_load(node: Node) -> float:
    """Sequences the router has on a decode node, with KV cache pressure as the tie-breaker. The
    router's own count is exact and current; the engine's reported `running` is the same
    sequences as of its last health check (up to a second old: adding it counted each sequence
    twice, and ones that had ended)."""
    return node.outstanding + node.stats.kv_cache_usage


def colocated_load(node: Node) -> float:
    """An engine that prefills and decodes: its sequences, plus its queued prompts in units of
    the prompt tokens one waiting request stands for."""
    return decode_load(node) + prefill_load(node) / WAITING_PROMPT_TOKENS


LOADS: dict[str, Callable[[Node], float]] = {
    "prefill": prefill_load,
    "decode": decode_load,
    "colocated": colocated_load,
}


class RoutingPolicy(ABC):
    def __init__(self, load: Callable[[Node], float]) -> None:
        self.load = load

    @abstractmethod
    def choose(self, nodes: list[Node]) -> Node:
        """Pick one of `nodes` (never empty)."""


class LeastOutstanding(RoutingPolicy):
    """The least loaded node; ties go round robin so equal nodes share the work."""

    def __init__(self, load: Callable[[Node], float]) -> None:
        super().__init__(load)
        self._turn = itertools.count()

    def choose(self, nodes: list[Node]) -> Node:
        turn = next(self._turn)
        return min(enumerate(nodes), key=lambda n: (self.load(n[1]), (n[0] - turn) % len(nodes)))[1]


class PowerOfTwo(RoutingPolicy):
    """The less loaded of two nodes drawn at random (cheap, and avoids herding on stale stats)."""

    def __init__(self, load: Callable[[Node], float], rng: random.Random | None = None) -> None:
        super().__init__(load)
        self._rng = rng or random.Random()

    def choose(self, nodes: list[Node]) -> Node:
        if len(nodes) == 1:
            return nodes[0]
        a, b = self._rng.sample(nodes, 2)
        return a if self.load(a) <= self.load(b) else b


class RoundRobin(RoutingPolicy):
    def __init__(self, load: Callable[[Node], float]) -> None:
        super().__init__(load)
        self._turn = itertools.count()

    def choose(self, nodes: list[Node]) -> Node:
        return nodes[next(self._turn) % len(nodes)]


POLICIES = {
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwo,
    "round_robin": RoundRobin,
}


def make_policy(name: str, role: str) -> RoutingPolicy:
    """Policy `name` measuring load as a pool of `role` ("prefill", "decode", "colocated")."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    if role not in LOADS:
        raise ValueError(f"unknown pool role {role!r}; known: {', '.join(LOADS)}")
    return POLICIES[name](LOADS[role])
