"""Prefix-aware routing (router/decides/prefixes.py and its uses): the router's record of which
blocks each node holds, the pools' choice by load and uncached tokens, and placement by uncached
tokens — a conversation's next turn goes back to the decode node that holds its history and is
computed there (no Ray, no vLLM)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve_core.engine.blocks import BlockLog
from pdserve_core.engine.types import NodeInfo
from router.decides.policies import UNCACHED_TOKEN_COST, decode_load, make_policy
from router.decides.prefixes import NodePrefixes, Prefix, block_hashes
from router.links.nodes import Node
from tests.conftest import REPO
from tests.helpers.fake_nodes import FakeNode, Routes, disaggregated, placement_rule, sampling
from tests.logic.test_dispatch import collect, tokens

INFO = NodeInfo("n", 1, "ray", 2048, 16, 0.1, num_blocks=8)


def test_a_block_is_named_by_its_tokens_and_everything_before_it():
    a = list(range(100))
    b = a[:40] + [7] + a[41:]  # differs in the third block
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 6  # full blocks only
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:], strict=True))
    assert block_hashes(a, 16, salt="tenant-a")[0] != ha[0]  # a salt shares with its own only
    assert block_hashes(a, 16, prior=ha[:3]) == ha
    longer = Prefix(a)
    longer.hashes(16)
    assert longer.extended(range(100, 130)).hashes(16) == block_hashes(list(range(130)), 16)


def test_a_node_holds_what_was_recorded_until_it_is_evicted_or_rebuilt():
    held = NodePrefixes()
    first = Prefix(list(range(64)))  # 4 blocks
    held.record(INFO, first)
    # a whole-prompt hit stops a block short: the engine computes the last token again
    assert held.cached_tokens(INFO, first) == 48
    assert held.cached_tokens(INFO, Prefix(list(range(40)) + [1] * 30)) == 32
    other = Prefix([5] * 96)  # 6 more blocks: 10 > 8, the least recent two go
    held.record(INFO, other)
    assert len(held) == 8
    assert held.cached_tokens(INFO, first) == 0  # its first block was evicted: no hit at all
    assert held.cached_tokens(INFO, other) == 80
    rebuilt = replace(INFO, pid=2)
    assert held.cached_tokens(rebuilt, other) == 0 and len(held) == 0


def test_a_pool_weighs_cached_tokens_against_load():
    history = Prefix(list(range(1024)))
    nodes = [Node(f"d{i}", FakeNode(f"d{i}"), INFO) for i in range(2)]
    for node in nodes:
        node.info = replace(INFO, name=node.name, num_blocks=4096)
    nodes[0].prefixes.record(nodes[0].info, history)
    policy = make_policy("least_outstanding", "decode")
    uncached = [1024 - node.cached_tokens(history) for node in nodes]
    assert uncached == [16, 1024]
    assert policy.choose_for(nodes, uncached) is nodes[0]
    # it stays while the other is less loaded by fewer sequences than its cache is worth
    worth = (1024 - 16) * UNCACHED_TOKEN_COST["decode"]
    nodes[0].outstanding = int(worth)
    assert decode_load(nodes[0]) - decode_load(nodes[1]) < worth
    assert policy.choose_for(nodes, uncached) is nodes[0]
    nodes[0].outstanding = int(worth) + 1
    assert policy.choose_for(nodes, uncached) is nodes[1]
    # nobody holds it: the policy alone (least loaded)
    assert policy.choose_for(nodes, [1024, 1024]) is nodes[1]


def test_placement_computes_a_cached_history_where_it_is():
    rule = placement_rule("adaptive", initial_handover_s=0.1)
    decode, prefill = (Node(n, FakeNode(n), INFO) for n in ("d0", "p0"))
    # 1000 tokens, 900 held by the decode node: 100 to compute there (0.1 s at the assumed
    # 1000 tokens/s) against 1000 on the prefill node plus the hand-over
    cached = rule.decide(1000, decode, prefill, cached_decode=900)
    assert (cached.where, cached.reason) == ("local", "cached_prefix")
    assert rule.decide(1000, decode, prefill).reason == "stall"  # all 1000 would stall it
    # the new part too long to stall the decode node with: remote, as before
    assert rule.decide(1000, decode, prefill, cached_decode=700).where == "remote"
    # the prefill node holds as much: no reason to compute it on the decode node
    even = rule.decide(1000, decode, prefill, cached_decode=900, cached_prefill=900)
    assert even.where == "local"  # the hand-over is saved; remote would be 0.2 s
    short = placement_rule("threshold", threshold_tokens=256)
    assert short.decide(1000, decode, prefill, cached_decode=800).reason == "short"


def conversation_turn(history: list[int], new: int) -> list[int]:
    return history + list(range(5000, 5000 + new))


@pytest.mark.parametrize("aware", [True, False])
async def test_a_conversations_next_turn_goes_back_to_its_decode_node(aware):
    decodes = [FakeNode("d0"), FakeNode("d1")]
    dispatcher = disaggregated([FakeNode("p0")], decodes, placement=placement_rule("adaptive"))
    dispatcher.prefix_aware = aware
    dispatcher.observer = routes = Routes()
    params = sampling(max_tokens=4)
    from router.request import PreparedRequest

    def ask(prompt):
        return PreparedRequest("cmpl-t", prompt, params, stream=True)

    first = list(range(1, 301))
    got = tokens(await collect(dispatcher, ask(first)))
    turn1 = routes.seen[-1]
    assert turn1.split and turn1.reason == "remote_in_time"
    second = conversation_turn(first + got, 40)  # 344 tokens, 256 held where turn 1 decoded
    await collect(dispatcher, ask(second))
    turn2 = routes.seen[-1]
    if aware:
        assert turn2.node is turn1.node and not turn2.split
        assert (turn2.reason, turn2.cached_tokens) == ("cached_prefix", 256)
        assert [c.method for c in turn1.node.client.calls][-1] == "generate"
    else:  # by load alone the other decode node (round robin), and the whole prompt remote
        assert turn2.node is not turn1.node and turn2.split and turn2.cached_tokens == 0


def test_the_expected_cached_tokens_are_counted_for_the_pool_that_computes():
    from prometheus_client import generate_latest

    from router.decides.routing import Route
    from router.metrics import RouterMetrics

    dispatcher = disaggregated(
        [FakeNode("p0")], [FakeNode("d0")], placement=placement_rule("adaptive")
    )
    metrics = RouterMetrics(dispatcher.pools, "disaggregated", tpot_target_s=0.1)
    metrics.watch(dispatcher)
    (p0,), (d0,) = dispatcher.prefill.nodes, dispatcher.decode.nodes
    metrics.routed(Route(d0, "decode", "remote_in_time", prefill=p0, cached_tokens=256))
    metrics.routed(Route(d0, "decode", "cached_prefix", cached_tokens=640))
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_prefix_expected_cached_tokens_total{pool="prefill"} 256.0' in text
    assert 'pdserve_prefix_expected_cached_tokens_total{pool="decode"} 640.0' in text
    assert 'pdserve_prefill_placements_total{reason="cached_prefix",where="local"} 1.0' in text


async def conversations_on_two_decode_nodes(aware: bool, history: int) -> tuple[float, int]:
    """12 conversations × 6 turns at once over 2 decode nodes (fake engines that take a while
    per token, clients that think a random while): the share of turns after the first that ran
    on the node the turn before ran on, and how many conversations ended on d0."""
    import asyncio
    import random

    from router.decides.policies import make_policy
    from router.request import PreparedRequest

    decodes = [FakeNode("d0"), FakeNode("d1")]
    for fake in decodes:
        fake.delay_s = 0.002
    dispatcher = disaggregated([FakeNode("p0")], decodes, placement=placement_rule("adaptive"))
    dispatcher.decode.policy = make_policy("least_outstanding", "decode")
    dispatcher.prefix_aware = aware
    rng = random.Random(0)
    nodes: dict[int, list[str]] = {}

    async def converse(index: int) -> None:
        await asyncio.sleep(rng.uniform(0, 0.05))
        context = [10_000 + index] * history
        for _ in range(6):
            prompt = conversation_turn(context, 128)
            ask = PreparedRequest("cmpl-t", prompt, sampling(max_tokens=8), True)
            deltas = await collect(dispatcher, ask)
            (served,) = [f.name for f in decodes if any(c.prompt == prompt for c in f.calls)]
            nodes.setdefault(index, []).append(served)
            context = prompt + tokens(deltas)
            await asyncio.sleep(rng.uniform(0, 0.03))

    await asyncio.gather(*(converse(i) for i in range(12)))
    later = [(turns[t - 1], turns[t]) for turns in nodes.values() for t in range(1, 6)]
    kept = sum(before == now for before, now in later) / len(later)
    return kept, [turns[-1] for turns in nodes.values()].count("d0")


async def test_conversations_keep_their_decode_node_and_the_load_stays_even():
    # from a 300-token start (a system prompt and a first message); from 128 tokens, where a
    # first turn's history is worth one sequence, 87-97 % of turns stay
    kept, on_d0 = await conversations_on_two_decode_nodes(True, 300)
    assert kept >= 0.9 and 4 <= on_d0 <= 8  # neither node took every conversation
    blind, _ = await conversations_on_two_decode_nodes(False, 300)
    assert blind < 0.75  # by load alone they wander


def test_the_stall_estimate_reads_the_decode_pools_own_cap():
    from pdserve_core.config import PDServeConfig
    from router.build import decode_step_cap

    config = PDServeConfig.model_validate(
        {"engine": {"long_prefill_token_threshold": 256}, "pools": {"decode": {}}}
    )
    assert decode_step_cap(config) == 256
    config = PDServeConfig.model_validate(
        {
            "engine": {"long_prefill_token_threshold": 256},
            "pools": {"decode": {"long_prefill_token_threshold": 64}},
        }
    )
    assert decode_step_cap(config) == 64


async def test_a_prompt_the_decode_node_lacks_is_prefetched_its_next_turn_is_not():
    import asyncio

    from router.request import PreparedRequest

    p, d = FakeNode("p0"), FakeNode("d0")
    dispatcher = disaggregated([p], [d], placement=placement_rule("remote"))
    prefill_node, decode_node = dispatcher.prefill.nodes[0], dispatcher.decode.nodes[0]
    prefill_node.info = replace(prefill_node.info, kv_host="127.9.0.1", kv_ports=(7100,))
    decode_node.info = replace(decode_node.info, prefetch=True)
    first = list(range(1, 301))  # two full blocks no node has seen
    ask = PreparedRequest("cmpl-t", first, sampling(max_tokens=4), True)
    answer = tokens(await collect(dispatcher, ask))
    await asyncio.sleep(0)
    assert len(d.prefetches) == 1  # the KV crosses while the prompt is computed
    second = conversation_turn(first + answer, 40)
    ask = PreparedRequest("cmpl-t", second, sampling(max_tokens=4), True)
    await collect(dispatcher, ask)
    await asyncio.sleep(0)
    assert len(d.prefetches) == 1  # it holds the history: the pull takes only what it lacks
    assert len(p.calls) == 2 and all(c.method == "prefill" for c in p.calls)


def test_a_block_is_named_alike_in_every_process():
    """Routers and nodes are separate processes, each with its own string-hash seed: a block's
    name must not depend on it (the salt's included)."""
    import subprocess
    import sys

    code = (
        "from pdserve_core.engine.blocks import block_hashes;"
        "print(block_hashes(list(range(100)), 16, 'tenant-a'), block_hashes([7] * 40, 16))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)},
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    here = f"{block_hashes(list(range(100)), 16, 'tenant-a')} {block_hashes([7] * 40, 16)}\n"
    assert runs == {here}
    # any salt a client can send names its own blocks, a lone surrogate (a JSON escape) too
    salts = ["", "tenant-a", "\ud800", "\udc00x", "\U0001f600"]
    assert len({block_hashes([1] * 16, 16, salt)[0] for salt in salts}) == len(salts)


def test_a_node_log_hands_each_router_what_it_has_not_seen():
    log = BlockLog(keep=3)
    assert log.since(0) == (0, [])
    for n in range(1, 5):
        log.add([n, n * 10])
    log.add([])  # a prompt shorter than a block left nothing
    assert log.since(0) == (4, [[2, 20], [3, 30], [4, 40]])  # the oldest is gone
    assert log.since(3) == (4, [[4, 40]])
    assert log.since(4) == (4, [])
    log.clear()  # the engine died: it holds none of them
    log.add([5])
    assert log.since(4) == (5, [[5]])


async def test_a_conversation_alternating_between_two_routers_returns_to_its_node():
    """Two routers over the same nodes: the turn router A ran is in its decode node's log, and
    router B, having read the log with a health check, sends the next turn back there."""
    from router.request import PreparedRequest
    from tests.helpers.fake_nodes import membership

    decodes, prefills = [FakeNode("d0"), FakeNode("d1")], [FakeNode("p0")]
    a, b, unaware = (
        disaggregated(prefills, decodes, placement=placement_rule("adaptive")) for _ in range(3)
    )
    unaware.prefix_aware = False
    params = sampling(max_tokens=4)

    def ask(prompt):
        return PreparedRequest("cmpl-t", prompt, params, stream=True)

    first = list(range(1, 301))
    a.observer = seen_a = Routes()
    got = tokens(await collect(a, ask(first)))
    turn1 = seen_a.seen[-1]
    second = conversation_turn(first + got, 40)
    held = b.decode.nodes[[n.name for n in b.decode.nodes].index(turn1.node.name)]
    assert held.cached_tokens(Prefix(second)) == 0  # B has not heard yet
    watch = membership(b.decode)
    for node in b.decode.nodes:
        await watch.refresh(node)
    assert held.cached_tokens(Prefix(second)) == 256  # the turn's prompt and output, read
    b.observer = seen_b = Routes()
    await collect(b, ask(second))
    turn2 = seen_b.seen[-1]
    assert turn2.node.name == turn1.node.name and not turn2.split
    assert (turn2.reason, turn2.cached_tokens) == ("cached_prefix", 256)
    # a router that does not route by prefix does not read the logs
    watch = membership(unaware.decode)
    watch.prefix_aware = False
    for node in unaware.decode.nodes:
        await watch.refresh(node)
    assert all(len(node.prefixes) == 0 for node in unaware.decode.nodes)
