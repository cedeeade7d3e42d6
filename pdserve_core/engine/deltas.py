"""The token path: the router's legs to a node and their outputs back, over one TCP connection
per router and node, not Ray.

Ray stays the control plane (placement, health, restarts, the node's other calls); a request's
legs and their tokens take a shorter road. Each engine actor listens where its KV server binds
(`kv_transfer.host`); each router connects once, and the two prove the cluster secret to each
other before anything else:

    node   -> Challenge     (protocol version, random nonce)
    router -> AuthResponse  (its nonce, HMAC-SHA256(secret, router role | both nonces))
    node   -> AuthResult    (ok + its own HMAC under the node role: mutual proof; or why not)
    router -> the channel's key (32 bytes, random)
    node   -> ACK; then frames both ways:
    router -> OPEN (a stream tag and the leg to run) / CANCEL (a tag)
    node   -> each stream's deltas, then its END or the exception that ended it

(the messages and proofs are the KV plane's, pdserve_core/kv/wire.py, under roles of their own;
the frames are data only, pdserve_core/engine/frames.py). With `kv_transfer.tls` the connection
is mutual TLS first, inside the same deadline. A node registers a channel only for a router that
proved the secret, and never lets a second connection take a key that is open. Each OPEN starts
a task that runs the leg (`DeltaServer.run`, the engine actor's); every delta the node's
requests produce is queued on that router's channel and sent on the next turn of the actor's
event loop, so one engine step's outputs for all of the router's requests on the node leave as
one frame — as vLLM's engine core hands its outputs over, one batch per step. A CANCEL, or the
connection's end, cancels the task: vLLM aborts the request and frees its blocks.

What a peer can spend here is bounded: `MAX_CONNECTIONS` connections at once, of them
`MAX_UNPROVEN_PER_PEER` per address not yet past the handshake; `HELLO_S` to finish it (else the
connection is closed: no descriptor outlives it; with TLS, asyncio bounds the TLS handshake by the
same `HELLO_S` before the connection is counted); a few hundred bytes read before the proof. Past
it, a frame of at most `MAX_FRAME` bytes and `MAX_STREAMS` streams open per router: a frame that
does not decode, or an OPEN for a tag already open, ends the connection; a leg that does not
decode, or one past the stream cap, fails only its own stream.

Flow control: when a router reads slower than its requests produce, the connection's buffer
fills and each request's relay waits for it to drain (vLLM keeps merging that request's new
tokens meanwhile, as it does for any slow reader), so a node never holds more than
`HIGH_WATER` unsent bytes per router.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve_core.engine.frames import CANCEL, END, FrameError, carried, decode_orders, encode
from pdserve_core.kv.wire import (
    MAX_AUTH_BYTES,
    NONCE_BYTES,
    ProtocolError,
    encode_message,
    new_nonce,
    proof,
    read_message,
    verify,
)
from pdserve_core.tls import client_context, server_context
from pdserve_proto.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

__all__ = ["END", "DeltaServer", "Channel", "ending"]

PROTOCOL_VERSION = 2
"""The token plane's own version (its frames' shape), told in the node's Challenge. 2: the router
opens its legs on the connection (1: over Ray, the connection carried only the node's frames)."""
ROUTER_ROLE, NODE_ROLE = b"token-router", b"token-node"
KEY_BYTES = 32
"""A channel's key: 16 random bytes, hex."""
ACK = b"\x01"
HELLO_S = 5.0
"""From connecting to the channel's key (TLS, both proofs, the key), at most."""
MAX_CONNECTIONS = 64
"""Connections to one node at once (every router has one; the rest are not yet proven)."""
MAX_UNPROVEN_PER_PEER = 8
"""Connections from one address still in the handshake."""
REFUSAL_LOG_EVERY_S = 10.0
HIGH_WATER = 4 << 20
"""Unsent bytes on one channel beyond which the requests' relays wait for the router."""
KEPT_HANDLES = 4096
"""KV handles a node remembers per router (the prefills whose decode legs may still come)."""
MAX_FRAME = 256 << 20
"""Largest frame either end accepts (a frame is one loop turn's deltas, or legs: far below this)."""
MAX_STREAMS = 16384
"""Streams one router may have open on a node at once; an OPEN past it fails its own stream."""


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


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    return secret.encode() if isinstance(secret, str) else secret


def ending(error: BaseException, where: str) -> BaseException:
    """What the router is told a stream ended with: the exception itself where its class is one
    the frames carry (`frames.ERRORS`: vLLM's own ValueError still reads as one to vLLM's
    server), else a RuntimeError naming it."""
    if carried(error) is not None:
        return error
    return RuntimeError(f"{where} failed: {error!r}")


class Channel:
    """One router's connection: deltas queued, sent one frame per loop turn."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: list[tuple[int, Any]] = []
        self.closed = False
        self.frames_sent = 0
        self.items_sent = 0
        self.kept: OrderedDict[str, dict[str, Any]] = OrderedDict()
        """KV handles of prefills this node ran for the router and keeps for its decode legs,
        the latest `KEPT_HANDLES` (given back if the router leaves: `DeltaServer.on_close`)."""
        self.running: dict[int, asyncio.Task] = {}
        """The router's streams running here, by tag."""

    def start(self, tag: int, run: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(run)
        self.running[tag] = task

        def ended(_: asyncio.Task) -> None:
            if self.running.get(tag) is task:
                del self.running[tag]

        task.add_done_callback(ended)

    def stop(self, tag: int) -> None:
        """The router left this stream: its leg is cancelled (an unknown tag ended already)."""
        task = self.running.get(tag)
        if task is not None:
            task.cancel()

    def keep(self, handle: dict[str, Any]) -> None:
        """This router's prefill left its KV here under `handle`."""
        self.kept[str(handle.get("remote_request_id"))] = handle
        while len(self.kept) > KEPT_HANDLES:
            self.kept.popitem(last=False)

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
        self.writer.write(encode(batch))
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
    """The engine actor's listener: one `Channel` per router that proved the cluster secret,
    found by its key. Without a secret it registers no channel at all."""

    def __init__(
        self,
        name: str,
        secret: str | bytes | None = None,
        on_close: Callable[[Channel], None] | None = None,
        run: Callable[[Channel, int, Any], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self.name = name
        self.on_close = on_close
        """Called with each channel whose connection closed (its router left or was cut off)."""
        self.run = run
        """`run(channel, tag, payload)`: runs an OPEN's leg (`frames.leg_from(payload, ...)`) and
        sends its deltas, then its end, on the channel under `tag` (None: every OPEN fails)."""
        self.channels: dict[bytes, Channel] = {}
        self._secret = secret_bytes(secret)
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()
        self._connections = 0
        self._unproven: dict[str, int] = {}
        """Peer address -> its connections still in the handshake."""
        self._refused: dict[str, int] = {}
        self._refusal_logged = 0.0

    async def endpoint(
        self, host: str, advertised: str, tls: ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        """(host, port) a router connects to: the listener on `host` (started on the first ask,
        on mutual TLS with `tls`), told as `advertised`."""
        async with self._starting:
            if self._server is None:
                # TLS by asyncio, before `_accept` (a start_tls there could lose a ClientHello
                # the plain reader had already buffered), its handshake bounded by HELLO_S too
                timeout = {"ssl_handshake_timeout": HELLO_S} if tls is not None else {}
                self._server = await asyncio.start_server(self._accept, host, 0, ssl=tls, **timeout)
                port = self._server.sockets[0].getsockname()[1]
                logger.info("%s streams tokens on %s:%d (as %s)", self.name, host, port, advertised)
        return advertised, self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        if not self._admit(address):
            writer.transport.abort()
            self._refuse(address, "connections")
            return
        key, channel = b"", None
        try:
            tune(writer.get_extra_info("socket"))
            try:
                async with asyncio.timeout(HELLO_S):
                    key = await self._hello(reader, writer)
            finally:
                self._proven(address)
            channel = self._register(key, writer)
            writer.write(ACK)
            logger.info("%s: router %s opened a token stream", self.name, peer)
            await self._orders(reader, channel)
        except (
            ProtocolError,
            FrameError,
            TimeoutError,
            asyncio.IncompleteReadError,
            OSError,
        ) as error:
            # OSError: resets and ssl.SSLError alike
            if channel is None:
                self._refuse(address, f"a failed handshake ({type(error).__name__}: {error})")
            else:
                logger.warning("%s: token stream from %s broken: %r", self.name, peer, error)
        finally:
            self._connections -= 1
            if channel is None:
                writer.transport.abort()
            else:
                channel.closed = True
                for task in channel.running.values():  # nobody reads these any more
                    task.cancel()
                if self.channels.get(key) is channel:
                    del self.channels[key]
                writer.close()
                if self.on_close is not None:
                    self.on_close(channel)
                logger.info(
                    "%s: token stream to %s closed (%d deltas in %d frames)",
                    self.name,
                    peer,
                    channel.items_sent,
                    channel.frames_sent,
                )

    async def _orders(self, reader: asyncio.StreamReader, channel: Channel) -> None:
        """The router's OPEN and CANCEL frames, until it closes the connection."""
        while (frame := await read_frame(reader)) is not None:
            for tag, kind, payload in decode_orders(frame):
                if kind == CANCEL:
                    channel.stop(tag)
                elif tag in channel.running:
                    raise ProtocolError(f"an OPEN for stream {tag}, which is open")
                elif self.run is None or len(channel.running) >= MAX_STREAMS:
                    why = "takes no legs" if self.run is None else f"has {MAX_STREAMS} open"
                    channel.send(tag, RuntimeError(f"{self.name}'s token stream {why}"))
                else:
                    channel.start(tag, self.run(channel, tag, payload))

    def _admit(self, address: str) -> bool:
        if self._connections >= MAX_CONNECTIONS:
            return False
        if self._unproven.get(address, 0) >= MAX_UNPROVEN_PER_PEER:
            return False
        self._connections += 1
        self._unproven[address] = self._unproven.get(address, 0) + 1
        return True

    def _proven(self, address: str) -> None:
        left = self._unproven.pop(address) - 1
        if left:
            self._unproven[address] = left

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        """The handshake, node side (after TLS, where configured): both proofs, the key."""
        if self._secret is None:
            raise ProtocolError("this node was given no cluster secret: it takes no router")
        nonce = new_nonce()
        writer.write(encode_message(pb.Challenge(protocol_version=PROTOCOL_VERSION, nonce=nonce)))
        answer = await read_message(reader, pb.AuthResponse, MAX_AUTH_BYTES)
        if len(answer.nonce) != NONCE_BYTES or not verify(
            proof(self._secret, ROUTER_ROLE, nonce, answer.nonce), answer.mac
        ):
            writer.write(encode_message(pb.AuthResult(ok=False, message="authentication failed")))
            raise ProtocolError("peer failed authentication (wrong cluster secret)")
        mac = proof(self._secret, NODE_ROLE, answer.nonce, nonce)
        writer.write(encode_message(pb.AuthResult(ok=True, mac=mac)))
        return await reader.readexactly(KEY_BYTES)

    def _register(self, key: bytes, writer: asyncio.StreamWriter) -> Channel:
        held = self.channels.get(key)
        if held is not None and not held.closed:
            raise ProtocolError("a channel key that is open already")
        channel = self.channels[key] = Channel(writer)
        return channel

    def _refuse(self, address: str, why: str) -> None:
        """One log line per `REFUSAL_LOG_EVERY_S` however fast a flood comes."""
        self._refused[address] = self._refused.get(address, 0) + 1
        now = time.monotonic()
        if now - self._refusal_logged < REFUSAL_LOG_EVERY_S:
            return
        refused, self._refused, self._refusal_logged = self._refused, {}, now
        logger.warning("%s: token stream refused: %s; by peer: %s", self.name, why, refused)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for channel in self.channels.values():
            channel.closed = True
            for task in channel.running.values():
                task.cancel()
            channel.writer.close()


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's bytes, either way (`MAX_FRAME` at most: a larger one is a
    `ProtocolError`); None when the peer closed the connection between frames."""
    head = await reader.read(4)
    if not head:
        return None
    if len(head) < 4:
        head += await reader.readexactly(4 - len(head))
    size = int.from_bytes(head, "big")
    if size > MAX_FRAME:
        raise ProtocolError(f"a {size}-byte frame")
    return await reader.readexactly(size)


async def router_hello(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, key: bytes
) -> None:
    """The handshake, router side (the caller bounds the time): the node's challenge answered,
    its proof checked, the channel's key sent and acknowledged."""
    challenge = await read_message(reader, pb.Challenge, MAX_AUTH_BYTES)
    if challenge.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"the node speaks token protocol {challenge.protocol_version}, "
            f"this router {PROTOCOL_VERSION}"
        )
    nonce = new_nonce()
    mac = proof(secret, ROUTER_ROLE, challenge.nonce, nonce)
    writer.write(encode_message(pb.AuthResponse(nonce=nonce, mac=mac)))
    result = await read_message(reader, pb.AuthResult, MAX_AUTH_BYTES)
    if not result.ok:
        raise ProtocolError(f"the node refused: {result.message}")
    if not verify(proof(secret, NODE_ROLE, nonce, challenge.nonce), result.mac):
        raise ProtocolError("the node did not prove the cluster secret")
    writer.write(key)
    if await reader.readexactly(len(ACK)) != ACK:
        raise ProtocolError("no acknowledgement")
