"""The router's end of a node's token stream (pdserve_core/engine/deltas.py): one TCP connection per
node, the legs it opens there going out, their deltas coming back split into per-stream queues.

The connection is opened with the cluster secret (both sides prove it: `router_hello`), and its
frames are data (pdserve_core/engine/frames.py): a frame that does not decode breaks the connection
and ends its streams, as a lost link does.

A stream opened here is an OPEN frame carrying the leg and a tag that names its queue; the deltas
arrive on the connection, in order, ended by `END` or the exception the node's stream ended with.
A stream the caller leaves before its end sends a CANCEL. The streams opened (or left) in one
event-loop turn go out as one frame. A connection that breaks ends every stream on it with
`NodeFailed`, told as a death when the node's probe says so (`probe`, asked once per connection:
an actor that dies closes its connections before anyone asks), and the next stream opens a new
connection.

A stream's reader that falls behind takes the deltas of a sequence that queued meanwhile as one
(`Inbox.gather`), as vLLM's own server does: fewer, larger events when the router is busy, one
per delta when it keeps up.

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

from pdserve_core.engine.deltas import (
    HIGH_WATER,
    new_key,
    read_frame,
    router_hello,
    secret_bytes,
    tune,
)
from pdserve_core.engine.frames import CANCEL, END, OPEN, decode, encode_orders, leg_payload
from pdserve_core.engine.legs import Leg
from pdserve_core.engine.types import TokenDelta, joinable, joined
from pdserve_core.kv.wire import ProtocolError
from router.errors import NodeFailed, SlowReader

logger = logging.getLogger(__name__)

CONNECT_S = 10.0
"""Connecting and hearing the node's acknowledgement, at most."""
LOST = object()
"""Queued to every stream of a connection that broke."""
MAX_UNSENT = 16 * HIGH_WATER
"""Bytes of legs a node may leave unread on the connection before the router gives it up."""
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

    def gather(self, delta: TokenDelta) -> TokenDelta:
        """`delta` with the deltas of its sequence queued right behind it, as one: a reader that
        fell behind takes what arrived meanwhile in one piece (as vLLM's own output collector
        does), and never waits for more."""
        items, run = self.items, [delta]
        while items and isinstance(items[0], TokenDelta) and joinable(run[-1], items[0]):
            run.append(items.popleft())
        return joined(run)


class TokenStream:
    """One connection to one node, shared by every stream the router has open there."""

    def __init__(
        self,
        name: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        key: bytes,
        probe: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.name = name
        self.key = key
        self._writer = writer
        self._queues: dict[int, Inbox] = {}
        self._next_tag = 0
        self._orders: list[tuple[int, int, Any]] = []
        self.broken: str | None = None
        self.probe = probe
        """`probe()`: whether the node died (True) or is there (False), asked once when the
        connection breaks; None: a broken connection is a lost link."""
        self._died: asyncio.Future | None = None
        self._reading = asyncio.get_running_loop().create_task(self._read(reader))

    @classmethod
    async def connect(
        cls,
        name: str,
        host: str,
        port: int,
        secret: str | bytes,
        tls: ssl.SSLContext | None = None,
        probe: Callable[[], Awaitable[bool]] | None = None,
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
        return cls(name, reader, writer, key, probe)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (frame := await read_frame(reader)) is not None:
                for tag, item in decode(frame):
                    queue = self._queues.get(tag)
                    if queue is not None:  # else a stream the router has left already
                        queue.put(item)
            raise ConnectionError("the node closed the connection")
        except asyncio.CancelledError:
            self.broken = "closed by the router"
            raise
        except Exception as error:  # EOF, reset, a frame too large or that does not decode
            self.broken = self.broken or f"token stream from {self.name} lost: {error!r}"
            logger.warning("%s", self.broken)
        finally:
            for queue in self._queues.values():
                queue.put(LOST)
            self._writer.close()

    async def stream(self, leg: Leg) -> AsyncIterator[Any]:
        """Open one stream: the node runs `leg`. Yields its deltas; raises what the node's stream
        ended with, or `NodeFailed` when the node or the connection is lost."""
        if self.broken:
            raise NodeFailed(self.broken)
        payload = leg_payload(leg)
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        queue = self._queues[tag] = Inbox()
        queue.on_overflow = lambda: self._order(tag, CANCEL, None)
        self._order(tag, OPEN, payload)
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
                if item is LOST:
                    ended = True  # the node stops what a closed connection opened
                    died = await self._node_died()
                    raise NodeFailed(
                        self.broken or f"token stream from {self.name} lost", died=died
                    )
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield queue.gather(item) if isinstance(item, TokenDelta) else item
        finally:
            del self._queues[tag]
            if not ended:
                self._order(tag, CANCEL, None)

    def _order(self, tag: int, kind: int, payload: Any) -> None:
        """Queue an OPEN or a CANCEL; this loop turn's orders leave as one frame."""
        if self.broken:
            return
        if not self._orders:
            asyncio.get_running_loop().call_soon(self._send_orders)
        self._orders.append((tag, kind, payload))

    def _send_orders(self) -> None:
        batch, self._orders = self._orders, []
        if self.broken or self._writer.is_closing():
            return
        self._writer.write(encode_orders(batch))
        if self._writer.transport.get_write_buffer_size() > MAX_UNSENT:
            self.broken = f"{self.name} left {MAX_UNSENT} bytes of legs unread"
            logger.warning("%s", self.broken)
            self._writer.transport.abort()

    async def _node_died(self) -> bool:
        """The probe's answer for this connection, asked once whatever the streams on it."""
        if self.probe is None:
            return False
        if self._died is None:
            self._died = asyncio.ensure_future(self.probe())
        try:
            return await asyncio.shield(self._died)
        except Exception as error:
            logger.warning("probing %s after its token stream broke: %r", self.name, error)
            return False

    def close(self) -> None:
        self._reading.cancel()
