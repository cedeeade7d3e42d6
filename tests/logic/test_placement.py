"""Per-request prefill placement (router/decides/placement.py) and its place in dispatch, over fake
nodes: the three modes' rules, the live inputs the adaptive rule reads, the hand-over gap it learns,
and that a local decision serves the request on its decode node with no hand-over."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve_core.engine.types import NodeInfo, NodeStats
from router.decides.placement import DECISIONS, LOCAL, REMOTE, prefill_rate
from router.decides.retry import runs
from router.links.nodes import Node
from router.metrics import RouterMetrics
from tests.helpers.fake_nodes import (
    FakeNode,
    Routes,
    disaggregated,
    placement_rule,
    prepared,
    retry_policy,
)


def node(name: str, rate: float | None = None, prefilling: int = 0, outstanding: int = 0):
    stats = NodeStats()
    if rate is not None:  # ten seconds of prompt compute at `rate` tokens/s, 100-token prompts
        stats.prompt_busy_seconds_total = 10.0
        stats.prompt_tokens_computed_total = int(rate * 10)
        stats.requests_started_total = int(rate * 10) // 100
    n = Node(name, FakeNode(name), NodeInfo(name, 1, "ray", 2048, 16, 0.1), stats=stats)
    n.prefilling_tokens, n.outstanding = prefilling, outstanding
    return n


def test_remote_mode_always_hands_over():
    placement = placement_rule("remote")
    assert placement.decide(1, node("d"), node("p")).where == REMOTE


def test_threshold_mode_splits_on_prompt_length():
    placement = placement_rule("threshold", threshold_tokens=256)
    assert placement.decide(256, node("d"), node("p")).where == LOCAL
    assert placement.decide(257, node("d"), node("p")).where == REMOTE


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="router.placement.mode|mode"):
        placement_rule("both")


def test_a_rate_needs_measured_prompt_compute():
    assert prefill_rate(node("fresh")) is None
    assert prefill_rate(node("measured", rate=500)) == pytest.approx(500)
    # a decode node fed hand-overs: one computed prompt token per request is step overhead
    decode = node("decode", rate=200)
    decode.stats.requests_started_total = decode.stats.prompt_tokens_computed_total
    assert prefill_rate(decode) is None


def test_a_rate_follows_the_last_minute_of_health_checks():
    """Lifetime 500 tokens/s, but the engine's last 30 s ran at 200 (longer prompts, a slower
    step): the window is what placement reads; a window with too little prompt compute in it
    leaves the lifetime rate."""
    measured = node("measured", rate=500)

    def sample(t, tokens, busy, requests):
        keys = ("prompt_tokens_computed_total", "prompt_busy_seconds_total")
        return t, dict(zip(keys, (tokens, busy), strict=True), requests_started_total=requests)

    measured.history.extend([sample(0, 5000, 10, 50), sample(30, 5000 + 2000, 20, 60)])
    assert prefill_rate(measured) == pytest.approx(200)
    measured.history.clear()
    measured.history.extend([sample(0, 5000, 10, 50), sample(30, 5040, 10.2, 51)])
    assert prefill_rate(measured) == pytest.approx(500)
    measured.history.extend([sample(100, 5040, 10.2, 51)])  # 70 s later: nothing in the window
    assert prefill_rate(measured) == pytest.approx(500)


def test_adaptive_uses_the_prefill_pool_while_it_is_in_time():
    """Empty queues: the prefill node gives the first token well within the target, so the
    decode node's steps stay pure decode (even though local would be sooner by the hand-over)."""
    placement = placement_rule("adaptive", initial_handover_s=0.1, ttft_target_s=0.5)
    decode, prefill = node("d", rate=500), node("p", rate=500)
    decision = placement.decide(64, decode, prefill)
    assert (decision.where, decision.reason) == (REMOTE, "remote_in_time")
    estimate = placement.estimate(64, decode, prefill)
    assert estimate.local_ttft_s < estimate.remote_ttft_s <= 0.5


def test_a_short_prompt_does_not_wait_behind_a_long_prefill():
    """A 1536-token prompt queued on the prefill node (3 s at 500 tokens/s): a 64-token prompt
    is computed on its decode node instead, a 128-token one would stall its streams too long."""
    placement = placement_rule("adaptive", stall_budget_s=0.15, ttft_target_s=0.5)
    behind_long = node("p", rate=500, prefilling=1536)
    decision = placement.decide(64, node("d", rate=500, outstanding=4), behind_long)
    assert (decision.where, decision.reason) == (LOCAL, "prefill_backlog")
    decision = placement.decide(128, node("d", rate=500, outstanding=4), behind_long)
    assert (decision.where, decision.reason) == (REMOTE, "stall")
    # the stall counts with no stream yet: those that start meanwhile would wait
    decision = placement.decide(1536, node("d", rate=500), behind_long)
    assert (decision.where, decision.reason) == (REMOTE, "stall")


def test_a_busy_decode_node_sends_its_prompts_away_even_late():
    """Both sides backed up and the decode node no sooner: remote."""
    placement = placement_rule("adaptive")
    decision = placement.decide(
        64, node("d", rate=1000, prefilling=3000), node("p", rate=1000, prefilling=2000)
    )
    assert (decision.where, decision.reason) == (REMOTE, "remote_faster")
    assert decision.estimate.remote_ttft_s == pytest.approx(2.064 + placement.handover_s)


def test_adaptive_step_cap_bounds_the_stall():
    """With the engines capping a prompt's tokens per step, only one step's share stalls."""
    capped = placement_rule("adaptive", stall_budget_s=0.15, step_cap_tokens=64)
    decode = node("d", rate=1000, outstanding=2)
    behind_long = node("p", rate=1000, prefilling=4000)
    assert capped.estimate(1024, decode, behind_long).stall_s == pytest.approx(0.064)
    assert capped.decide(1024, decode, behind_long).where == LOCAL
    uncapped = placement_rule("adaptive").estimate(1024, decode, behind_long)
    assert uncapped.stall_s == pytest.approx(1.024)


def test_adaptive_uses_measured_rates_before_the_assumed_one():
    """A decode node that never prefilled borrows the prefill node's measured rate; with no
    measurement anywhere the configured one stands in."""
    placement = placement_rule("adaptive", assumed_prefill_tokens_per_s=100.0, initial_handover_s=0)
    estimate = placement.estimate(100, node("d"), node("p", rate=1000))
    assert estimate.local_ttft_s == pytest.approx(0.1)
    assert placement.estimate(100, node("d"), node("p")).local_ttft_s == pytest.approx(1.0)


def test_the_handover_estimate_follows_measurements():
    placement = placement_rule("adaptive", initial_handover_s=1.0)
    for _ in range(40):
        placement.observe_handover(0.02)
    assert placement.handover_s == pytest.approx(0.02, abs=1e-3)


async def run(dispatcher, request):
    out = []
    deadline = time.monotonic() + 30
    async for delta in runs(dispatcher, request, deadline, retry_policy(3), lambda e: None):
        out.append(delta)
    return [t for d in out for t in d.token_ids]


async def test_a_local_decision_is_served_whole_by_the_decode_node():
    p, d = FakeNode("p0"), FakeNode("d0")
    dispatcher = disaggregated([p], [d], placement=placement_rule("threshold", threshold_tokens=8))
    dispatcher.observer = routes = Routes()
    assert await run(dispatcher, prepared(max_tokens=3, prompt_len=8)) == [104, 105, 106]
    assert not p.calls and [c.method for c in d.calls] == ["generate"]
    assert await run(dispatcher, prepared(max_tokens=3, prompt_len=9)) == [105, 106, 107]
    assert [c.method for c in p.calls] == ["prefill"]
    assert [(r.split, r.reason) for r in routes.seen] == [(False, "short"), (True, "long")]


async def test_a_remote_prefill_measures_its_handover_gap():
    p, d = FakeNode("p0"), FakeNode("d0", delay_s=0.05)
    dispatcher = disaggregated([p], [d])
    dispatcher.observer = routes = Routes()
    await run(dispatcher, prepared(max_tokens=4))
    gaps = routes.gaps
    assert len(gaps) == 1 and 0.05 <= gaps[0] < 5
    assert dispatcher.placement.handover_s != 0.1  # learned from it


async def test_queued_prefill_work_is_counted_until_the_first_token():
    """`prefilling_tokens` is the prompt work a node has not answered yet: counted while the
    prefill runs, cleared by its first token (and by a cancelled call)."""
    p, d = FakeNode("p0", delay_s=0.2), FakeNode("d0")
    dispatcher = disaggregated([p], [d])
    prefill_node = dispatcher.prefill.nodes[0]
    task = asyncio.create_task(run(dispatcher, prepared(max_tokens=3, prompt_len=10)))
    deadline = time.monotonic() + 5
    while not p.calls and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert prefill_node.prefilling_tokens == 10
    await task
    assert prefill_node.prefilling_tokens == 0
    assert dispatcher.decode.nodes[0].prefilling_tokens == 0  # a decode leg computes no prompt


async def test_the_metrics_count_each_decision_from_zero():
    dispatcher = disaggregated(
        [FakeNode("p0")],
        [FakeNode("d0")],
        placement=placement_rule("threshold", threshold_tokens=8),
    )
    metrics = RouterMetrics(dispatcher.pools, "disaggregated", tpot_target_s=0.1)
    metrics.watch(dispatcher)
    text = metrics_text(metrics)
    for reason, where in DECISIONS["threshold"].items():
        assert f'pdserve_prefill_placements_total{{reason="{reason}",where="{where}"}} 0.0' in text
    assert await run(dispatcher, prepared(max_tokens=3, prompt_len=8))  # short: local
    assert await run(dispatcher, prepared(max_tokens=3, prompt_len=9))  # long: a hand-over
    assert await run(dispatcher, prepared(max_tokens=1, prompt_len=9))  # the prefill node alone
    text = metrics_text(metrics)
    assert 'pdserve_prefill_placements_total{reason="short",where="local"} 1.0' in text
    assert 'pdserve_prefill_placements_total{reason="long",where="remote"} 1.0' in text
    assert 'pdserve_routing_decisions_total{node="d0",pool="decode"} 2.0' in text
    assert 'pdserve_routing_decisions_total{node="p0",pool="prefill"} 2.0' in text
    assert "pdserve_handover_gap_seconds_count 1.0" in text


def metrics_text(metrics: RouterMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()
