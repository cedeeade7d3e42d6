"""Pool membership with fake nodes: a dead actor leaves at once, a busy one after three missed
checks, and a node whose engine died is rebuilt and rejoins."""

from __future__ import annotations

import asyncio

from router.nodes import NodeClient
from tests.helpers.fake_nodes import FakeNode, pool


async def settle(node, timeout: float = 5.0) -> None:
    async def restarted():
        while node.restarting:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(restarted(), timeout)


async def test_a_node_whose_engine_died_is_rebuilt_and_rejoins():
    fake = FakeNode("d0")
    decode = pool("decode", fake)
    node = decode.nodes[0]
    fake.engine = False  # the EngineCore died; the actor cleared it in its health check
    await decode.refresh(node)
    assert not node.healthy and not decode.healthy_nodes()  # out while it is rebuilt
    await settle(node)
    assert fake.starts == 1 and node.info.pid == 2  # a new engine process
    await decode.refresh(node)
    assert node.healthy and decode.healthy_nodes() == [node]


async def test_a_dead_actor_leaves_at_once_and_a_slow_one_after_three_misses():
    fake = FakeNode("d0")
    decode = pool("decode", fake)
    node = decode.nodes[0]
    fake.healthy = False
    await decode.refresh(node)
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
    slow.nodes[0].client = Slow()
    for expected in (True, True, False):
        await slow.refresh(slow.nodes[0])
        assert slow.nodes[0].healthy is expected
