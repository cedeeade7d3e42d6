"""Replicas that follow the load, decided once for two routers, on a multi-node Ray cluster
simulated on this machine: 1P1D of `kv_both` nodes with `pools.autoscale` adding and removing
nodes, and `--routers 2`. Long prompts through both routers press both pools, so the keeper
starts a second prefill node where the cluster has room (the prefill host), and both routers,
told the roster, send it prefill legs; when the load stops, the idle cluster gives a node back:
it leaves both routers' pools at once and is stopped once drained. Each check is decided and
counted once, whatever the number of routers. Requests complete throughout."""

from __future__ import annotations

import dataclasses
import random
import re
import time

import pytest

from tests.e2e.conftest import metric, samples
from tests.e2e.test_autoscale import DECISIONS, _ask, _pools, load_until, serve_autoscaled

ADD_DEADLINE_S = 240
REMOVE_DEADLINE_S = 90
INTERVAL_S = 1  # pools.autoscale.interval_s, as serve_autoscaled sets it


@pytest.fixture(scope="module")
def scaling(tmp_path_factory):
    yield from serve_autoscaled(
        tmp_path_factory.mktemp("serve-replicas"),
        hosts={"prefill": 2, "decode": 1},  # room for a second prefill node
        replicas={"prefill": 1, "decode": 1},
        autoscale="cooldown_s: 2, min_pressure: 0.3, add_above: 0.05, remove_below: 0.02, "
        "remove_after_s: 8, max_prefill: 2",
        routers=2,
    )


def _decisions(server) -> float:
    """Every autoscale check this router has counted (any action, any reason)."""
    return sum(s.value for s in samples(server) if s.name == DECISIONS)


def test_a_pressed_cluster_grows_where_it_has_room_and_shrinks_when_idle(scaling):
    routers = [dataclasses.replace(scaling, url=r["http"]) for r in scaling.routers]
    assert len(routers) == 2
    for server in routers:
        assert _pools(server) == {"prefill": ["pdserve-prefill-0"], "decode": ["pdserve-decode-0"]}
    routed = {"node": "pdserve-prefill-1", "pool": "prefill"}
    checks, began = _decisions(routers[0]), time.monotonic()
    # until the new node has started, joined and taken prefill legs from both routers

    def both_use_it() -> bool:
        legs = [metric(server, "pdserve_routing_decisions_total", **routed) for server in routers]
        return min(legs) >= 1

    answers, failures = load_until(routers, both_use_it, ADD_DEADLINE_S)
    assert both_use_it(), [_pools(server) for server in routers]
    assert metric(routers[0], DECISIONS, action="add_prefill", reason="added") >= 1
    # one decision per check (a 1 s interval), counted by router 0 alone
    checked = _decisions(routers[0]) - checks
    assert 0 < checked <= (time.monotonic() - began) / INTERVAL_S + 2, checked
    assert _decisions(routers[1]) == 0
    log = scaling.log.read_text()
    assert log.count("autoscale: starting a prefill node") == 1
    assert "autoscale: pdserve-prefill-1 joined the prefill pool" in log
    for i in (0, 1):
        said = f"router {i}: .* autoscale, as the keeper decided: pdserve-prefill-1 joined the"
        assert re.search(said, log), f"router {i} never heard of the new node"
    assert not failures, failures[:3]
    assert answers and all(a["usage"]["completion_tokens"] == 2 for a in answers)

    # idle now: the cluster gives a node back. Which one depends on the tail of the load: the
    # extra prefill node goes, or (the decode pool still busy when prefill went quiet) it first
    # moves to the decode pool and the lighter decode node goes; either way back to two nodes,
    # in both routers' pools.
    deadline = time.monotonic() + REMOVE_DEADLINE_S
    while time.monotonic() < deadline and any(
        sum(map(len, _pools(server).values())) > 2 for server in routers
    ):
        time.sleep(0.5)
    pools = [_pools(server) for server in routers]
    assert pools[0] == pools[1], pools
    assert [len(pools[0]["prefill"]), len(pools[0]["decode"])] == [1, 1], pools
    gone = sum(
        metric(routers[0], DECISIONS, action=f"remove_{pool}", reason="removed")
        for pool in ("prefill", "decode")
    )
    assert gone >= 1
    while time.monotonic() < deadline and "drained and stopped" not in scaling.log.read_text():
        time.sleep(0.5)
    assert re.search(r"autoscale: pdserve-\w+-\d drained and stopped", scaling.log.read_text())
    for server in routers:  # the cluster still serves, through either router
        answer = _ask(server, random.Random(7), max_tokens=4)
        assert answer["usage"]["completion_tokens"] == 4
