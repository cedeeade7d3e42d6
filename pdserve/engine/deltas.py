"""The token path: a node's request outputs to the router over one TCP connection, not Ray.

Ray carries each request's opening (`EngineActor.relay`, one call per request or leg) and stays
the control plane: placement, health, restarts, cancellation. The tokens take a shorter road.
Each engine actor listens on its host's cluster address; each router connects once and says
which channel it is (a random key). Every delta the node's requests produce is queued on that
router's channel and sent on the next turn of the actor's event loop, so one engine step's
outputs for all of the router's requests on the node leave as one frame — as vLLM's engine core
hands its outputs over, one batch per step.

A frame is a 4-byte big-endian length and a pickled list of (tag, item): the router's tag for a
stream, and a `TokenDelta`, `END` (the stream finished), or the exception that ended it. The
actor only writes to the connection (past the key it reads nothing), so nothing a peer sends is
ever unpickled here; the router unpickles only what the nodes it placed send, as with Ray.

Flow control: when a router reads slower than its requests produce, the connection's buffer
fills and each request's relay waits for it to drain (vLLM keeps merging that request's new
tokens meanwhile, as it does for any slow reader), so a node never holds more than
`HIGH_WATER` unsent bytes per router.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import socket
import ssl
from typing import Any

from pdserve.engine.types import EngineDown
from pdserve.tls import client_context, server_context

logger = logging.getLogger(__name__)

KEY_BYTES = 32
"""A channel's key: 16 random bytes, hex."""
ACK = b"\x01"
HELLO_S = 10.0
"""A connection that has not named its channel this long after connecting is closed."""
HIGH_WATER = 4 << 20
"""Unsent bytes on one channel beyond which the requests' relays wait for the router."""
MAX_FRAME = 256 << 20
"""Largest frame a router accepts (a frame is one loop turn's deltas: far below this)."""
END = None
"""The item that ends a stream: the node's generator ran out."""


USER_TIMEOUT_MS = 10_000
"""Sent bytes left unacknowledged this long break the connection (TCP_USER_TIMEOUT): a link cut
for longer does not keep a stream waiting on a connection that will never deliver."""
KEEPALIVE = ((socket.TCP_KEEPIDLE, 5), (socket.TCP_KEEPINTVL, 2), (socket.TCP_KEEPCNT, 3))
"""An idle connection is probed after 5 s, every 2 s, and given up after 3 unanswered probes."""


def tune(sock: socket.socket | None) -> None:
    """Both ends of a token stream: no Nagle delay (a frame is one step's tokens: send it now),
    keepalive probes and a bound on unacknowledged data, so a dead peer is found in seconds."""
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE:
        sock.setsockopt(socket.IPPROTO_TCP, option, value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


def server_tls(files: dict[str, str] | None) -> ssl.SSLContext | None:
    """A node's side of the token stream on mutual TLS, from the KV plane's files
    (`kv_transfer.tls`: cert_file, key_file, ca_file); None: plain TCP."""
    if not files:
        return None
    return server_context(files["cert_file"], files["key_file"], files["ca_file"])


def client_tls(files: dict[str, str] | None, check_hostname: bool = True) -> ssl.SSLContext | None:
    """The router's side: it presents the same host certificate and checks the node's."""
    if not files:
        return None
    return client_context(files["ca_file"], files["cert_file"], files["key_file"], check_hostname)


def new_key() -> bytes:
    return secrets.token_hex(KEY_BYTES // 2).encode()


def frame(batch: list[tuple[int, Any]]) -> bytes:
    data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "big") + data


def ending(error: BaseException, where: str) -> BaseException:
    """What the router is told a stream ended with: the exception itself where it survives the
    trip (as Ray carried it: vLLM's own ValueError still reads as one to vLLM's server), else a
    RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return RuntimeError(f"{where} failed: {error!r}")
    return error


class Channel:
    """One router's connection: deltas queued, sent one frame per loop turn."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: list[tuple[int, Any]] = []
        self.closed = False
        self.frames_sent = 0
        self.items_sent = 0

    def send(self, tag: int, item: Any) -> None:
        if self.closed:
            return
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append((tag, item))

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        if self.closed or self.writer.is_closing():
            return
        self.writer.write(frame(batch))
        self.frames_sent += 1
        self.items_sent += len(batch)

    @property
    def congested(self) -> bool:
        return self.writer.transport.get_write_buffer_size() > HIGH_WATER

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except ConnectionError:
            self.closed = True


class DeltaServer:
    """The engine actor's listener: one `Channel` per connected router, found by its key."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.channels: dict[bytes, Channel] = {}
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()

    async def endpoint(
        self, host: str, advertised: str, tls: ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        """(host, port) a router connects to: the listener on `host` (started on the first ask,
        on mutual TLS with `tls`), told as `advertised`."""
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._accept, host, 0, ssl=tls)
                port = self._server.sockets[0].getsockname()[1]
                logger.info("%s streams tokens on %s:%d (as %s)", self.name, host, port, advertised)
        return advertised, self._server.sockets[0].getsockname()[1]

    def channel(self, key: bytes) -> Channel:
        channel = self.channels.get(key)
        if channel is None or channel.closed:
            raise EngineDown(f"{self.name} has no token stream open to this router")
        return channel

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        tune(writer.get_extra_info("socket"))
        try:
            key = await asyncio.wait_for(reader.readexactly(KEY_BYTES), HELLO_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            logger.info(
                "%s: token stream from %s closed before naming its channel", self.name, peer
            )
            writer.close()
            return
        channel = self.channels[key] = Channel(writer)
        writer.write(ACK)
        logger.info("%s: router %s opened a token stream", self.name, peer)
        try:
            await reader.read()  # nothing more comes; this returns when the router closes
        except ConnectionError:
            pass
        finally:
            channel.closed = True
            if self.channels.get(key) is channel:
                del self.channels[key]
            writer.close()
            logger.info(
                "%s: token stream to %s closed (%d deltas in %d frames)",
                self.name,
                peer,
                channel.items_sent,
                channel.frames_sent,
            )

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for channel in self.channels.values():
            channel.closed = True
            channel.writer.close()
