"""The router is built in one place (router/build.py): `pdserve serve` and the simulator get the
same router from one config, and the runtime's classes carry no defaults of their own."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

from pdserve.sim.cluster import NodeSpec, SimRequest, Simulator, Topology
from pdserve_core.config import PDServeConfig, RouterConfig, parse_config
from pdserve_core.engine.types import NodeInfo
from pdserve_core.roofline.specs import PRESETS
from pdserve_core.roofline.stepmodel import StepModel
from router import build
from router.links.nodes import Node
from tests.conftest import REPO
from tests.helpers.fake_nodes import FakeNode

CONSTRUCTED_IN_BUILD = {
    "Pool",
    "Dispatcher",
    "Dispatcher.colocated",
    "Dispatcher.disaggregated",
    "RetryPolicy",
    "RequestLimits",
    "PoolScaler",
    "Placement",
    "Membership",
}
"""What only router/build.py puts together outside the tests."""

SETTINGS = {
    "router": {
        "policy": "power_of_two",
        "node_silence_s": 7.5,
        "engine_stall_s": 42.0,
        "prefix_aware": False,
        "prefill_fallback": False,
        "placement": {"mode": "threshold", "threshold_tokens": 333},
        "tpot_target_s": 0.25,
        "max_attempts": 5,
        "stream_resume": False,
        "max_engine_deaths": 4,
        "max_n": 7,
        "max_schema_bytes": 999,
        "max_response_tokens": 12345,
    },
    "pools": {
        "decode": {"long_prefill_token_threshold": 96},
        "autoscale": {"enabled": True, "interval_s": 3.0, "cooldown_s": 9.0},
    },
}
"""Every router setting away from its default."""


def fingerprint(dispatcher) -> dict:
    """What the config set in a built router, read off its parts."""
    placement = dispatcher.placement
    return {
        "pools": {
            name: (type(pool.policy).__name__, pool.silence_s)
            for name, pool in dispatcher.pools.items()
        },
        "one_hearing": len({id(pool.hearing) for pool in dispatcher.pools.values()}) == 1,
        "prefix_aware": dispatcher.prefix_aware,
        "fallback": dispatcher.routing.prefill_fallback,
        "placement": (placement.mode, placement.threshold_tokens, placement.step_cap_tokens),
    }


def calls(path) -> set[str]:
    """Names called in a file: `f(...)` as "f", `a.b(...)` as "a.b"."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                found.add(func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                found.add(f"{func.value.id}.{func.attr}")
    return found


def test_only_the_builder_puts_the_router_together():
    elsewhere = {}
    for package in ("pdserve", "pdserve_core", "router", "prefill_node", "decode_node"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "router" / "build.py":
                continue
            made = calls(path) & CONSTRUCTED_IN_BUILD
            if made:
                elsewhere[str(path.relative_to(REPO))] = sorted(made)
    assert not elsewhere, f"built outside router/build.py: {elsewhere}"
    serve = calls(REPO / "pdserve" / "serve.py")
    assert {
        "build.dispatcher",
        "build.scaler",
        "build.retry_policy",
        "build.request_limits",
    } <= serve
    sim = calls(REPO / "pdserve" / "sim" / "cluster.py")
    assert {"build.dispatcher", "build.scaler", "build.memberships"} <= sim
    assert "build.memberships" in serve


def test_the_simulated_router_and_the_served_router_get_the_same_settings():
    config = parse_config(SETTINGS)
    step = StepModel(0.01, 0.001, 1e30, 1e30, 0.0, "flat")
    simulator = Simulator(
        Topology(PRESETS["smollm2-135m"], [NodeSpec(step)], [NodeSpec(step)], config=config)
    )
    simulator.run([SimRequest(0, 0.0, 16, 2)])

    def node(name: str) -> Node:
        return Node(name, FakeNode(name), NodeInfo(name, 1, "ray-node", 2048, 128, 0.1))

    served = build.dispatcher(config, {"prefill": [node("p0")], "decode": [node("d0")]})
    assert fingerprint(simulator.dispatcher) == fingerprint(served)
    assert fingerprint(served) == {
        "pools": {
            "prefill": ("PowerOfTwo", 7.5),
            "decode": ("PowerOfTwo", 7.5),
        },
        "one_hearing": True,
        "prefix_aware": False,
        "fallback": False,
        "placement": ("threshold", 333, 96),
    }
    assert [(w.pool.name, w.stall_s) for w in build.memberships(config, served.pools.values())] == [
        ("prefill", 42.0),
        ("decode", 42.0),
    ]
    scaler = build.scaler(config, served)
    assert (scaler.policy.interval_s, scaler.policy.cooldown_s, scaler.tpot_target_s) == (
        3.0,
        9.0,
        0.25,
    )
    retry, limits = build.retry_policy(config), build.request_limits(config)
    assert (retry.max_attempts, retry.resume, retry.max_engine_deaths) == (5, False, 4)
    assert (limits.max_n, limits.max_schema_bytes, limits.max_response_tokens) == (7, 999, 12345)


def test_a_colocated_router_and_a_stray_pool_name():
    config = PDServeConfig()
    node = Node("c0", FakeNode("c0"), NodeInfo("c0", 1, "ray-node", 2048, 128, 0.1))
    dispatcher = build.dispatcher(config, {"colocated": [node]})
    assert (dispatcher.mode, dispatcher.placement) == ("colocated", None)
    assert build.scaler(parse_config(SETTINGS), dispatcher) is None
    with pytest.raises(ValueError, match="colocated, or prefill and decode"):
        build.dispatcher(config, {"prefill": [node]})


@pytest.mark.parametrize(
    "cls",
    [
        "router.pools.Pool",
        "router.membership.Membership",
        "router.decides.retry.RetryPolicy",
        "router.service.RequestLimits",
    ],
)
def test_the_runtime_classes_take_the_config_settings_without_defaults(cls):
    module, name = cls.rsplit(".", 1)
    target = getattr(__import__(module, fromlist=[name]), name)
    if dataclasses.is_dataclass(target):
        defaulted = [
            f.name
            for f in dataclasses.fields(target)
            if f.default is not dataclasses.MISSING and f.name in RouterConfig.model_fields
        ]
    else:
        signature = inspect.signature(target)
        config_names = {"silence_s": "node_silence_s", "stall_s": "engine_stall_s"}
        defaulted = [
            name
            for name, parameter in signature.parameters.items()
            if name in config_names and parameter.default is not inspect.Parameter.empty
        ]
    assert not defaulted, f"{cls} has defaults of its own for {defaulted}: the config has them"


def test_each_named_choice_has_one_registry():
    from typing import get_args

    from pdserve_core.config import KVTransferConfig
    from pdserve_core.kv.settings import TRANSPORTS
    from pdserve_core.kv.transport import PLANES
    from router.decides.policies import POLICIES

    # transports: the config's choices and the settings' check are the registry itself
    assert get_args(KVTransferConfig.model_fields["transport"].annotation) == tuple(PLANES)
    assert TRANSPORTS == tuple(PLANES)
    # policies: the schema sits below the router, so it names them; the router's registry
    # must answer to exactly those names
    assert set(get_args(RouterConfig.model_fields["policy"].annotation)) == set(POLICIES)
