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
from pdserve_core.engine.legs import Whole
from pdserve_core.engine.types import KVLoadFailed, RequestRejected, TokenDelta
from pdserve_core.kv.wire import ProtocolError, encode_message
from pdserve_proto.v1 import kv_transfer_pb2 as pb
from router.errors import NodeFailed, SlowReader
from router.links import token_stream
from router.links.token_stream import TokenStream

SECRET = "the-cluster-secret"


class Node:
    """A node's listener with scripted legs: `leg(script)` is a leg whose stream sends `script`
    (deltas, then END or an exception) and then waits to be cancelled."""

    def __init__(self, secret: str | None = SECRET) -> None:
        self.server = DeltaServer("node-t", secret, run=self.run)
        self.scripts: list[list] = []
        self.cancelled = 0
        self.running = 0

    async def start(self) -> tuple[str, int]:
        return await self.server.endpoint("127.0.0.1", "127.0.0.1")

    def leg(self, script: list) -> Whole:
        self.scripts.append(script)
        return Whole(f"r{len(self.scripts)}", [1, 2], len(self.scripts) - 1)

    async def run(self, channel, tag: int, payload) -> None:
        try:
            leg = frames.leg_from(payload, int)
        except frames.FrameError as error:
            channel.send(tag, RuntimeError(f"could not read the leg: {error}"))
            return
        self.running += 1
        try:
            for item in self.scripts[leg.params]:
                channel.send(tag, item)
                await asyncio.sleep(0)
            await asyncio.Event().wait()  # the leg ends only when cancelled
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1


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
    got = await collect(tokens.stream(node.leg([delta, END])))
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
            await collect(tokens.stream(node.leg([deltas.ending(error, "a leg")])))
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
    got = await collect(tokens.stream(node.leg([TokenDelta([1], "secret answer"), END])))
    assert [d.text for d in got] == ["secret answer"]  # still the first router's
    tokens.close()


async def _channel_closes(node, frame: bytes) -> bool:
    """Prove the secret, send `frame` after the key: whether the node closed the connection and
    let the channel go."""
    reader, writer = await _raw(node.address)
    await router_hello(reader, writer, SECRET.encode(), deltas.new_key())
    assert len(node.server.channels) == 1
    writer.write(frame)
    with contextlib.suppress(ConnectionError):
        await asyncio.wait_for(reader.read(), 10)  # the node closed it
    for _ in range(100):
        if not node.server.channels:
            break
        await asyncio.sleep(0.01)
    writer.close()
    return node.server.channels == {}


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


@pytest.mark.asyncio(loop_scope="module")
async def test_frames_after_the_key_that_are_not_orders_end_the_connection(node, tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    hostile = [
        (deltas.MAX_FRAME + 1).to_bytes(4, "big") + b"x" * 64,  # larger than any frame
        _frame(b"\xc1"),  # not msgpack
        _frame(pickle.dumps([(0, frames.OPEN, Payload())])),
        _frame(frames.msgpack.packb({"a": 1})),
        _frame(frames.msgpack.packb([[0, 7, None]])),  # neither OPEN nor CANCEL
        _frame(frames.msgpack.packb([["0", frames.OPEN, None]])),  # a tag that is no number
    ]
    for frame in hostile:
        assert await _channel_closes(node, frame), frame[:40]
    twice = frames.leg_payload(Whole("r", [1], 0))
    node.scripts.append([])
    opened = _frame(frames.msgpack.packb([[5, frames.OPEN, twice]], use_bin_type=True))
    assert await _channel_closes(node, opened + opened)  # a tag that is open already
    assert not marker.exists()
    for _ in range(100):  # the leg the closed connection opened was cancelled with it
        if not node.running:
            break
        await asyncio.sleep(0.01)
    assert node.running == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_a_leg_that_does_not_decode_fails_only_its_own_stream(node, monkeypatch):
    tokens = await TokenStream.connect("node-t", *node.address, SECRET)
    fine = tokens.stream(node.leg([TokenDelta([1], "a")]))
    assert (await anext(fine)).token_ids == [1]
    good = frames.leg_payload(Whole("r", [1], 0))
    for payload in (
        ["generate", "r", [1, "x"], good[3]],  # a token that is no number
        ["generate", 7, [1], good[3]],  # a request id that is no string
        ["generate", "r", [1]],  # a field short
        ["decode", "r", [1], good[3], [2], "no handle"],
        ["steal", "r", [1], good[3]],  # no such leg
        ["generate", "r", [1], "not bytes"],
        ["generate", "r", [1], b"\xc1"],  # params that do not decode
        "generate",
    ):
        monkeypatch.setattr(token_stream, "leg_payload", lambda leg, p=payload: p)
        with pytest.raises(RuntimeError, match="could not read the leg"):
            await collect(tokens.stream(Whole("r", [1], 0)))
    monkeypatch.undo()
    assert not tokens.broken and len(node.server.channels) == 1
    await fine.aclose()  # the stream that was fine all along, left: cancelled on the node
    for _ in range(100):
        if not node.running:
            break
        await asyncio.sleep(0.01)
    assert node.running == 0
    tokens.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_streams_past_the_cap_fail_alone(node, monkeypatch):
    monkeypatch.setattr(deltas, "MAX_STREAMS", 2)
    tokens = await TokenStream.connect("node-t", *node.address, SECRET)
    held = [tokens.stream(node.leg([TokenDelta([i], "x")])) for i in range(2)]
    assert [(await anext(s)).token_ids for s in held] == [[0], [1]]
    with pytest.raises(RuntimeError, match="has 2 open"):
        await collect(tokens.stream(node.leg([TokenDelta([9], "y"), END])))
    for stream in held:
        await stream.aclose()
    for _ in range(100):
        if not node.running:
            break
        await asyncio.sleep(0.01)
    got = await collect(tokens.stream(node.leg([TokenDelta([3], "z"), END])))
    assert [d.token_ids for d in got] == [[3]]  # room again once they ended
    tokens.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_broken_connection_asks_the_probe_once_and_ends_every_stream():
    node = Node()
    address = await node.start()
    asked = []

    async def probe() -> bool:
        asked.append(1)
        await asyncio.sleep(0.05)
        return True

    tokens = await TokenStream.connect("node-t", *address, SECRET, probe=probe)
    streams = [tokens.stream(node.leg([TokenDelta([i], "x")])) for i in range(3)]
    for stream in streams:
        await anext(stream)
    node.server.close()  # the node's end goes away: every stream on it ends
    for stream in streams:
        with pytest.raises(NodeFailed) as failed:
            await anext(stream)
        assert failed.value.died
    assert asked == [1]
    with pytest.raises(NodeFailed):  # nothing more opens on a broken connection
        await anext(tokens.stream(node.leg([])))


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
    got = await asyncio.wait_for(collect(tokens.stream(node.leg(script))), 10)
    # the router's own stream is served meanwhile
    assert [token for delta in got for token in delta.token_ids] == list(range(20))
    for _ in range(300):  # past the hello deadline nothing of the flood is held
        if node.server._connections == 1:
            break
        await asyncio.sleep(0.02)
    assert node.server._connections == 1 and node.server._unproven == {}
    for sock in flood:
        sock.close()
    tokens.close()


def _fake_node(then):
    """A node that proves the secret, acknowledges the key, then does `then(reader, writer)`."""

    async def fake_node(reader, writer):
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
        await then(reader, writer)

    return fake_node


@pytest.mark.asyncio(loop_scope="module")
async def test_a_node_that_reads_no_legs_is_given_up(monkeypatch):
    monkeypatch.setattr(token_stream, "MAX_UNSENT", 1 << 20)
    stop = asyncio.Event()

    async def then(reader, writer):  # reads nothing more, answers nothing
        await stop.wait()

    server = await asyncio.start_server(_fake_node(then), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tokens = await TokenStream.connect("deaf", "127.0.0.1", port, SECRET)
    prompt = list(range(1 << 16, (1 << 16) + (1 << 19)))  # 2.5 MB of tokens a leg
    streams = [tokens.stream(Whole(f"r{i}", prompt, None)) for i in range(8)]
    with pytest.raises(NodeFailed, match="bytes of legs unread"):
        await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 30)
    assert tokens.broken
    stop.set()
    server.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_frame_that_would_unpickle_breaks_the_connection_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    async def then(reader, writer):  # a pickle
        data = pickle.dumps([(0, Payload())])
        writer.write(len(data).to_bytes(4, "big") + data)
        await reader.read()

    server = await asyncio.start_server(_fake_node(then), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tokens = await TokenStream.connect("fake", "127.0.0.1", port, SECRET)

    with pytest.raises(NodeFailed, match="frame that is not msgpack|not a list"):
        await collect(tokens.stream(Whole("r", [1], None)))
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
    stream = tokens.stream(node.leg(script))
    first = await anext(stream)  # then the client stops reading
    assert first.token_ids[0] == 0
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


def test_legs_cross_as_data_and_come_back_equal():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from pdserve_core.engine.legs import Decode, Prefill, leg_params

    request = SamplingParams(
        max_tokens=7,
        n=2,
        stop=["\n\n"],
        seed=3,
        logprobs=2,
        logit_bias={5: 1.5},
        allowed_token_ids=[1, 2, 3],
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
        extra_args={"cache_salt": "tenant-a"},
    )
    params = leg_params(request, kv_transfer_params={"do_remote_decode": True})
    handle = {"remote_request_id": "p-1", "remote_port": 5, "lease_token": "ff"}
    for leg in (
        Whole("w", [1, 2, 3], params),
        Prefill("p", [1, 2, 3], params, sample_first=False, readers=2, prefetch="k"),
        Decode("d", [1, 2, 3], params, [9], handle),
    ):
        wire = frames.msgpack.unpackb(
            frames.msgpack.packb(frames.leg_payload(leg), use_bin_type=True), raw=False
        )
        back = frames.leg_from(wire, SamplingParams)
        assert back == leg and back.params.extra_args["cache_salt"] == "tenant-a"
    good = frames.leg_payload(Whole("w", [1], params))
    for hostile in (
        frames.msgspec.msgpack.encode({"max_tokens": "seven"}),  # a field of the wrong type
        frames.msgspec.msgpack.encode({"n": 0}),  # vLLM's own check refuses it
        pickle.dumps(params),
    ):
        with pytest.raises(frames.FrameError):
            frames.leg_from([*good[:3], hostile], SamplingParams)
