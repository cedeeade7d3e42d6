"""The token plane as a hostile peer and a stalled client would use it: the node's listener
(pdserve_core/engine/deltas.py) and the router's end (router/links/token_stream.py) in one process,
over real loopback sockets (no Ray, no vLLM; tests/sockets/test_token_stream.py runs them in a Ray
actor).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import socket

import pytest
import pytest_asyncio

from pdserve_core.engine import deltas, frames
from pdserve_core.engine.deltas import DeltaServer, router_hello
from pdserve_core.engine.frames import END
from pdserve_core.engine.types import KVLoadFailed, RequestRejected, TokenDelta
from pdserve_core.kv.wire import ProtocolError, encode_message
from pdserve_proto.v1 import kv_transfer_pb2 as pb
from router.errors import NodeFailed, SlowReader
from router.links import token_stream
from router.links.token_stream import TokenStream

SECRET = "the-cluster-secret"


class Node:
    """A node's listener with scripted requests: `run(key, tag)` sends `script[tag]` (deltas,
    then END or an exception) on the router's channel."""

    def __init__(self, secret: str | None = SECRET) -> None:
        self.server = DeltaServer("node-t", secret)
        self.scripts: list[list] = []
        self.cancelled = 0

    async def start(self) -> tuple[str, int]:
        return await self.server.endpoint("127.0.0.1", "127.0.0.1")

    def call(self, script: list):
        def start(key: bytes, tag: int):
            async def relay():
                channel = self.server.channel(key)
                try:
                    for item in script:
                        channel.send(tag, item)
                        await asyncio.sleep(0)
                    await asyncio.Event().wait()  # the relay returns only when cancelled
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise

            return asyncio.ensure_future(relay())

        return start


def cancel(ref) -> None:
    ref.cancel()


async def collect(stream) -> list:
    return [delta async for delta in stream]


@pytest_asyncio.fixture(loop_scope="module")
async def node():
    node = Node()
    node.address = await node.start()
    yield node
    node.server.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_router_with_the_secret_streams_deltas_and_their_ends_as_data(node):
    tokens = await TokenStream.connect("node-t", *node.address, SECRET)
    delta = TokenDelta(
        [5, 6],
        "ab",
        "length",
        None,
        3,
        {"remote_host": "127.0.0.1", "lease_token": "ff"},
        0,
        [[(5, -0.5, 1, "a")], [(6, -0.25, 1, "b")]],
        None,
        7,
    )
    got = await collect(tokens.stream(node.call([delta, END]), cancel))
    assert len(got) == 1 and got[0].token_ids == [5, 6] and got[0].handle == delta.handle
    assert [list(map(list, p)) for p in delta.logprobs] == got[0].logprobs
    assert got[0].num_cached_tokens == 7
    ended_by = [
        (RequestRejected("too long"), RequestRejected, "too long"),
        (KVLoadFailed("timeout", "no pull"), KVLoadFailed, "KV transfer failed (timeout)"),
        (type("VLLMValidationError", (ValueError,), {})("bad"), ValueError, "bad"),
        (OSError("disk"), RuntimeError, "OSError('disk')"),
    ]
    for error, cls, words in ended_by:
        with pytest.raises(cls) as raised:
            await collect(tokens.stream(node.call([deltas.ending(error, "a leg")]), cancel))
        assert words in str(raised.value)
    tokens.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_router_without_the_secret_gets_no_channel(node):
    with pytest.raises(NodeFailed, match="authentication failed"):
        await TokenStream.connect("node-t", *node.address, "a guess")
    secretless = Node(secret=None)  # a node that was told no secret takes nobody
    address = await secretless.start()
    with pytest.raises(NodeFailed):
        await TokenStream.connect("node-t", *address, SECRET)
    assert node.server.channels == {} and secretless.server.channels == {}
    secretless.server.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_node_without_the_secret_is_not_believed(node):
    impostor = Node(secret="another")
    address = await impostor.start()
    with pytest.raises(NodeFailed):
        await TokenStream.connect("node-t", *address, SECRET)
    impostor.server.close()


async def _raw(address):
    return await asyncio.open_connection(*address)


@pytest.mark.asyncio(loop_scope="module")
async def test_bytes_that_are_no_proof_get_no_channel_and_no_ack(node):
    reader, writer = await _raw(node.address)
    writer.write(b"x" * 32)  # what a channel key looked like before the handshake
    challenge = pb.Challenge()
    challenge.ParseFromString((await reader.readexactly(4 + 36))[4:])
    assert challenge.nonce and challenge.protocol_version == deltas.PROTOCOL_VERSION
    rest = await asyncio.wait_for(reader.read(), deltas.HELLO_S + 5)  # closed, nothing acked
    assert deltas.ACK not in rest[:1] and node.server.channels == {}
    writer.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_an_open_channel_cannot_be_taken_over(node):
    tokens = await TokenStream.connect("node-t", *node.address, SECRET)
    reader, writer = await _raw(node.address)
    with pytest.raises((ProtocolError, asyncio.IncompleteReadError, ConnectionError)):
        await router_hello(reader, writer, SECRET.encode(), tokens.key)  # even with the secret
    writer.close()
    got = await collect(tokens.stream(node.call([TokenDelta([1], "secret answer"), END]), cancel))
    assert [d.text for d in got] == ["secret answer"]  # still the first router's
    tokens.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_bytes_after_the_key_end_the_connection(node):
    reader, writer = await _raw(node.address)
    await router_hello(reader, writer, SECRET.encode(), deltas.new_key())
    assert len(node.server.channels) == 1
    writer.write(os.urandom(1 << 20))
    with contextlib.suppress(ConnectionError):
        await asyncio.wait_for(reader.read(), 10)  # the node closed it (a reset, as it read none)
    for _ in range(100):
        if not node.server.channels:
            break
        await asyncio.sleep(0.01)
    assert node.server.channels == {}
    writer.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_silent_and_flooding_peers_are_bounded_and_let_go(node, monkeypatch):
    monkeypatch.setattr(deltas, "HELLO_S", 1.0)
    tokens = await TokenStream.connect("node-t", *node.address, SECRET)
    flood = []
    for i in range(150):  # from many loopback addresses: the total cap, then per address
        sock = socket.socket()
        sock.bind((f"127.0.0.{2 + i % 50}", 0))
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, node.address)
        except OSError:
            pass
        flood.append(sock)
    await asyncio.sleep(0.2)
    held = node.server._connections
    assert held <= deltas.MAX_CONNECTIONS
    assert all(n <= deltas.MAX_UNPROVEN_PER_PEER for n in node.server._unproven.values())
    script = [TokenDelta([i], str(i)) for i in range(20)] + [END]
    got = await asyncio.wait_for(collect(tokens.stream(node.call(script), cancel)), 10)
    assert len(got) == 20  # the router's own stream is served meanwhile
    for _ in range(300):  # past the hello deadline nothing of the flood is held
        if node.server._connections == 1:
            break
        await asyncio.sleep(0.02)
    assert node.server._connections == 1 and node.server._unproven == {}
    for sock in flood:
        sock.close()
    tokens.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_frame_that_would_unpickle_breaks_the_connection_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    async def fake_node(reader, writer):  # proves the secret, then sends a pickle
        nonce = os.urandom(32)
        writer.write(
            encode_message(pb.Challenge(protocol_version=deltas.PROTOCOL_VERSION, nonce=nonce))
        )
        answer = pb.AuthResponse()
        size = int.from_bytes(await reader.readexactly(4), "big")
        answer.ParseFromString(await reader.readexactly(size))
        mac = deltas.proof(SECRET.encode(), deltas.NODE_ROLE, answer.nonce, nonce)
        writer.write(encode_message(pb.AuthResult(ok=True, mac=mac)))
        await reader.readexactly(deltas.KEY_BYTES)
        writer.write(deltas.ACK)
        data = pickle.dumps([(0, Payload())])
        writer.write(len(data).to_bytes(4, "big") + data)
        await reader.read()

    server = await asyncio.start_server(fake_node, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tokens = await TokenStream.connect("fake", "127.0.0.1", port, SECRET)

    def call(key, tag):
        return asyncio.ensure_future(asyncio.Event().wait())

    with pytest.raises(NodeFailed, match="frame that is not msgpack|not a list"):
        await collect(tokens.stream(call, cancel))
    assert not marker.exists()
    server.close()


def test_frames_decode_data_only():
    assert frames.decode(frames.encode([(3, TokenDelta([1], "a")), (4, END)])[4:]) == [
        (3, TokenDelta([1], "a")),
        (4, END),
    ]
    for hostile in (
        pickle.dumps([(0, TokenDelta([1], "a"))]),
        b"\xc1",  # never used in msgpack
        frames.msgpack.packb([[0, 9, None]]),  # an unknown kind
        frames.msgpack.packb([[0, frames.DELTA, [1, 2]]]),  # a delta without its fields
        frames.msgpack.packb({"a": 1}),
    ):
        with pytest.raises(frames.FrameError):
            frames.decode(hostile)
    # a failure names a class: only those the router tells apart come back as themselves
    assert isinstance(frames.rebuild("SystemExit", ["x"]), RuntimeError)
    assert isinstance(frames.rebuild("RequestRejected", [1]), RuntimeError)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_reader_that_stalls_has_its_request_cancelled_past_the_bound(node, monkeypatch):
    monkeypatch.setattr(token_stream, "MAX_BACKLOG", 50)
    tokens = await TokenStream.connect("node-t", *node.address, SECRET)
    script = [TokenDelta([i], "x") for i in range(200)] + [END]
    stream = tokens.stream(node.call(script), cancel)
    first = await anext(stream)  # then the client stops reading
    assert first.token_ids == [0]
    for _ in range(500):
        if node.cancelled:
            break
        await asyncio.sleep(0.01)
    assert node.cancelled == 1  # cancelled on the node while nobody read
    (inbox,) = tokens._queues.values()
    assert len(inbox.items) <= 1  # its deltas let go
    with pytest.raises(SlowReader):
        async for _ in stream:
            pass
    tokens.close()
