"""Routing policies: which node of a pool takes the next request.

Each policy sees the pool's healthy nodes with the router's own live counts (requests and
prompt tokens it has in flight there) and the node's last reported engine stats (running and
waiting sequences, KV cache usage), and returns one node.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.pools import Node


def prefill_load(node: Node) -> float:
    """Prompt tokens queued at a prefill node (its engine computes them in order)."""
    return node.outstanding_prompt_tokens + node.stats.get("waiting", 0) * 512


def decode_load(node: Node) -> float:
    """Sequences a decode node is running, with KV cache pressure as the tie-breaker."""
    return node.outstanding + node.stats.get("running", 0) + node.stats.get("kv_cache_usage", 0.0)


class RoutingPolicy(ABC):
    def __init__(self, role: str) -> None:
        self.load = prefill_load if role == "prefill" else decode_load

    @abstractmethod
    def choose(self, nodes: list[Node]) -> Node:
        """Pick one of `nodes` (never empty)."""


class LeastOutstanding(RoutingPolicy):
    """The least loaded node; ties go round robin so equal nodes share the work."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self._turn = itertools.count()

    def choose(self, nodes: list[Node]) -> Node:
        turn = next(self._turn)
        return min(enumerate(nodes), key=lambda n: (self.load(n[1]), (n[0] - turn) % len(nodes)))[1]


class PowerOfTwo(RoutingPolicy):
    """The less loaded of two nodes drawn at random (cheap, and avoids herding on stale stats)."""

    def __init__(self, role: str, rng: random.Random | None = None) -> None:
        super().__init__(role)
        self._rng = rng or random.Random()

    def choose(self, nodes: list[Node]) -> Node:
        if len(nodes) == 1:
            return nodes[0]
        a, b = self._rng.sample(nodes, 2)
        return a if self.load(a) <= self.load(b) else b


class RoundRobin(RoutingPolicy):
    def __init__(self, role: str) -> None:
        super().__init__(role)
        self._turn = itertools.count()

    def choose(self, nodes: list[Node]) -> Node:
        return nodes[next(self._turn) % len(nodes)]


POLICIES = {
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwo,
    "round_robin": RoundRobin,
}


def make_policy(name: str, role: str) -> RoutingPolicy:
    try:
        return POLICIES[name](role)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
