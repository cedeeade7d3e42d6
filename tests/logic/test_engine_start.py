"""A node asked for an engine by several routers at once builds one: every router that finds the
node without an engine (after Ray restarted it, or a dead or stuck engine) calls `start`. The
engine actor's own `start` over a build that only counts and waits."""

from __future__ import annotations

import asyncio

import pytest

from pdserve_core.engine.actor import EngineActor


class Builds:
    """Stands in for the engine's build: counts the builds, each finishing when let."""

    def __init__(self, node: EngineActor) -> None:
        self.node = node
        self.count = 0
        self.let = asyncio.Event()
        self.fail = False

    async def __call__(self) -> str:
        self.count += 1
        await self.let.wait()
        if self.fail:
            raise RuntimeError("no memory for the KV cache")
        self.node._engine = object()
        return f"engine {self.count}"


@pytest.fixture
def node():
    node = EngineActor("d0", {})
    node._start = Builds(node)
    return node


async def test_routers_asking_at_once_get_one_engine(node):
    calls = [asyncio.ensure_future(node.start()) for _ in range(3)]
    await asyncio.sleep(0)
    node._start.let.set()
    assert await asyncio.gather(*calls) == ["engine 1"] * 3
    assert await node.start() == "engine 1"  # a router late to the restart: the same engine
    assert node._start.count == 1


async def test_a_router_that_gives_up_leaves_the_build_to_the_others(node):
    impatient = asyncio.ensure_future(node.start())
    patient = asyncio.ensure_future(node.start())
    await asyncio.sleep(0)
    impatient.cancel()  # its call timed out (RESTART_TIMEOUT_S)
    node._start.let.set()
    assert await patient == "engine 1"
    assert node._start.count == 1


async def test_a_dropped_engine_or_a_failed_build_is_built_again(node):
    node._start.let.set()
    assert await node.start() == "engine 1"
    node._engine = None  # dropped: dead or stuck
    assert await node.start() == "engine 2"
    node._engine, node._start.fail = None, True
    with pytest.raises(RuntimeError, match="no memory"):
        await node.start()
    node._start.fail = False
    assert await node.start() == "engine 4"
