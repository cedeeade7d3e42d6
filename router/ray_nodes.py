"""`NodeClient` over Ray: a node is an engine actor, its streaming methods Ray streaming calls.

Ray reports a dead or restarting actor as `ActorDiedError` / `ActorUnavailableError` (within
milliseconds of the process dying); both become `NodeFailed`, and so does `EngineDown` (the
actor lives but its engine died). Other exceptions the node's own code raised (`KVLoadFailed`,
`RequestRejected`) arrive as themselves. A stream closed before the node's generator ended is
cancelled with `ray.cancel`: vLLM sees `CancelledError` and aborts the request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from pdserve.engine.types import EngineDown, NodeInfo, NodeStats, TokenDelta
from router.errors import NodeFailed
from router.nodes import NodeClient

logger = logging.getLogger(__name__)

NODE_FAILURES = (ActorDiedError, ActorUnavailableError, RayActorError)


class RayNodeClient(NodeClient):
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def stream(self, method: str, *args: Any) -> AsyncIterator[TokenDelta]:
        call = getattr(self.handle, method).options(num_returns="streaming").remote(*args)
        ended = False  # the node's generator ran out: nothing left there to cancel
        try:
            async for ref in call:
                delta: TokenDelta = await ref
                yield delta
            ended = True
        except NODE_FAILURES as error:
            raise NodeFailed(type(error).__name__, died=isinstance(error, ActorDiedError)) from None
        except EngineDown as error:
            raise NodeFailed(error.message, died=True) from None
        finally:
            # a delta with a finish reason is not the end: with n > 1 the other sequences
            # still run there, and a caller leaving now must stop them too
            if not ended:
                ray.cancel(call)
                logger.info("%s call %s cancelled on the node", method, args[0] if args else "")

    async def start(self) -> NodeInfo:
        return await self._call("start")

    async def check_health(self) -> bool:
        return await self._call("check_health")

    async def stats(self) -> NodeStats:
        return await self._call("stats")

    async def give_back(self, handle: dict[str, Any]) -> bool:
        return await self._call("give_back", handle)

    async def prefetch(
        self, key: str, host: str, ports: tuple[int, ...], num_tokens: int, block_size: int
    ) -> bool:
        return await self._call("prefetch", key, host, list(ports), num_tokens, block_size)

    async def drop_engine(self) -> None:
        await self._call("drop_engine")

    async def shutdown(self) -> None:
        await self._call("shutdown")

    async def step_records(self, seen: int = 0) -> dict[str, Any]:
        return await self._call("step_records", seen)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args)
        except NODE_FAILURES as error:
            raise NodeFailed(type(error).__name__) from None
