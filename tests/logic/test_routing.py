"""A request's route is one value (router/decides/routing.py): each reason in its order, and the
adaptive estimate computed for the very prefill node the route sends the prompt to."""

from __future__ import annotations

import pytest

from pdserve_core.engine.types import NodeInfo, NodeStats
from router.decides import seam
from router.decides.routing import Routing
from router.errors import PoolUnavailable
from router.links.nodes import Node
from router.pools import Pool
from tests.helpers.fake_nodes import FakeNode, new_pool, placement_rule, sampling


def node(name: str, rate: float = 1000.0, **counts) -> Node:
    stats = NodeStats(waiting=counts.pop("waiting", 0))
    stats.prompt_busy_seconds_total = 10.0  # ten seconds of prompt compute at `rate`
    stats.prompt_tokens_computed_total = int(rate * 10)
    stats.requests_started_total = int(rate * 10) // 100
    n = Node(name, FakeNode(name), NodeInfo(name, 1, "ray", 2048, 16, 0.1), stats=stats)
    for key, value in counts.items():
        setattr(n, key, value)
    return n


def pool(role: str, *nodes: Node) -> Pool:
    return new_pool(role, list(nodes), "least_outstanding")


def routing(prefill=(), decode=(), mode="adaptive", fallback=True) -> Routing:
    return Routing(
        pool("decode", *(decode or [node("d0")])),
        pool("prefill", *prefill),
        placement_rule(mode, initial_handover_s=0.1),
        prefill_fallback=fallback,
    )


def test_the_estimate_is_for_the_prefill_node_the_route_names():
    """p0 has no prompt in flight but four requests queued in its engine; p1 has 1000 prompt
    tokens in flight. The pool's policy sends the prompt to p1, so the estimate that decides
    reads p1: 1.16 s, not in time — where the node with the shortest in-flight count (p0) would
    have promised 0.16 s."""
    p0 = node("p0", waiting=4)
    p1 = node("p1", outstanding_prompt_tokens=1000, prefilling_tokens=1000)
    busy_decode = node("d0", prefilling_tokens=3000)
    route = routing([p0, p1], [busy_decode]).route(64, sampling(max_tokens=8))
    assert route.split and route.prefill.name == "p1" and route.node.name == "d0"
    assert route.estimate.remote_ttft_s == pytest.approx((1000 + 64) / 1000 + 0.1)
    assert route.reason == "remote_faster"  # local: 3.064 s behind the decode node's own queue


def test_each_reason_in_its_order():
    plain = sampling(max_tokens=8)
    r = routing([node("p0")])
    assert r.route(64, plain).reason == "remote_in_time"
    assert r.route(64, plain).first_token == seam.FIRST_ON_PREFILL
    stateful = r.route(64, sampling(max_tokens=8, stop=["x"]))
    assert stateful.split and stateful.first_token == seam.FIRST_ON_DECODE
    one = r.route(64, sampling(max_tokens=1))
    assert (one.legs(), one.reason) == ([("prefill", "p0")], "one_token")
    logprobs = r.route(64, sampling(max_tokens=8, prompt_logprobs=1))
    assert (logprobs.legs(), logprobs.reason) == ([("decode", "d0")], "one_engine")
    assert routing([]).route(64, plain).reason == "no_prefill_node"
    with pytest.raises(PoolUnavailable, match="prefill"):
        routing([], fallback=False).route(64, plain)
    down = node("d0")
    down.healthy = False
    alone = routing([node("p0")], [down]).route(64, plain)
    assert (alone.legs(), alone.reason) == ([("prefill", "p0")], "no_decode_node")
    colocated = Routing(pool("colocated", node("c0")), prefill_fallback=False).route(64, plain)
    assert (colocated.legs(), colocated.reason) == ([("colocated", "c0")], "colocated")


def test_only_the_placement_rules_reasons_count_as_placements():
    r = routing([node("p0")], mode="threshold")
    assert r.route(300, sampling(max_tokens=8)).placed("threshold")
    assert r.route(8, sampling(max_tokens=8)).placed("threshold")
    assert not r.route(8, sampling(max_tokens=1)).placed("threshold")
    assert not routing([]).route(8, sampling(max_tokens=8)).placed("adaptive")


def spreading(monkeypatch, prefill=(), decode=(), quiet_s=30.0) -> tuple[Routing, list[float]]:
    """A routing whose placement spreads while quiet, on a clock the test moves."""
    now = [1000.0]
    monkeypatch.setattr("router.clock.now", lambda: now[0])
    r = Routing(
        pool("decode", *(decode or [node("d0")])),
        pool("prefill", *(prefill or [node("p0")])),
        placement_rule("adaptive", spread_quiet_s=quiet_s, long_prompt_tokens=512),
        prefill_fallback=True,
    )
    return r, now


def test_while_no_long_prompt_arrives_both_nodes_serve_whole_requests_by_load(monkeypatch):
    d0, p0 = node("d0", outstanding=2), node("p0", outstanding=1)
    r, now = spreading(monkeypatch, [p0], [d0])
    plain = sampling(max_tokens=8)
    first = r.route(128, plain)
    assert (first.legs(), first.reason, first.placed("adaptive")) == (
        [("prefill", "p0")],
        "spread",
        True,
    )
    p0.outstanding = 3  # now the decode node has fewer open
    assert r.route(128, plain).legs() == [("decode", "d0")]
    # a long prompt ends the spread: it and what follows for 30 s are placed by the rule
    long = r.route(1536, plain)
    assert long.split and long.reason == "stall"  # 1.5 s of prompt would stall d0
    now[0] += 29.0
    assert r.route(128, plain).split
    now[0] += 2.0
    assert r.route(128, plain).reason == "spread"


def test_the_spread_goes_where_the_prompt_is_cached_and_is_off_by_default(monkeypatch):
    from router.decides.prefixes import Prefix

    d0, p0 = node("d0", outstanding=5), node("p0")
    r, _ = spreading(monkeypatch, [p0], [d0])
    prefix = Prefix(list(range(256)))
    d0.prefixes.record(d0.info, prefix)
    route = r.route(256, sampling(max_tokens=8), prefix)
    assert (route.legs(), route.reason) == ([("decode", "d0")], "spread")  # its history is there
    off = routing([node("p0")], [node("d0", outstanding=3)])
    assert off.route(128, sampling(max_tokens=8)).reason == "remote_in_time"
