"""The router's end of a node's token stream (pdserve_core/engine/deltas.py): one TCP connection per
node, its frames split into per-request queues.

The connection is opened with the cluster secret (both sides prove it: `router_hello`), and its
frames are data (pdserve_core/engine/frames.py): a frame that does not decode breaks the connection
and ends its streams, as a lost link does.

A stream opened here is a Ray call (`relay`) that carries the request to the node and a tag that
names its queue; the deltas arrive on the connection, in order, ended by `END` or the exception
the node's stream ended with. The Ray call's own end only matters when it fails — the actor died
or could not start the stream — and then it ends the stream too. A connection that breaks ends
every stream on it with `NodeFailed`; the next stream opens a new one.

Each stream's queue is bounded (`MAX_BACKLOG` deltas): a client that stops reading while its
request runs on leaves its deltas here, and past the bound the request is cancelled on the node
at once, the queue emptied, and the stream ends with `SlowReader` when (if ever) it is read again.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pdserve_core.engine.deltas import MAX_FRAME, new_key, router_hello, secret_bytes, tune
from pdserve_core.engine.frames import END, decode
from pdserve_core.kv.wire import ProtocolError
from router.errors import NodeFailed, SlowReader

logger = logging.getLogger(__name__)

CONNECT_S = 10.0
"""Connecting and hearing the node's acknowledgement, at most."""
LOST = object()
"""Queued to every stream of a connection that broke."""
DEATH_NOTICE_S = 2.0
"""How long a stream whose connection broke waits for its Ray call's end (an actor's death is
known to Ray within milliseconds; a link that failed leaves the call running)."""
CALL_ENDED = object()
"""Queued to a stream when its Ray call returned (or failed)."""
OVERFLOW = object()
"""Queued (alone) to a stream whose reader fell `MAX_BACKLOG` deltas behind."""
MAX_BACKLOG = 4096
"""Deltas one stream may hold unread (one per engine step per sequence): past it the request is
cancelled (`SlowReader`)."""


class Inbox:
    """One stream's queue: the deltas and events for it, at most `MAX_BACKLOG` of them."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self._ready = asyncio.Event()
        self.on_overflow: Callable[[], None] = lambda: None
        self.overflowed = False

    def put(self, item: Any) -> None:
        if self.overflowed:
            return
        if len(self.items) >= MAX_BACKLOG:
            self.overflowed = True
            self.items.clear()
            self.items.append(OVERFLOW)
            self.on_overflow()
        else:
            self.items.append(item)
        self._ready.set()

    async def get(self) -> Any:
        while not self.items:
            self._ready.clear()
            await self._ready.wait()
        return self.items.popleft()


class TokenStream:
    """One connection to one node, shared by every stream the router has open there."""

    def __init__(
        self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes
    ) -> None:
        self.name = name
        self.key = key
        self._writer = writer
        self._queues: dict[int, Inbox] = {}
        self._next_tag = 0
        self.broken: str | None = None
        self._reading = asyncio.get_running_loop().create_task(self._read(reader))

    @classmethod
    async def connect(
        cls,
        name: str,
        host: str,
        port: int,
        secret: str | bytes,
        tls: ssl.SSLContext | None = None,
    ) -> TokenStream:
        """Connect, prove the cluster `secret` and check the node's proof, open a channel."""
        key = new_key()
        writer = None
        try:
            async with asyncio.timeout(CONNECT_S):
                reader, writer = await asyncio.open_connection(host, port, ssl=tls)
                tune(writer.get_extra_info("socket"))
                await router_hello(reader, writer, secret_bytes(secret), key)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ProtocolError) as error:
            if writer is not None:  # ssl.SSLError is an OSError too
                writer.transport.abort()
            raise NodeFailed(
                f"cannot open the token stream to {name} at {host}:{port}: {error!r}"
            ) from None
        logger.info("token stream to %s open (%s:%d)", name, host, port)
        return cls(name, reader, writer, key)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "big")
                if size > MAX_FRAME:
                    raise ConnectionError(f"a {size}-byte frame")
                for tag, item in decode(await reader.readexactly(size)):
                    queue = self._queues.get(tag)
                    if queue is not None:  # else a stream the router has left already
                        queue.put(item)
        except asyncio.CancelledError:
            self.broken = "closed by the router"
            raise
        except Exception as error:  # EOF, reset, a frame that does not decode
            self.broken = f"token stream from {self.name} lost: {error!r}"
            logger.warning("%s", self.broken)
        finally:
            for queue in self._queues.values():
                queue.put(LOST)
            self._writer.close()

    async def stream(
        self, call: Callable[[bytes, int], Awaitable[Any]], cancel: Callable[[Any], None]
    ) -> AsyncIterator[Any]:
        """Open one stream: `call(key, tag)` starts the node's relay (a Ray ObjectRef);
        `cancel(ref)` stops it when the caller leaves before its end. Yields the deltas; raises
        what the node's stream ended with, or `NodeFailed` when the node or the connection is
        lost."""
        if self.broken:
            raise NodeFailed(self.broken)
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        queue = self._queues[tag] = Inbox()
        ref = call(self.key, tag)
        queue.on_overflow = lambda: cancel(ref)
        done = asyncio.ensure_future(ref)
        done.add_done_callback(lambda _: queue.put(CALL_ENDED))
        ended = False
        try:
            while True:
                item = await queue.get()
                if item is END:
                    ended = True
                    return
                if item is OVERFLOW:
                    ended = True  # cancelled on the node as it overflowed
                    logger.warning("a stream on %s: its reader fell behind; cancelled", self.name)
                    raise SlowReader(
                        f"the client read none of its last {MAX_BACKLOG} deltas: request cancelled"
                    )
                if item is CALL_ENDED:
                    if done.cancelled() or done.exception() is None:
                        continue  # the relay returned: its END is on the connection
                    ended = True
                    raise done.exception()
                if item is LOST:
                    # an actor that died closes its connection before Ray says so: wait a
                    # moment for Ray's word, which tells a death from a lost link
                    error = await _call_error(done)
                    if error is not None:
                        ended = True
                        raise error
                    raise NodeFailed(self.broken or f"token stream from {self.name} lost")
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
        finally:
            del self._queues[tag]
            if not ended:
                cancel(ref)
            if not done.done():
                done.cancel()
            elif not done.cancelled():
                done.exception()  # seen: not "never retrieved"

    def close(self) -> None:
        self._reading.cancel()


async def _call_error(done: asyncio.Future) -> BaseException | None:
    """The exception the stream's Ray call ended with, if it ends within `DEATH_NOTICE_S`."""
    if done.cancelled():
        return None
    try:
        async with asyncio.timeout(DEATH_NOTICE_S):
            await asyncio.shield(done)
    except TimeoutError:
        return None
    except Exception as error:
        return error
    return None
