"""Routing policies over hand-made nodes (pure logic)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve_core.engine.types import NodeStats
from router.decides.policies import (
    LeastOutstanding,
    PowerOfTwo,
    RoundRobin,
    colocated_load,
    decode_load,
    make_policy,
    prefill_load,
)
from router.errors import PoolUnavailable
from router.links.nodes import Node
from tests.helpers.fake_nodes import new_pool


def nodes(*loads: tuple[int, int]) -> list[Node]:
    """(outstanding requests, outstanding prompt tokens) per node."""
    return [
        Node(f"n{i}", client=None, outstanding=r, outstanding_prompt_tokens=t)
        for i, (r, t) in enumerate(loads)
    ]


def test_least_outstanding_prefill_counts_queued_prompt_tokens():
    pool = nodes((1, 5000), (3, 200), (2, 900))
    assert LeastOutstanding(prefill_load).choose(pool).name == "n1"


def test_least_outstanding_decode_counts_sequences_and_kv_pressure():
    pool = nodes((2, 0), (2, 0), (5, 0))
    pool[0].stats = NodeStats(running=2, kv_cache_usage=0.5)
    pool[1].stats = NodeStats(running=2, kv_cache_usage=0.2)
    pool[2].stats = NodeStats(running=5, kv_cache_usage=0.0)
    assert LeastOutstanding(decode_load).choose(pool).name == "n1"


def test_decode_load_counts_each_sequence_once_and_not_the_ended():
    # n0's engine last reported the 3 sequences the router has there; n1's last report came
    # before its 4 started; n2's still shows 5 that have since ended
    pool = nodes((3, 0), (4, 0), (1, 0))
    pool[0].stats = NodeStats(running=3)
    pool[2].stats = NodeStats(running=5)
    assert [decode_load(node) for node in pool] == [3, 4, 1]
    assert LeastOutstanding(decode_load).choose(pool).name == "n2"


def test_each_pool_role_measures_load_its_own_way():
    """A colocated pool counts both queued prompts and running sequences."""
    busy_prompts, busy_sequences = nodes((1, 4000), (6, 0))
    assert make_policy("least_outstanding", "prefill").choose([busy_prompts, busy_sequences]) is (
        busy_sequences
    )
    assert make_policy("least_outstanding", "decode").choose([busy_prompts, busy_sequences]) is (
        busy_prompts
    )
    assert colocated_load(busy_prompts) > colocated_load(busy_sequences)
    assert (
        make_policy("least_outstanding", "colocated").choose([busy_prompts, busy_sequences])
        is busy_sequences
    )
    with pytest.raises(ValueError, match="unknown pool role 'mixed'"):
        make_policy("round_robin", "mixed")


def test_ties_are_shared_round_robin():
    pool = nodes((0, 0), (0, 0), (0, 0))
    policy = LeastOutstanding(decode_load)
    assert Counter(policy.choose(pool).name for _ in range(30)) == {"n0": 10, "n1": 10, "n2": 10}


def test_power_of_two_never_picks_the_most_loaded_of_three():
    pool = nodes((0, 0), (1, 0), (9, 0))
    policy = PowerOfTwo(decode_load, rng=random.Random(1))
    assert "n2" not in {policy.choose(pool).name for _ in range(200)}
    assert policy.choose(pool[:1]).name == "n0"


def test_round_robin_cycles():
    pool = nodes((5, 0), (0, 0))
    policy = RoundRobin(prefill_load)
    assert [policy.choose(pool).name for _ in range(4)] == ["n0", "n1", "n0", "n1"]


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest", "decode")


def test_pool_skips_unhealthy_and_excluded_nodes():
    pool = new_pool("decode", nodes((0, 0), (0, 0), (0, 0)), "round_robin")
    pool.nodes[0].healthy = False
    assert pool.pick(exclude=(pool.nodes[1],)).name == "n2"
    pool.nodes[2].healthy = False
    with pytest.raises(PoolUnavailable, match="no healthy node in the decode pool"):
        pool.pick(exclude=(pool.nodes[1],))
