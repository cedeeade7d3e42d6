"""Pool membership with fake nodes: a dead actor leaves at once, a busy one after three missed
checks, and a node whose engine died is rebuilt and rejoins."""

from __future__ import annotations

import asyncio
import time

from pdserve_core.engine.legs import Whole
from router.links.nodes import NodeClient
from tests.helpers.fake_nodes import FakeNode, membership, pool, retry_policy


async def settle(node, timeout: float = 5.0) -> None:
    async def restarted():
        while node.restarting:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(restarted(), timeout)


async def test_a_node_whose_engine_died_is_rebuilt_and_rejoins():
    fake = FakeNode("d0")
    decode = pool("decode", fake)
    checks = membership(decode)
    node = decode.nodes[0]
    fake.engine = False  # the EngineCore died; the actor cleared it in its health check
    await checks.refresh(node)
    assert not node.healthy and not decode.healthy_nodes()  # out while it is rebuilt
    await settle(node)
    assert fake.starts == 1 and node.info.pid == 2  # a new engine process
    await checks.refresh(node)
    assert node.healthy and decode.healthy_nodes() == [node]


async def test_a_build_that_keeps_failing_waits_longer_each_time():
    """An engine that cannot be built (a model that no longer loads, a device gone) is not
    rebuilt at every health check: the waits double, and a success resets them."""
    fake = FakeNode("d0", engine=False)
    failing = [True]

    async def start():
        if failing[0]:
            fake.starts += 1
            raise RuntimeError("no model")
        return await FakeNode.start(fake)

    fake.start = start
    decode = pool("decode", fake)
    checks = membership(decode)
    node = decode.nodes[0]
    waits = []
    for attempt in range(1, 5):
        await checks.refresh(node)
        await settle(node)
        assert fake.starts == attempt and not node.healthy
        waits.append(round(node.next_start - time.monotonic()))
        await checks.refresh(node)  # the next health check: still waiting, no new build
        await settle(node)
        assert fake.starts == attempt
        node.next_start = 0.0  # the wait has passed
    assert waits == [2, 4, 8, 16]
    failing[0] = False
    await checks.refresh(node)
    await settle(node)
    await checks.refresh(node)
    assert node.healthy and node.failed_starts == 0


async def test_a_dead_actor_leaves_at_once_and_a_slow_one_after_three_misses():
    fake = FakeNode("d0")
    decode = pool("decode", fake)
    checks = membership(decode)
    node = decode.nodes[0]
    fake.healthy = False
    await checks.refresh(node)
    assert not node.healthy

    class Slow(NodeClient):
        async def check_health(self):
            raise TimeoutError

        async def stats(self):  # pragma: no cover
            raise AssertionError

        async def start(self):  # pragma: no cover
            raise AssertionError

        def stream(self, *args):  # pragma: no cover
            raise AssertionError

    slow = pool("decode", FakeNode("d1"))

    checks = membership(slow)
    slow.nodes[0].client = Slow()
    for expected in (True, True, False):
        await checks.refresh(slow.nodes[0])
        assert slow.nodes[0].healthy is expected


async def test_a_health_check_is_one_call_to_the_node_with_its_stats_and_block_log():
    """Each check asks the node once (`checkup`): over Ray three calls a second per node were
    three wake-ups of the node's actor and the router's; the block log only when routing by
    prefix."""
    from pdserve_core.engine.types import NodeStats

    class OneCall(NodeClient):
        def __init__(self):
            self.asked = []

        async def checkup(self, seen):
            self.asked.append(seen)
            blocks = None if seen is None else (seen + 1, [[11, 12]])
            return True, NodeStats(running=2, max_num_seqs=64), blocks

        async def check_health(self):  # pragma: no cover
            raise AssertionError("asked apart from the checkup")

        stats = start = check_health

        def stream(self, *args):  # pragma: no cover
            raise AssertionError

    for prefix_aware, expected in ((True, [0, 1]), (False, [None, None])):
        decode = pool("decode", FakeNode("d0"))
        node = decode.nodes[0]
        node.client = client = OneCall()
        checks = membership(decode, prefix_aware=prefix_aware)
        await checks.refresh(node)
        await checks.refresh(node)
        assert client.asked == expected
        assert node.healthy and node.stats.running == 2 and node.elsewhere == 2
        assert node.blocks_seen == (2 if prefix_aware else 0)


async def test_a_nodes_figures_are_dated_when_they_were_asked_for():
    """/health's `stats_age_s` dates a node's figures from when its check asked for them (what
    the node did after that is not in them), not from when the answer came; none before the
    first answer, and a check that failed leaves the last date."""
    from router import clock
    from router.faces.openai_http import _node_view

    fake = FakeNode("d0")
    decode = pool("decode", fake)
    checks = membership(decode)
    node = decode.nodes[0]
    assert _node_view(node)["stats_age_s"] is None
    answer = asyncio.Event()
    checkup = fake.checkup

    async def slow_checkup(seen):
        await answer.wait()
        return await checkup(seen)

    fake.checkup = slow_checkup
    before = clock.now()
    check = asyncio.create_task(checks.refresh(node))
    await asyncio.sleep(0.3)  # the node thinks this long before it answers
    answered = clock.now()
    answer.set()
    await check
    assert before <= node.stats_asked < answered  # asked before the answer came
    assert _node_view(node)["stats_age_s"] >= round(answered - node.stats_asked, 3) > 0
    asked = node.stats_asked

    async def failing(seen):
        raise RuntimeError("engine busy")

    fake.checkup = failing
    await checks.refresh(node)
    assert node.stats_asked == asked and node.missed_checks == 1


# ---- silent nodes: a cut link or a vanished host, long before Ray says so ----------------------


async def test_a_stream_whose_node_falls_silent_continues_on_another_node():
    from router.decides.retry import runs
    from tests.helpers.fake_nodes import disaggregated, prepared

    cut = FakeNode("d0", silent_after=2)
    dispatcher = disaggregated([FakeNode("p0")], [cut, FakeNode("d1")], silence_s=0.3)
    resumed, tokens = [], []
    started = time.monotonic()
    watches = [membership(watched) for watched in dispatcher.pools.values()]
    for watch in watches:  # the other nodes' health checks are heard
        watch.start(0.05)
    try:
        async for delta in runs(
            dispatcher, prepared(max_tokens=8), time.monotonic() + 30, retry_policy(3), print,
            resumed.append,
        ):  # fmt: skip
            tokens += delta.token_ids
    finally:
        for watch in watches:
            await watch.stop()
    assert tokens == list(range(100, 108))  # every token once, in order
    assert len(resumed) == 1 and "silent" in resumed[0].message
    assert time.monotonic() - started < 2.0
    assert not dispatcher.decode.nodes[0].healthy and dispatcher.decode.nodes[1].healthy


async def test_a_node_that_is_slow_but_answers_its_checks_is_not_lost():
    from router.decides.retry import runs
    from tests.helpers.fake_nodes import colocated, prepared

    slow = FakeNode("c0", delay_s=0.5)  # each token takes longer than the silence bound
    dispatcher = colocated(slow)
    dispatcher.pools["colocated"].silence_s = 0.3
    checks = membership(dispatcher.pools["colocated"])
    checks.start(0.05)
    try:
        deltas = [
            d
            async for d in runs(
                dispatcher, prepared(max_tokens=3), time.monotonic() + 30, retry_policy(1), print
            )
        ]
    finally:
        await checks.stop()
    assert [t for d in deltas for t in d.token_ids] == [100, 101, 102]
    assert dispatcher.pools["colocated"].nodes[0].healthy


async def test_a_silent_node_leaves_while_its_check_hangs_and_rejoins_when_it_answers():
    quiet, loud = FakeNode("d0"), FakeNode("d1")
    decode = pool("decode", quiet, loud, silence_s=0.3)
    checks = membership(decode)
    checks.start(0.05)
    try:
        await wait_until(lambda: all(n.reported for n in decode.nodes))
        quiet.silent = True
        await wait_until(lambda: not decode.nodes[0].healthy)
        assert decode.nodes[1].healthy  # its checks never waited on the hung one
        assert decode.healthy_nodes() == [decode.nodes[1]]
        quiet.speak()
        await wait_until(lambda: decode.nodes[0].healthy)
    finally:
        await checks.stop()


async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_stalled_router_takes_no_node_for_lost():
    """The router's own loop blocked longer than the silence bound (an overloaded router hears
    nobody): when it runs again, no node has left its pool."""
    fakes = [FakeNode("d0"), FakeNode("d1")]
    decode = pool("decode", *fakes, silence_s=0.3)
    checks = membership(decode)
    checks.start(0.05)
    try:
        await wait_until(lambda: all(n.reported for n in decode.nodes))
        for fake in fakes:  # their answers wait until the router runs again
            fake.silent = True
        time.sleep(0.8)  # the event loop stalls: nothing is read, no check answered
        await asyncio.sleep(0.2)  # a few of the watcher's rounds
        assert all(n.healthy for n in decode.nodes)  # none left while the router was away
        for fake in fakes:
            fake.speak()
        await asyncio.sleep(0.3)
        assert all(n.healthy for n in decode.nodes)
    finally:
        await checks.stop()


async def test_when_every_node_falls_silent_at_once_none_is_taken_for_lost():
    """All silent together: the router (or its host) is what stopped hearing, not the nodes."""
    fakes = [FakeNode("d0"), FakeNode("d1")]
    decode = pool("decode", *fakes, silence_s=0.3)
    checks = membership(decode)
    checks.start(0.05)
    try:
        await wait_until(lambda: all(n.reported for n in decode.nodes))
        for fake in fakes:
            fake.silent = True
        await asyncio.sleep(1.0)
        assert all(n.healthy for n in decode.nodes)
        for fake in fakes:
            fake.speak()
    finally:
        await checks.stop()


async def test_autoscaled_nodes_reuse_the_numbers_and_ports_of_the_ones_that_left(monkeypatch):
    """Grow and shrink a hundred times: names and KV port offsets stay within the cluster's
    size instead of counting up past the port range."""
    from types import SimpleNamespace

    import pdserve.nodes as nodes
    from pdserve_core.config import PDServeConfig
    from pdserve_core.engine.types import NodeInfo

    started = []

    def place_node(config, model_dir, served, secret, kind, role, replica, index):
        assert kind == "flex"
        name = f"pdserve-{role}-{replica}"
        started.append((name, index))

        async def start():
            return NodeInfo(name, 1, "ray-node", 2048, 128, 0.1)

        async def shutdown():
            return None

        class Actor:  # a handle: hashable, as Ray's are
            pass

        actor = Actor()
        actor.start = SimpleNamespace(remote=start)
        actor.shutdown = SimpleNamespace(remote=shutdown)
        return actor

    monkeypatch.setattr(nodes, "place_node", place_node)
    monkeypatch.setattr(nodes.ray, "kill", lambda actor: None)
    shut = []

    async def client_shutdown(client):
        shut.append(client)

    monkeypatch.setattr("router.links.ray_nodes.RayNodeClient.shutdown", client_shutdown)
    actors = []
    factory = nodes.RayNodeFactory(PDServeConfig(), "/model", "m", "s", actors)
    for _ in range(100):
        first = await factory.add("prefill")
        second = await factory.add("decode")
        await factory.remove(first)
        await factory.remove(second)
    assert {name for name, _ in started} == {"pdserve-prefill-1", "pdserve-decode-1"}
    assert {index for _, index in started} == {2, 3} and actors == []
    assert len(shut) == 200  # each node's engine shut down through its client
    kept = await factory.add("decode")
    assert started[-1] == ("pdserve-decode-1", 2)
    assert kept.name == "pdserve-decode-1"


async def test_a_stuck_engine_is_ended_its_streams_go_elsewhere_and_it_is_rebuilt():
    """An EngineCore that hangs without raising: the node answers its health checks, holds a
    request, and its step count stands still. Past `stall_s` it leaves the pool, the stream on it
    ends as a death (the request may be what hung it), and a new engine is built."""
    from router.errors import NodeFailed
    from tests.helpers.fake_nodes import prepared

    fake = FakeNode("d0", delay_s=30)  # its tokens never come
    decode = pool("decode", fake)
    checks = membership(decode)
    checks.stall_s = 0.2
    node = decode.nodes[0]
    request = prepared()

    async def run():
        leg = Whole("r", [1, 2], request.sampling_params)
        async for _ in decode.stream(node, leg, time.monotonic() + 60):
            pass

    stream = asyncio.create_task(run())
    await asyncio.sleep(0.05)
    await checks.refresh(node)  # its step count, first seen
    assert node.healthy and not fake.dropped
    await asyncio.sleep(0.3)
    await checks.refresh(node)  # the same count, a request held: stuck
    assert not node.healthy and fake.dropped == 1
    try:
        await asyncio.wait_for(stream, 5)
        raise AssertionError("the stream on a stuck engine did not end")
    except NodeFailed as error:
        assert error.died and "stuck" in error.message
    await checks.refresh(node)  # no engine now: one is built
    await settle(node)
    await checks.refresh(node)
    assert node.healthy and fake.starts == 1 and not node.stuck


async def test_an_idle_engine_that_does_not_step_is_not_stuck():
    fake = FakeNode("d0")
    decode = pool("decode", fake)
    checks = membership(decode)
    checks.stall_s = 0.05
    node = decode.nodes[0]
    for _ in range(3):
        await checks.refresh(node)
        await asyncio.sleep(0.1)
    assert node.healthy and not fake.dropped


async def test_a_health_check_counts_the_sequences_another_router_has_on_the_node():
    """With several routers each counts its own requests; the engine's running and waiting
    counts say what the others have there, and the decode pool's load weighs both."""
    from pdserve_core.engine.types import NodeStats
    from router.decides.policies import decode_load

    fake = FakeNode("d0")
    decode = pool("decode", fake)
    checks = membership(decode)
    node = decode.nodes[0]
    node.outstanding = 2  # this router's two streams
    fake.stats = lambda: _stats(NodeStats(running=4, waiting=1))  # and three of another's
    await checks.refresh(node)
    assert node.elsewhere == 3 and decode_load(node) == 5
    node.outstanding = 1  # one of ours ended since: still three elsewhere until the next check
    assert decode_load(node) == 4
    fake.stats = lambda: _stats(NodeStats(running=0))  # a report older than our open request
    await checks.refresh(node)
    assert node.elsewhere == 0 and decode_load(node) == 1


async def _stats(stats):
    return stats
