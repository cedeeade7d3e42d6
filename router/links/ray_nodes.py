"""`NodeClient` over Ray: a node is an engine actor; its streams go over the node's token stream
(router/links/token_stream.py: legs out and deltas back on one TCP connection per node) or, with
`router.token_stream: ray`, as Ray streaming calls. Ray carries the node's other calls.

Ray reports a dead or restarting actor as `ActorDiedError` / `ActorUnavailableError` (within
milliseconds of the process dying); both become `NodeFailed`, and so does `EngineDown` (the
actor lives but its engine died). Other exceptions the node's own code raised (`KVLoadFailed`,
`RequestRejected`) arrive as themselves. A stream closed before the node's generator ended is
cancelled (a CANCEL on the token stream, `ray.cancel` on a Ray call): vLLM sees `CancelledError`
and aborts the request. A token stream that breaks asks Ray once whether the node died
(`_died`): a death counts toward a request's poison limit, a lost link does not.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from pdserve_core.engine.legs import Leg
from pdserve_core.engine.types import Checkup, EngineDown, NodeInfo, NodeStats, TokenDelta
from router.errors import NodeFailed
from router.links.nodes import NodeClient
from router.links.token_stream import CONNECT_S, TokenStream

logger = logging.getLogger(__name__)

NODE_FAILURES = (ActorDiedError, ActorUnavailableError, RayActorError)
DEATH_NOTICE_S = 2.0
"""How long a broken token stream waits for Ray's word on the node (a dead actor is known to Ray
within milliseconds; a node behind a cut link does not answer at all)."""


class RayNodeClient(NodeClient):
    def __init__(
        self,
        handle: Any,
        name: str = "",
        direct: bool = True,
        tls: ssl.SSLContext | None = None,
        secret: str | bytes = "",
    ) -> None:
        self.handle = handle
        self.name = name or str(handle)
        self.secret = secret
        """The cluster secret the token stream's handshake proves (the nodes were given it)."""
        self.tls = tls
        """Mutual TLS on the token stream (the KV plane's files); None: plain TCP."""
        self.direct = direct
        """Deltas over the node's token stream; False: over Ray streaming calls."""
        self._tokens: TokenStream | None = None
        self._connecting = asyncio.Lock()

    async def stream(self, leg: Leg) -> AsyncIterator[TokenDelta]:
        if not self.direct:
            async for delta in self._ray_stream(leg):
                yield delta
            return
        try:
            tokens = await self._token_stream()
            async for delta in tokens.stream(leg):
                yield delta
        except NODE_FAILURES as error:
            raise NodeFailed(type(error).__name__, died=isinstance(error, ActorDiedError)) from None
        except EngineDown as error:
            raise NodeFailed(error.message, died=True) from None

    async def _token_stream(self) -> TokenStream:
        """The open connection to the node's token stream, opened (again) when there is none."""
        tokens = self._tokens
        if tokens is not None and not tokens.broken:
            return tokens  # the common case: no lock to take
        async with self._connecting:
            if self._tokens is None or self._tokens.broken:
                try:
                    async with asyncio.timeout(CONNECT_S):
                        host, port = await self.handle.delta_endpoint.remote()
                except TimeoutError:
                    raise NodeFailed(f"{self.name} did not say where its token stream is") from None
                self._tokens = await TokenStream.connect(
                    self.name, host, port, self.secret, self.tls, self._died
                )
            return self._tokens

    async def _died(self) -> bool:
        """Whether the node died, by Ray's word within `DEATH_NOTICE_S`: its actor dead, or alive
        with no engine (restarted, or its engine found dead). No answer: a lost link."""
        try:
            async with asyncio.timeout(DEATH_NOTICE_S):
                return not await self.handle.check_health.remote()
        except ActorDiedError:
            return True
        except (TimeoutError, *NODE_FAILURES):
            return False

    async def _ray_stream(self, leg: Leg) -> AsyncIterator[TokenDelta]:
        call = self.handle.stream.options(num_returns="streaming").remote(leg)
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
                logger.info("%s leg %s cancelled on the node", leg.KIND, leg.request_id)

    async def start(self) -> NodeInfo:
        return await self._call("start")

    async def check_health(self) -> bool:
        return await self._call("check_health")

    async def stats(self) -> NodeStats:
        return await self._call("stats")

    async def give_back(self, handle: dict[str, Any]) -> bool:
        return await self._call("give_back", handle)

    async def end_follow(self, key: str) -> bool:
        return await self._call("end_follow", key)

    async def prefetch(
        self, key: str, host: str, ports: tuple[int, ...], num_tokens: int, block_size: int
    ) -> bool:
        return await self._call("prefetch", key, host, list(ports), num_tokens, block_size)

    async def drop_engine(self) -> None:
        await self._call("drop_engine")

    async def prefix_blocks(self, seen: int) -> tuple[int, list[list[int]]]:
        return await self._call("prefix_blocks", seen)

    async def checkup(self, seen: int | None) -> Checkup:
        return await self._call("checkup", seen)

    async def shutdown(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
        await self._call("shutdown")

    async def step_records(self, seen: int = 0) -> dict[str, Any]:
        return await self._call("step_records", seen)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args)
        except NODE_FAILURES as error:
            raise NodeFailed(type(error).__name__) from None
