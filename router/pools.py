"""Pools of engine nodes as the router sees them: handles, live load, and one streaming call.

`Pool.stream` is the only place the router talks to an engine actor: it opens Ray's streaming
generator, enforces the request's deadline, turns Ray's actor failures into named errors, and
cancels the engine-side request when the caller stops listening (client gone, deadline, error).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from pdserve.engine import TokenDelta
from router.errors import DeadlineExceeded, EngineFailed, PoolUnavailable

logger = logging.getLogger(__name__)


@dataclass
class Node:
    name: str
    handle: Any  # ray.actor.ActorHandle
    info: dict = field(default_factory=dict)
    healthy: bool = True
    outstanding: int = 0


class Pool:
    def __init__(self, name: str, nodes: list[Node]) -> None:
        self.name = name
        self.nodes = nodes
        self._tiebreak = itertools.count()

    def healthy_nodes(self) -> list[Node]:
        return [node for node in self.nodes if node.healthy]

    def pick(self) -> Node:
        """The healthy node with the least outstanding requests (round robin among equals)."""
        healthy = self.healthy_nodes()
        if not healthy:
            raise PoolUnavailable(f"no healthy node in the {self.name} pool")
        turn = next(self._tiebreak)
        return min(healthy, key=lambda n: (n.outstanding, (healthy.index(n) - turn) % len(healthy)))

    async def stream(
        self, node: Node, request_id: str, token_ids: list[int], params: Any, deadline: float
    ) -> AsyncIterator[TokenDelta]:
        """Yield the engine's deltas for one request until it finishes or `deadline` (monotonic)."""
        node.outstanding += 1
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
        except (ActorDiedError, ActorUnavailableError, RayActorError) as error:
            node.healthy = False
            logger.error("node %s failed during %s: %s", node.name, request_id, error)
            raise EngineFailed(
                f"{self.name} node {node.name} failed: {type(error).__name__}"
            ) from None
        finally:
            node.outstanding -= 1
            if not finished:
                ray.cancel(stream)
                logger.info("request %s cancelled on %s", request_id, node.name)
