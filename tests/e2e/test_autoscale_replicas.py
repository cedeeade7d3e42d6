"""Replicas that follow the load, on a multi-node Ray cluster simulated on this machine: 1P1D of
`kv_both` nodes with `pools.autoscale` adding and removing nodes. Long prompts press both pools,
so the router starts a second prefill node where the cluster has room (the prefill host), which
then takes prefill legs; when the load stops, the idle cluster gives the node back: it leaves
its pool at once and is stopped once drained. Requests complete throughout."""

from __future__ import annotations

import random
import re
import time

import pytest

from tests.e2e.test_autoscale import _ask, _metric, _pools, load_until, serve_autoscaled

ADD_DEADLINE_S = 240
REMOVE_DEADLINE_S = 90


@pytest.fixture(scope="module")
def scaling(tmp_path_factory):
    yield from serve_autoscaled(
        tmp_path_factory.mktemp("serve-replicas"),
        hosts={"prefill": 2, "decode": 1},  # room for a second prefill node
        replicas={"prefill": 1, "decode": 1},
        autoscale="cooldown_s: 2, min_pressure: 0.3, add_above: 0.05, remove_below: 0.02, "
        "remove_after_s: 8, max_prefill: 2",
    )


def test_a_pressed_cluster_grows_where_it_has_room_and_shrinks_when_idle(scaling):
    server = scaling
    assert _pools(server) == {"prefill": ["pdserve-prefill-0"], "decode": ["pdserve-decode-0"]}
    added = r'pdserve_autoscale_decisions_total\{action="add_prefill",reason="added"\}'
    routed = r'pdserve_routing_decisions_total\{node="pdserve-prefill-1",pool="prefill"\}'
    # until the new node has started, joined and taken prefill legs
    answers, failures = load_until(server, lambda: _metric(server, routed) >= 2, ADD_DEADLINE_S)
    assert _metric(server, added) >= 1
    assert _metric(server, routed) >= 2, _pools(server)
    log = server.log.read_text()
    assert "autoscale: starting a prefill node" in log
    assert "autoscale: pdserve-prefill-1 joined the prefill pool" in log
    assert not failures, failures[:3]
    assert answers and all(a["usage"]["completion_tokens"] == 2 for a in answers)

    # idle now: the cluster gives a node back. Which one depends on the tail of the load: the
    # extra prefill node goes, or (the decode pool still busy when prefill went quiet) it first
    # moves to the decode pool and the lighter decode node goes; either way back to two nodes.
    deadline = time.monotonic() + REMOVE_DEADLINE_S
    while time.monotonic() < deadline and sum(map(len, _pools(server).values())) > 2:
        time.sleep(0.5)
    pools = _pools(server)
    assert [len(pools["prefill"]), len(pools["decode"])] == [1, 1], pools
    removed = r'pdserve_autoscale_decisions_total\{action="remove_%s",reason="removed"\}'
    assert _metric(server, removed % "prefill") + _metric(server, removed % "decode") >= 1
    while time.monotonic() < deadline and "drained and stopped" not in server.log.read_text():
        time.sleep(0.5)
    assert re.search(r"autoscale: pdserve-\w+-\d drained and stopped", server.log.read_text())
    answer = _ask(server, random.Random(7), max_tokens=4)  # the cluster still serves
    assert answer["usage"]["completion_tokens"] == 4
