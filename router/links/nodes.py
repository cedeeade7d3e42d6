"""Engine nodes as the router sees them: a client to reach the node, and its live state.

`NodeClient` is the one interface between the router and a node process: production uses
`RayNodeClient` (router/links/ray_nodes.py, a Ray actor handle); tests use fakes. Everything else in
the router (pools, policies, dispatch, metrics) works on `Node`s and never imports Ray or vLLM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve_core.engine.legs import Leg
from pdserve_core.engine.types import Checkup, NodeInfo, NodeStats, TokenDelta
from router import clock
from router.decides.prefixes import NodePrefixes

STATS_HISTORY = 120
"""Stats samples kept per node (two minutes at the 1 s health-check interval)."""


class NodeClient(ABC):
    """How the router reaches one node. Methods raise `router.errors.NodeFailed` when the node
    died or cannot be reached; any other exception is the node's own answer."""

    @abstractmethod
    def stream(self, leg: Leg) -> AsyncIterator[TokenDelta]:
        """Run one leg (pdserve_core/engine/legs.py: a whole request, a prefill or a decode) on the
        node and yield its deltas. Closing the iterator before the last delta cancels the call
        on the node, which aborts the request in its engine and frees its blocks."""

    @abstractmethod
    async def start(self) -> NodeInfo:
        """Build the node's engine (after a restart the node is up without one)."""

    @abstractmethod
    async def check_health(self) -> bool:
        """True when the engine is up; False when the node runs without an engine."""

    @abstractmethod
    async def stats(self) -> NodeStats:
        """The node's current load and running totals."""

    async def prefix_blocks(self, seen: int) -> tuple[int, list[list[int]]]:
        """The blocks the node's requests left in its engine, from its log's entry `seen` on
        (pdserve_core/engine/blocks.py): (where to ask from next, the entries). A node that
        keeps no log has none."""
        return seen, []

    async def checkup(self, seen: int | None) -> Checkup:
        """One health check's answers: `check_health`, `stats` and, unless `seen` is None,
        `prefix_blocks(seen)`. A node reached over a link answers all three in one call."""
        healthy = await self.check_health()
        stats = await self.stats()
        blocks = None if seen is None else await self.prefix_blocks(seen)
        return healthy, stats, blocks

    async def give_back(self, handle: dict[str, Any]) -> bool:
        """Free the KV a prefill leg of this node left under `handle`: no decode leg will read
        it. A node that keeps no KV for others has none to free."""
        return False

    async def end_follow(self, key: str) -> bool:
        """End the follow of prefill `key` on this (prefill) node: that prefill will not run (its
        leg failed or was cancelled before vLLM had it), so its follower stops waiting now."""
        return False

    async def prefetch(
        self, key: str, host: str, ports: tuple[int, ...], num_tokens: int, block_size: int
    ) -> bool:
        """Follow the prefill `key` names on the KV server at `host` and stage its KV for the
        decode leg to come (decode_node/staging.py). A node that takes no prefetches declines."""
        return False

    async def shutdown(self) -> None:
        """Shut the node's engine down (the autoscaler stops a node it drained)."""
        raise NotImplementedError

    async def drop_engine(self) -> None:
        """End the node's engine (it is stuck); the node stays up without one, so its next health
        check says so and the pool builds a new engine."""
        raise NotImplementedError

    async def step_records(self, seen: int = 0) -> dict[str, Any]:
        """The engine's kept per-step records after the first `seen` and what a fit needs
        (`EngineActor.step_records`); a node that keeps none has none."""
        return {"steps_seen": 0, "records": []}


@dataclass
class Node:
    name: str
    client: NodeClient
    info: NodeInfo | None = None
    healthy: bool = True
    outstanding: int = 0
    """Requests (or request legs) the router has open on the node."""
    elsewhere: int = 0
    """Sequences on the node that are not this router's, as its last health check found them:
    the engine's running and waiting less the requests this router had open there then (other
    routers', with several; at least 0)."""
    outstanding_prompt_tokens: int = 0
    """Prompt tokens of those requests."""
    prefilling_tokens: int = 0
    """Prompt tokens the router sent the node to compute ("prefill", "generate") and has not seen
    a token of yet: the prefill work queued there (router/decides/placement.py)."""
    stats: NodeStats = field(default_factory=NodeStats)
    """What the node reported in its last health check."""
    stats_asked: float | None = None
    """When (router clock) the health check that brought `stats` asked for them: they count
    everything the node did before then. None until the node has reported."""
    restarting: bool = False
    failed_starts: int = 0
    """Engine builds that failed in a row (the next waits longer: router/pools.py)."""
    next_start: float = 0.0
    """Monotonic time before which no new engine build is tried."""
    missed_checks: int = 0
    last_heard: float = field(default_factory=clock.now)
    """When the node last answered (a delta on any of its streams, or a health check): a node
    silent for longer than the pool's `silence_s` is treated as lost (router/pools.py)."""
    stuck: bool = False
    """Its engine holds requests and has stepped not once in the pool's `stall_s`."""
    steps_seen: tuple[int, float] = (-1, 0.0)
    """(the engine's step count, when it last changed or the engine had nothing to do)."""
    checking: Any = None
    """The health check in flight, if any (one at a time per node)."""
    history: deque = field(default_factory=lambda: deque(maxlen=STATS_HISTORY))
    """(monotonic time, counters) of recent health checks: the metrics' rate windows."""
    prefixes: NodePrefixes = field(default_factory=NodePrefixes)
    """The prompt blocks its engine is taken to hold in its prefix cache
    (router/decides/prefixes.py)."""
    blocks_seen: int = 0
    """How far the router has read the node's block log (`NodeClient.prefix_blocks`)."""

    @property
    def reported(self) -> bool:
        """Whether the node has reported stats yet."""
        return self.stats_asked is not None

    def cached_tokens(self, prefix: Any) -> int:
        """Tokens at the start of `prefix` (a `router.decides.prefixes.Prefix`) this node is taken
        to hold; 0 without one."""
        return self.prefixes.cached_tokens(self.info, prefix) if prefix is not None else 0
