"""The token path (pdserve_core/engine/deltas.py, router/links/token_stream.py) between a real Ray
actor and the router's client, over a real loopback socket: legs opened on the token stream, the
engine actor's relay with its streaming methods replaced by scripted ones (no vLLM), a node's
death told by Ray to a stream whose connection broke; and Ray's own streaming calls
(`router.token_stream: ray`) when the caller leaves early.

One Ray for the whole file, in a subprocess: each check prints one line, the test asserts them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.sockets

SCRIPT = r"""
import asyncio, json, os, socket, time, typing
import ray
from pdserve_core.engine.deltas import client_tls
from pdserve_core.engine.frames import END
from pdserve_core.engine.actor import EngineActor
from pdserve_core.engine.legs import Decode, Prefill, Whole
from pdserve_core.engine.types import RequestRejected, TokenDelta
from router.errors import NodeFailed
from router.links.ray_nodes import RayNodeClient


SECRET = "the-cluster-secret"


class Unpicklable(Exception):
    pass


class Scripted(EngineActor):
    # the streaming methods of a node, scripted
    def __init__(self, *args):
        super().__init__(*args)
        self.cancelled = 0

    def params_type(self):
        return typing.Any  # the scripts' own parameters: plain data

    def handler(self, leg):
        scripted = {Whole: self.scripted, Prefill: self.failing}.get(type(leg))
        return scripted or super().handler(leg)

    async def scripted(self, leg):
        request_id, (count, pause, fail_after) = leg.request_id, leg.params
        try:
            for i in range(count):
                if fail_after is not None and i == fail_after:
                    raise RequestRejected(f"{request_id}: refused after {i}")
                yield TokenDelta([i], str(i), finish_reason="length" if i == count - 1 else None)
                await asyncio.sleep(pause)
        except (asyncio.CancelledError, GeneratorExit):  # cancelled, or closed by the relay
            self.cancelled += 1
            raise

    async def failing(self, leg):
        what = leg.params
        yield TokenDelta([0], "0")
        if what == "value":
            raise ValueError("a value the engine refused")
        raise Unpicklable(lambda: None)  # its argument cannot cross

    async def counts(self):
        channels = list(self._deltas.channels.values())
        return (
            self.cancelled,
            sum(c.frames_sent for c in channels),
            sum(c.items_sent for c in channels),
            len(channels),
        )


def script_leg(request_id, count, pause=0.0, fail_after=None):
    return Whole(request_id, [], (count, pause, fail_after))


async def collect(stream):
    return [token async for d in stream for token in d.token_ids]


async def main():
    scripted = ray.remote(Scripted).options(max_concurrency=100)
    actor = scripted.remote("node-a", {}, None, "127.0.0.1", None, SECRET)
    client = RayNodeClient(actor, "node-a", secret=SECRET)

    # 1. in order, to its end
    got = await collect(client.stream(script_leg("r1", 5)))
    print("ORDER", got == [0, 1, 2, 3, 4])

    # 2. many streams at once share frames: one loop turn's deltas leave together
    _, frames0, items0, _ = await actor.counts.remote()
    streams = [client.stream(script_leg(f"m{i}", 20, 0.01)) for i in range(16)]
    results = await asyncio.gather(*map(collect, streams))
    _, frames1, items1, channels = await actor.counts.remote()
    items, frames = items1 - items0, frames1 - frames0
    whole = all(r == list(range(20)) for r in results)
    print("MANY", whole, items == 16 * 21, frames < items / 3, channels == 1, items, frames)

    # 2b. a reader that fell behind takes the deltas queued meanwhile as one, in order, the
    # last one's finish with them (gathering takes only what already waits, never waits for more)
    stream = client.stream(script_leg("g", 20))
    first = await anext(stream)
    inbox = next(iter(client._tokens._queues.values()))
    deadline = time.monotonic() + 30
    while not (inbox.items and inbox.items[-1] is END) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # until the rest and the stream's end wait in its queue
    rest = [d async for d in stream]
    tokens = first.token_ids + rest[0].token_ids
    print(
        "GATHERED",
        len(rest) == 1,
        tokens == list(range(20)) and first.text + rest[0].text == "".join(map(str, range(20))),
        rest[0].finish_reason == "length",
    )

    # 3. the node's refusal arrives after the deltas before it, as itself
    seen = []
    try:
        async for d in client.stream(script_leg("r3", 5, 0.0, 2)):
            seen += d.token_ids
        print("REFUSED", False)
    except RequestRejected as error:
        print("REFUSED", seen == [0, 1] and "refused after 2" in str(error))

    # 4. anything else the node raises arrives as the class the router tells apart (vLLM's
    # server reads a ValueError as the client's mistake), else as a RuntimeError naming it
    try:
        await collect(client.stream(Prefill("r4", [], "value")))
        print("OTHER", False)
    except ValueError as error:
        try:
            await collect(client.stream(Prefill("r4b", [], "crash")))
            print("OTHER", False)
        except RuntimeError as crash:
            print("OTHER", "Unpicklable" in str(crash) and "node-a" in str(crash))

    # 5. a leg this node's role does not run is refused by the node
    try:
        await collect(client.stream(Decode("r5", [], None, [1], {})))
        print("METHOD", False)
    except Exception as error:
        print("METHOD", "runs no Decode legs" in str(error))

    # 6. the caller leaving cancels the request on the node
    stream = client.stream(script_leg("r6", 1000, 0.05))
    await anext(stream)
    await stream.aclose()
    deadline = time.monotonic() + 30
    while (await actor.counts.remote())[0] == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    print("CANCELLED", (await actor.counts.remote())[0] == 1)

    # 6b. the router's connection breaks (the router died): the node stops the request
    gone = RayNodeClient(actor, "node-a", secret=SECRET)
    orphan = gone.stream(script_leg("r6b", 1000, 0.05))
    await anext(orphan)
    gone._tokens._writer.transport.abort()
    deadline = time.monotonic() + 30
    while (await actor.counts.remote())[0] < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    print("ROUTER_GONE", (await actor.counts.remote())[0] == 2)
    try:
        await anext(orphan)
        print("ORPHAN", False)
    except NodeFailed:
        print("ORPHAN", True)

    # 7. hostile peers: one that never proves the secret, one with a wrong secret: no channel
    host, port = await actor.delta_endpoint.remote()
    silent = socket.create_connection((host, port))
    wrong = socket.create_connection((host, port))
    wrong.sendall(b"x" * 32)
    try:
        await RayNodeClient(actor, "node-a", secret="a guess")._token_stream()
        print("HOSTILE", False, "a wrong secret got a channel")
    except NodeFailed:
        pass
    try:
        await collect(client.stream(script_leg("r7", 3)))  # others' streams are unaffected
        print("HOSTILE", (await actor.counts.remote())[3] == 1)
    except Exception as error:
        print("HOSTILE", False, repr(error))
    silent.close(); wrong.close()

    # 7b. mutual TLS (the KV plane's files): a router with the cluster's certificate streams; one
    # without TLS, or with a certificate another CA signed, is refused
    files, stranger_files = json.loads(os.environ["CERTS"])
    secure = scripted.remote("node-b", {}, None, "127.0.0.1", files, SECRET)
    trusted = RayNodeClient(secure, "node-b", tls=client_tls(files), secret=SECRET)
    ok = await collect(trusted.stream(script_leg("t", 3)))
    refused = []
    for tls in (None, client_tls(stranger_files)):
        try:
            stranger = RayNodeClient(secure, "node-b", tls=tls, secret=SECRET)
            await collect(stranger.stream(script_leg("t2", 3)))
            refused.append(False)
        except NodeFailed as error:
            refused.append("token stream" in str(error))
    print("TLS", ok == [0, 1, 2], *refused)


    # 8. the node dies mid-stream: the stream ends with NodeFailed, at once
    stream = client.stream(script_leg("r8", 1000, 0.05))
    await anext(stream)
    ray.kill(actor)
    started = time.monotonic()
    try:
        async for _ in stream:
            pass
        print("DIED", False)
    except NodeFailed as error:  # told as a death (it counts toward a request's poison limit)
        print("DIED", time.monotonic() - started < 10, error.died)

    # 9. over Ray's own streaming calls (router.token_stream: ray), a caller leaving after one of
    # n sequences ended stops the rest on the node
    await early_close()


class EarlyClose:
    def __init__(self):
        self.ended = None

    async def stream(self, leg):
        try:
            yield TokenDelta([1], "a", finish_reason="length", index=0)  # sequence 0 is done
            await asyncio.sleep(3600)  # sequence 1 still decoding
            yield TokenDelta([2], "b", finish_reason="length", index=1)
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise

    async def ended_how(self):
        return self.ended


async def early_close():
    node = ray.remote(EarlyClose).options(num_cpus=0).remote()
    client = RayNodeClient(node, direct=False)
    stream = client.stream(Whole("e1", [1], None))
    first = await anext(stream)
    await stream.aclose()  # the caller leaves while sequence 1 runs
    deadline = time.monotonic() + 30
    while await node.ended_how.remote() != "cancelled" and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    ended = await node.ended_how.remote()
    print("EARLY_CLOSE", first.finish_reason == "length" and first.index == 0, ended == "cancelled")


ray.init(num_cpus=2, include_dashboard=False)
asyncio.run(main())
ray.shutdown()
"""

CHECKS = (
    "ORDER",
    "MANY",
    "GATHERED",
    "REFUSED",
    "OTHER",
    "METHOD",
    "CANCELLED",
    "ROUTER_GONE",
    "ORPHAN",
    "HOSTILE",
    "TLS",
    "DIED",
    "EARLY_CLOSE",
)


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, str]:
    from tests.helpers.certs import issue

    folder = tmp_path_factory.mktemp("certs")
    certs = [vars(issue(folder / name)) for name in ("cluster", "stranger")]
    with tempfile.TemporaryDirectory(prefix="pdr-", dir="/tmp") as short:  # socket paths: short
        env = dict(os.environ, RAY_TMPDIR=short, RAY_AUTH_MODE="disabled", CERTS=json.dumps(certs))
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],
        )
    lines = {}
    for line in done.stdout.splitlines():
        word, _, rest = line.partition(" ")
        lines[word] = rest
    assert done.returncode == 0, done.stderr[-3000:]
    return lines


@pytest.mark.parametrize("check", CHECKS)
def test_token_stream(printed, check):
    assert check in printed, f"{check} never ran: {printed}"
    assert "False" not in printed[check] and printed[check].strip(), printed[check]
