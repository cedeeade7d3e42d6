"""The cluster simulator against timings worked out by hand, its virtual time, and the router's
own code (pools, routing, dispatch, autoscaler) running in it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from pdserve.cli import main
from pdserve.planner.fit import Fit, save_calibration
from pdserve.sim import loop
from pdserve.sim.cluster import NodeSpec, SimRequest, Topology, requests_from_records, simulate
from pdserve.sim.main import gpu_step_model, synthetic_requests
from pdserve_core.config import AutoscaleConfig, PDServeConfig, parse_config
from pdserve_core.roofline.specs import PRESETS
from pdserve_core.roofline.stepmodel import StepModel
from router import clock
from tests.helpers.fake_nodes import new_pool

SMOL = PRESETS["smollm2-135m"]
FREE = 1e30
FLAT = StepModel(0.010, 0.001, FREE, FREE, 0.0, "flat")
"""A step costs 10 ms + 1 ms per sequence, whatever its tokens: timings by hand."""


def _node(step=FLAT, seqs=64, chunk=2048) -> NodeSpec:
    return NodeSpec(step, seqs, chunk)


def _config(placement: str, autoscale: dict | None = None, **router):
    """A served cluster's config: `router.placement.mode`, other router settings, and
    `pools.autoscale`."""
    data = {"router": {"placement": {"mode": placement}, **router}}
    if autoscale is not None:
        data["pools"] = {"autoscale": autoscale}
    return parse_config(data)


def test_virtual_time_jumps_to_the_next_timer_and_a_stuck_run_says_so():
    async def wait_an_hour():
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(3600)
        return asyncio.get_running_loop().time() - started, clock.now()

    took, router_clock = loop.run(wait_an_hour())
    assert took == pytest.approx(3600) and router_clock == pytest.approx(3600)

    async def wait_forever():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(loop.SimulationStuck):
        loop.run(wait_forever())


def test_one_request_on_one_engine():
    topology = Topology(SMOL, colocated=[_node()], request_overhead_s=0.005)
    result = simulate(topology, [SimRequest(0, 1.0, 100, 4)])
    record = result.records[0]
    # four steps of one sequence (the prompt's samples the first token), 11 ms each
    assert record.token_times_s == pytest.approx([1.016, 1.022, 1.033, 1.044])
    assert record.ttft == pytest.approx(0.016) and record.output_tokens == 4
    assert record.end_s == pytest.approx(1.044)


def test_the_gap_between_steps_spaces_every_token():
    spaced = replace(FLAT, gap_s=0.004)  # outputs handed on and the next step scheduled
    topology = Topology(SMOL, colocated=[_node(spaced)], request_overhead_s=0.005)
    record = simulate(topology, [SimRequest(0, 1.0, 100, 3)]).records[0]
    # each step 11 ms and 4 between: the first token 5 ms on, the later ones as they are made
    assert record.token_times_s == pytest.approx([1.020, 1.030, 1.045])


def test_a_long_prompt_runs_chunk_by_chunk():
    topology = Topology(SMOL, colocated=[_node(chunk=512)])
    record = simulate(topology, [SimRequest(0, 0.0, 1500, 1)]).records[0]
    assert record.ttft == pytest.approx(3 * 0.011)  # 512 + 512 + 476


def test_concurrent_requests_share_steps():
    topology = Topology(SMOL, colocated=[_node()])
    result = simulate(topology, [SimRequest(0, 0.0, 10, 3), SimRequest(1, 0.0, 10, 3)])
    a, b = result.records
    # the first arrival starts a step alone; the second joins the next one (12 ms: two sequences)
    assert a.token_times_s == pytest.approx([0.011, 0.023, 0.035])
    assert b.token_times_s == pytest.approx([0.023, 0.035, 0.046])


def test_batch_slots_make_requests_wait():
    topology = Topology(SMOL, colocated=[_node(seqs=1)])
    a, b = simulate(topology, [SimRequest(0, 0.0, 10, 2), SimRequest(1, 0.0, 10, 2)]).records
    assert a.end_s == pytest.approx(0.022)
    assert b.ttft == pytest.approx(0.033)  # admitted once the first left


def test_disaggregated_request_crosses_the_seam():
    topology = Topology(
        SMOL,
        prefill=[_node()],
        decode=[_node()],
        link_bytes_per_s=1e9,
        link_latency_s=0.001,
        handover_latency_s=0.002,
        config=_config("remote"),
    )
    prompt = 1000
    result = simulate(topology, [SimRequest(0, 0.0, prompt, 3)])
    record = result.records[0]
    pull = prompt * 30 * 768 / 1e9 + 0.001  # SmolLM2: 23 KiB of KV per token
    second = 0.011 + 0.002 + pull + 0.011  # prefill step, relay, the pull holds the admitting step
    assert record.token_times_s == pytest.approx([0.011, second, second + 0.011])
    assert result.placements == {"remote/mode": 1}
    assert result.handover_gaps_s == pytest.approx([second - 0.011])


def test_adaptive_placement_keeps_a_short_prompt_off_a_busy_prefill_node():
    # prefill at 1000 tokens/s; a 3000-token prompt then a short one: adaptive computes the short
    # one on its decode node (the router's own rule, router/decides/placement.py)
    slow = StepModel(0.0, 0.0, 1.0, FREE, 0.0, "slow")
    per_token = slow.seconds(SMOL, 1, 1, 0, 0, 0)
    step = StepModel(0.0, 0.0, per_token * 1000, FREE, 0.0, "1k tokens/s")
    requests = [SimRequest(0, 0.0, 3000, 4), SimRequest(1, 0.1, 50, 4)]
    topology = Topology(
        SMOL,
        prefill=[_node(step)],
        decode=[_node(step)],
        config=_config("adaptive"),
    )
    result = simulate(topology, requests)
    # the long one: 3 s either way, too long to stall the decode node with
    assert result.placements == {"remote/stall": 1, "local/prefill_backlog": 1}
    long, short = result.records
    assert short.ttft < 0.2 < long.ttft
    remote = simulate(
        Topology(
            SMOL,
            prefill=[_node(step)],
            decode=[_node(step)],
            config=_config("remote"),
        ),
        requests,
    )
    assert remote.records[1].ttft > 2.0  # behind the long prompt's first chunk


def test_least_outstanding_spreads_over_decode_nodes():
    topology = Topology(
        SMOL, prefill=[_node()], decode=[_node(), _node()], config=_config("remote")
    )
    requests = [SimRequest(i, 0.0, 10, 50) for i in range(10)]
    result = simulate(topology, requests)
    assert result.busy_share["decode-0"] == pytest.approx(result.busy_share["decode-1"], rel=0.2)
    assert all(r.ok for r in result.records)


def test_topology_rejects_a_cluster_without_decode():
    with pytest.raises(ValueError, match="decode"):
        Topology(SMOL, prefill=[_node()])
    with pytest.raises(ValueError, match="mix"):
        Topology(SMOL, colocated=[_node()], decode=[_node()])


def test_synthetic_requests_and_record_replay():
    from pdserve.bench.workload import Workload

    mix = synthetic_requests(Workload("interference", 64, 128, long_every_s=5), 2.0, 40, seed=1)
    longs = [r for r in mix if r.kind == "long"]
    assert len(longs) >= 2 and all(r.prompt_tokens == 1536 for r in longs)
    assert [r.at_s for r in mix] == sorted(r.at_s for r in mix)
    rec = simulate(Topology(SMOL, colocated=[_node()]), mix[:5]).records
    replay = requests_from_records(rec)
    assert [(r.prompt_tokens, r.output_tokens) for r in replay] == [
        (r.prompt_tokens, r.output_tokens) for r in mix[:5]
    ]


def test_gpu_step_model_from_assumed_efficiencies():
    step = gpu_step_model("h100-sxm", tp=2, flops_efficiency=0.5, bandwidth_efficiency=1.0)
    assert step.flops == pytest.approx(989e12) and step.mem_bandwidth == pytest.approx(6.7e12)
    llama = PRESETS["llama-3-8b"]
    # decode at batch 1 is the weights over the bandwidth, plus the step's overhead
    assert step.decode_step_seconds(llama, 1, 100) == pytest.approx(
        0.002 + 16.06e9 / 6.7e12, rel=0.02
    )


def test_simulate_cli_writes_a_report(tmp_path, capsys):
    path = save_calibration(
        tmp_path / "cal.json",
        "cpu-test-1t",
        SMOL,
        Fit(StepModel(0.004, 0.0008, 150e9, 8e9, 1 / 60e9), 400, 0.01, 0.02),
        {"max_num_batched_tokens": 2048, "max_num_seqs": 64, "request_overhead_s": 0.01},
    )
    out = tmp_path / "sim"
    args = ["simulate", "--calibration", str(path), "--rate", "2", "--num-requests", "30"]
    assert main([*args, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    run = results["runs"]["simulated"]
    assert run["completed"] == 30 and run["ttft_s"]["p50"] > 0.01
    assert (out / "records.jsonl").is_file() and (out / "latency_cdf.png").is_file()
    assert main(["simulate", "--out", str(out)]) == 2
    assert "--calibration" in capsys.readouterr().err


def test_autoscale_rule_holds_moves_and_respects_bounds_and_cooldown():
    from router.decides.autoscale import Autoscaler

    policy = AutoscaleConfig(
        enabled=True, cooldown_s=30, reversal_s=35, high=1.5, min_pressure=0.5, max_prefill=3
    )
    scaler = Autoscaler(policy)
    assert scaler.decide(0, None, 0.5, 1, 3).reason == "no_signal"
    assert scaler.decide(0, 0.6, 0.5, 1, 3).reason == "balanced"
    assert scaler.decide(0, 0.3, 0.1, 1, 3).reason == "idle"  # prefill 3x decode, but not busy
    moved = scaler.decide(1, 0.9, 0.3, 1, 3)
    assert (moved.action, moved.ratio) == ("to_prefill", pytest.approx(3.0))
    assert scaler.decide(20, 0.9, 0.3, 2, 2).reason == "cooldown"
    assert scaler.decide(31, 0.9, 0.3, 3, 1).reason == "at_bounds"  # decode at its minimum
    assert scaler.decide(32, 0.2, 0.9, 3, 1).reason == "reversal"  # undoing the last move: wait
    assert scaler.decide(40, 0.2, 0.9, 3, 1).action == "to_decode"
    assert scaler.decide(80, 0.2, 0.9, 1, 3).reason == "at_bounds"  # prefill at its minimum
    with pytest.raises(ValueError, match="high"):
        AutoscaleConfig(enabled=True, high=1.0)
    with pytest.raises(ValueError, match="decode"):
        AutoscaleConfig(enabled=True, min_decode=0)


def test_autoscaled_pools_follow_a_shift_to_long_prompts():

    step = gpu_step_model("h100-sxm")
    llama = PRESETS["llama-3-8b"]
    node = NodeSpec(step, 256, 2048)
    # first decode-heavy (short prompts, long outputs), then prefill-heavy (long prompts)
    phase = 750  # 15 s at 50 requests/s each
    requests = [SimRequest(i, i * 0.02, 256, 400) for i in range(phase)]
    requests += [SimRequest(phase + i, 15 + i * 0.02, 2000, 8) for i in range(phase)]

    def run(autoscale):
        topology = Topology(
            llama,
            prefill=[node] * 2,
            decode=[node] * 6,
            link_bytes_per_s=50e9,
            config=_config("remote", autoscale, tpot_target_s=0.05),
        )
        return simulate(topology, requests, keep_tokens=False)

    fixed = run(None)
    scaled = run({"enabled": True, "interval_s": 2, "cooldown_s": 4})
    assert fixed.moves == []
    assert scaled.moves and all(m["action"] == "to_prefill" for m in scaled.moves)
    assert scaled.moves[0]["at_s"] > 15  # nothing moves while decode is the heavier side
    assert all(m["decode"] >= 1 for m in scaled.moves)

    def late_ttft_p90(result):
        ttfts = sorted(r.ttft for r in result.records if r.sent_s > 22.5)
        return ttfts[int(0.9 * len(ttfts))]

    assert late_ttft_p90(scaled) < late_ttft_p90(fixed) / 2


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tp", "0"], "--tp: must be at least 1"),
        (["--rate", "-1"], "--rate: must be positive"),
        (["--link-gbs", "0"], "--link-gbs: must be positive"),
        (["--prefill", "0", "--decode", "0"], "needs decode nodes"),
        (["--workload", "random", "--prompt-range", "500", "100"], "500 is above 100"),
        (["--records", "/nonexistent/records.jsonl"], "No such file"),
    ],
)
def test_simulate_refuses_bad_settings(args, says, tmp_path, capsys):
    try:
        code = main(["simulate", "--gpu", "h100-sxm", "--out", str(tmp_path), *args])
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    assert code == 2
    assert says in capsys.readouterr().err


def test_pool_scaler_moves_the_least_busy_node_and_counts_every_check():
    from pdserve_core.engine.types import NodeStats
    from router.decides.autoscale import PoolScaler
    from router.links.nodes import Node
    from router.metrics import RouterMetrics

    def node(name, busy, predicted, steps, **stats):
        n = Node(name, client=None)
        n.stats_asked = 0.0
        n.stats = NodeStats(max_num_seqs=64, **stats)
        n.history.extend(
            [
                (0.0, {"busy_seconds_total": 0, "predicted_busy_seconds_total": 0,
                       "busy_steps_total": 0}),
                (10.0, {"busy_seconds_total": busy, "predicted_busy_seconds_total": predicted,
                        "busy_steps_total": steps}),
            ]
        )  # fmt: skip
        return n

    prefill = new_pool("prefill", [node("p0", 9.5, 9.0, 40, waiting=8)], "round_robin")
    decodes = [node("d0", 3, 2.0, 200, running=5), node("d1", 3, 2.0, 200, running=1)]
    decode = new_pool("decode", decodes, "round_robin")
    metrics = RouterMetrics(
        {"prefill": prefill, "decode": decode}, "disaggregated", tpot_target_s=0.1
    )
    scaler = PoolScaler(
        prefill, decode, AutoscaleConfig(enabled=True, cooldown_s=60), tpot_target_s=0.1
    )
    metrics.watch_autoscale(scaler)
    # prefill: 0.9 of its time + 8/64 queued; decode: 10 ms steps of a 100 ms budget, or slots
    assert scaler.pressure(prefill, "prefill") == pytest.approx(1.025)
    assert scaler.pressure(decode, "decode") == pytest.approx(0.1)  # steps, not slots, fuller
    moved = scaler.check(now=100.0)
    assert moved.action == "to_prefill"
    assert [n.name for n in prefill.nodes] == ["p0", "d1"]  # the less busy decode node
    assert [n.name for n in decode.nodes] == ["d0"]
    assert scaler.check(now=101.0).reason == "cooldown"
    assert scaler.check(now=200.0).reason == "at_bounds"  # one decode node left
    counted = metrics.autoscale
    assert counted.labels(action="to_prefill", reason="moved")._value.get() == 1
    assert counted.labels(action="hold", reason="cooldown")._value.get() == 1
    assert counted.labels(action="to_decode", reason="moved")._value.get() == 0


def test_autoscale_replicas_when_the_cluster_is_short_or_idle():
    from router.decides.autoscale import Autoscaler

    policy = AutoscaleConfig(
        enabled=True,
        cooldown_s=10,
        add_above=0.8,
        remove_below=0.1,
        remove_after_s=10,
        max_decode=3,
    )
    scaler = Autoscaler(policy)
    # both pools pressed: one more node for the heavier one, if the cluster has room
    assert scaler.decide(0, 0.9, 1.2, 1, 2, can_add=lambda role: False).reason == "no_resources"
    added = scaler.decide(0, 0.9, 1.2, 1, 2, can_add=lambda role: role == "decode")
    assert (added.action, added.reason) == ("add_decode", "added")
    assert scaler.decide(5, 0.9, 1.2, 1, 3).reason == "cooldown"
    assert scaler.decide(20, 0.9, 1.2, 1, 3, changing=True).reason == "changing"
    # decode at its maximum: the split is what can change (1.33x: balanced enough)
    assert scaler.decide(20, 0.9, 1.2, 1, 3).reason == "balanced"
    # both idle for remove_after_s: the lighter pool gives a node back, down to its minimum
    assert scaler.decide(40, 0.01, 0.05, 2, 3).reason == "idle"  # idle from now
    assert scaler.decide(45, 0.5, 0.5, 2, 3).reason == "balanced"  # a burst: not idle after all
    assert scaler.decide(46, 0.01, 0.05, 2, 3).reason == "idle"  # idle again, from 46
    removed = scaler.decide(56, 0.01, 0.05, 2, 3)
    assert (removed.action, removed.reason) == ("remove_prefill", "removed")
    # prefill at its minimum: the other pool gives a node back, down to its own
    assert scaler.decide(66, 0.01, 0.05, 1, 3).reason == "idle"
    assert scaler.decide(76, 0.01, 0.05, 1, 3).action == "remove_decode"
    assert scaler.decide(90, 0.01, 0.05, 1, 1).reason == "idle"
    assert scaler.decide(200, 0.01, 0.05, 1, 1).reason == "idle"
    with pytest.raises(ValueError, match="remove_below"):
        AutoscaleConfig(enabled=True, add_above=0.5, remove_below=0.5)


async def test_pool_scaler_adds_and_drains_nodes_through_its_factory():
    import asyncio

    from pdserve_core.engine.types import NodeStats
    from router.decides.autoscale import PoolScaler
    from router.links.nodes import Node

    def node(name):
        n = Node(name, client=None)
        n.stats_asked = 0.0
        n.stats = NodeStats(max_num_seqs=4, running=4, waiting=4)  # pressure 2 either way
        n.history.extend([(0.0, {}), (1.0, {})])  # stats reported, no steps run
        return n

    class Factory:
        def __init__(self):
            self.started, self.stopped = [], []

        def can_add(self, role):
            return True

        async def add(self, role):
            self.started.append(role)
            return node(f"{role}-new")

        async def remove(self, gone):
            self.stopped.append(gone.name)

    prefill = new_pool("prefill", [node("p0")], "round_robin")
    decode = new_pool("decode", [node("d0")], "round_robin")
    factory = Factory()
    policy = AutoscaleConfig(
        enabled=True, cooldown_s=0, add_above=1.0, remove_below=0.1, remove_after_s=0
    )
    scaler = PoolScaler(prefill, decode, policy, 0.1, factory=factory)
    # prefill: its queue (1.0); decode: full slots and its queue (2.0): the decode pool grows
    assert scaler.check(now=1).action == "add_decode"
    assert scaler.check(now=2).reason == "changing"  # one change at a time
    await scaler._change
    assert [n.name for n in decode.nodes] == ["d0", "decode-new"]
    assert scaler.autoscaler.last_change > 1  # the cool-down runs from the join
    for n in (*prefill.nodes, *decode.nodes):  # the load is gone
        n.stats = NodeStats(max_num_seqs=4)
    busy = decode.nodes[0]
    busy.outstanding = 1  # still serving
    assert scaler.check().action == "remove_decode"  # a tie: the decode pool gives back
    assert [n.name for n in decode.nodes] == ["d0"]  # the least busy one left at once
    await asyncio.wait_for(scaler._change, 5)
    assert factory.stopped == ["decode-new"] and factory.started == ["decode"]


def test_simulate_reads_the_served_config_and_its_flags_override_it(tmp_path):
    import argparse

    from pdserve.sim.main import add_parser, config_from_args

    path = tmp_path / "cluster.yaml"
    path.write_text(
        "router:\n  policy: round_robin\n  node_silence_s: 9\n  placement: {mode: threshold}\n"
        "pools:\n  decode: {replicas: 2}\n"
        "  autoscale: {enabled: true, interval_s: 7, min_decode: 2}\n"
    )
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    base = ["simulate", "--gpu", "h100-sxm", "--decode", "2", "--config", str(path)]
    config = config_from_args(parser.parse_args(base))
    assert (config.router.policy, config.router.node_silence_s) == ("round_robin", 9)
    assert config.router.placement.mode == "threshold"
    assert (config.pools.autoscale.interval_s, config.pools.autoscale.min_decode) == (7, 2)
    flags = ["--placement", "remote", "--autoscale-interval-s", "2", "--tpot-target-s", "0.3"]
    config = config_from_args(parser.parse_args(base + flags))
    assert config.router.placement.mode == "remote" and config.router.policy == "round_robin"
    assert (config.pools.autoscale.interval_s, config.pools.autoscale.min_decode) == (2, 2)
    assert config.router.tpot_target_s == 0.3
    assert (config.mode, config.pools.prefill.replicas, config.pools.decode.replicas) == (
        "disaggregated",
        1,
        2,
    )  # the topology's pools
    # the defaults are the config schema's, not the command line's
    assert config_from_args(parser.parse_args(["simulate", "--gpu", "h100-sxm"])) == (
        PDServeConfig()
    )
