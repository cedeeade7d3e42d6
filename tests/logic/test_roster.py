"""One autoscale decision for several routers: the keeper's pools change, it tells every router
the decision and the roster that results (pdserve/routers.py), and each router's pools follow it
(router/roster.py) — the same `Node` moved where a node changes role, a new one reached where a
node was started, none where it was stopped. Over fake nodes, through the real lines a router
reads."""

from __future__ import annotations

import asyncio
import io
import json

from pdserve.routers import _Scaling
from pdserve.serve import _follower
from pdserve_core.config import PDServeConfig
from pdserve_core.engine.types import NodeInfo
from router import build
from router.decides.autoscale import Decision
from router.links.nodes import Node
from router.roster import describe, follow
from tests.helpers.fake_nodes import FakeNode

CONFIG = PDServeConfig.model_validate(
    {"mode": "disaggregated", "pools": {"autoscale": {"enabled": True}}, "router": {"replicas": 2}}
)


def info(name: str) -> NodeInfo:
    return NodeInfo(name, 1, "ray-node", 2048, 16, 0.1, kv_host="127.0.0.1", kv_ports=(7000,))


def node(name: str) -> Node:
    return Node(name, FakeNode(name), info(name))


def members(*names_by_role: tuple[str, list[str]]) -> dict[str, list[Node]]:
    return {role: [node(name) for name in names] for role, names in names_by_role}


def names(pools) -> dict[str, list[str]]:
    return {role: [n.name for n in pool.nodes] for role, pool in pools.items()}


def test_a_routers_pools_follow_the_keepers_moves_adds_and_removes():
    start = (("prefill", ["p0"]), ("decode", ["d0", "d1"]))
    keeper, router = build.pools(CONFIG, members(*start)), build.pools(CONFIG, members(*start))
    reached: list[str] = []

    def reach(node_info: NodeInfo) -> Node:
        reached.append(node_info.name)
        return Node(node_info.name, FakeNode(node_info.name), node_info)

    def tell() -> list[str]:  # the roster as it travels: JSON
        sent = json.loads(json.dumps(describe(keeper)))
        from pdserve.serve import node_info

        roster = {role: [node_info(i) for i in infos] for role, infos in sent.items()}
        return follow(router, roster, reach)

    d1 = router["decode"].nodes[1]
    d1.outstanding = 3  # its requests in flight here go with it
    moved = keeper["decode"].nodes.pop(1)
    keeper["prefill"].nodes.append(moved)
    assert tell() == ["d1 moves from the decode pool to the prefill pool"]
    assert names(router) == {"prefill": ["p0", "d1"], "decode": ["d0"]}
    assert router["prefill"].nodes[1] is d1 and d1.outstanding == 3
    assert reached == []

    keeper["prefill"].nodes.append(node("p1"))  # started by the keeper's factory
    assert tell() == ["p1 joined the prefill pool"]
    assert reached == ["p1"]
    assert router["prefill"].nodes[2].info.kv_ports == (7000,)

    keeper["prefill"].nodes.pop(0)  # p0 stopped once drained
    assert tell() == ["p0 left the prefill pool"]
    assert names(router) == {"prefill": ["d1", "p1"], "decode": ["d0"]}
    assert tell() == []  # the same roster again changes nothing


def test_the_keeper_tells_each_decision_and_the_roster_only_when_it_changed():
    told: list[dict] = []
    members_ = members(("prefill", ["p0"]), ("decode", ["d0", "d1"]))
    scaling = _Scaling(CONFIG, members_, None, told.append)
    scaling._decided(Decision("hold", "balanced", 1.0))
    assert told == [{"decision": {"action": "hold", "reason": "balanced"}}]
    pools = scaling._pools
    pools["prefill"].nodes.append(pools["decode"].nodes.pop())
    scaling._decided(Decision("to_prefill", "moved", 3.0))
    assert told[1]["decision"] == {"action": "to_prefill", "reason": "moved"}
    assert [n["name"] for n in told[1]["roster"]["prefill"]] == ["p0", "d1"]
    assert scaling.roster == told[1]["roster"]  # what a router started now is told
    scaling._decided(Decision("hold", "cooldown", 3.0))
    assert "roster" not in told[2]


async def test_a_router_reads_the_keepers_lines_and_counts_the_decisions_once():
    dispatcher = build.dispatcher(CONFIG, members(("prefill", ["p0"]), ("decode", ["d0"])))
    roster = {"prefill": [info("p0").__dict__, info("d0").__dict__], "decode": []}
    lines = io.StringIO(
        "\n".join(
            [
                json.dumps({"decision": {"action": "hold", "reason": "idle"}}),
                "not json",  # a bad line costs that line
                json.dumps({"roster": {"prefill": [], "decode": [], "colocated": []}}),
                json.dumps(
                    {"decision": {"action": "to_prefill", "reason": "moved"}, "roster": roster}
                ),
            ]
        )
        + "\n"
    )
    counted: list[tuple[str, str]] = []
    listen = _follower(
        lines, dispatcher, lambda i: node(i.name), lambda a, r: counted.append((a, r))
    )
    listen(asyncio.get_running_loop())
    for _ in range(200):
        if len(counted) == 2:
            break
        await asyncio.sleep(0.01)
    assert counted == [("hold", "idle"), ("to_prefill", "moved")]
    assert names(dispatcher.pools) == {"prefill": ["p0", "d0"], "decode": []}
