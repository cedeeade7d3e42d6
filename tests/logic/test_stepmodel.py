"""The calibrated step-time model: the fit, storage, the planner's calibrated estimates, the
engines' step records and the live predicted/measured series."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import replace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli import main
from pdserve.planner.fit import Fit, fit, save_calibration
from pdserve.planner.plan import (
    Workload,
    build_plan,
    calibrated_chunk,
    calibrated_prefill,
    decode_batch_at_rate,
)
from pdserve_core.engine.stats import (
    STALL_FACTOR,
    STALL_LOG_EVERY_S,
    STALL_S,
    STEP_RECORDS,
    StatsCollector,
)
from pdserve_core.engine.types import NodeStats
from pdserve_core.roofline import model as rf
from pdserve_core.roofline.specs import DEVICES, PRESETS
from pdserve_core.roofline.stepmodel import (
    Calibration,
    FitError,
    StepModel,
    StepRecord,
    calibration_path,
    device_key,
    find_step_model,
    load_calibration,
    model_key,
    step_cost,
)
from router.decides.rates import Window
from router.links.nodes import Node
from router.metrics import RouterMetrics
from router.metrics.balance import cost_pressure, step_times
from tests.helpers.fake_nodes import new_pool
from tests.logic.test_metrics_logic import _details, _scheduler

SMOL = PRESETS["smollm2-135m"]
TRUE = StepModel(0.004, 0.0008, 150e9, 8e9, 1 / 60e9, "truth")
"""A CPU-like step model the synthetic records are drawn from."""


def _records(model: StepModel, count: int = 400, noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        if rng.random() < 0.4:  # a prompt chunk, maybe with a few decoding sequences
            prompt, prompt_seqs = rng.choice([8, 32, 128, 512, 1024, 2048]), 1
            decode = rng.choice([0, 0, 2, 8])
        else:
            prompt, prompt_seqs, decode = 0, 0, rng.choice([1, 2, 4, 8, 16, 32, 64])
        context = decode * rng.choice([64, 256, 1024])
        seconds = model.seconds(SMOL, prompt, prompt_seqs, decode, decode, context)
        seconds *= 1 + rng.uniform(-noise, noise)
        records.append(StepRecord(prompt, prompt_seqs, decode, decode, context, seconds))
    return records


def test_fit_recovers_the_model_the_steps_came_from():
    result = fit(SMOL, _records(TRUE))
    assert result.median_error < 0.02 and result.p90_error < 0.05
    probe = [
        (2048, 1, 0, 0, 0),
        (0, 0, 1, 1, 100),
        (0, 0, 64, 64, 64 * 900),
        (128, 1, 16, 16, 4000),
    ]
    for shape in probe:
        assert result.model.seconds(SMOL, *shape) == pytest.approx(TRUE.seconds(SMOL, *shape), 0.03)


def test_the_gap_between_steps_is_the_records_mean_and_a_cadence_pays_it():
    records = _records(TRUE)
    for i, record in enumerate(records):  # 1 ms or 3 ms between steps; some after an idle
        records[i] = replace(record, gap_seconds=(0.001, 0.003, None)[i % 3])
    model = fit(SMOL, records).model
    gaps = [r.gap_seconds for r in records if r.gap_seconds and r.prompt_tokens + r.decode_tokens]
    assert model.gap_s == pytest.approx(sum(gaps) / len(gaps)) and 0.0018 < model.gap_s < 0.0022
    assert fit(SMOL, _records(TRUE)).model.gap_s == 0.0  # no gaps recorded: none assumed
    cost = step_cost(SMOL, 0, 0, 8, 8, 8 * 500)
    assert model.period_seconds(cost) == pytest.approx(model.cost_seconds(cost) + model.gap_s)
    assert model.decode_step_seconds(SMOL, 8, 500) == pytest.approx(model.period_seconds(cost))
    assert model.period_seconds(step_cost(SMOL, 0, 0, 0, 0, 0)) == 0.0
    assert StepModel.from_dict(model.to_dict()) == replace(model, source="calibrated")
    older = {k: v for k, v in model.to_dict().items() if k != "gap_s"}
    assert StepModel.from_dict(older).gap_s == 0.0  # a calibration from before gaps


def test_fit_with_noise_stays_within_the_noise():
    result = fit(SMOL, _records(TRUE, noise=0.1, seed=3))
    assert result.median_error < 0.1
    assert result.model.seconds(SMOL, 1536, 1, 0, 0, 0) == pytest.approx(
        TRUE.seconds(SMOL, 1536, 1, 0, 0, 0), rel=0.1
    )


def test_fit_refuses_too_few_or_empty_steps():
    with pytest.raises(FitError, match="at least"):
        fit(SMOL, _records(TRUE, count=5))
    idle = [StepRecord(0, 0, 0, 0, 0, 0.01)] * 50
    with pytest.raises(FitError):
        fit(SMOL, idle)


def test_roofline_step_model_is_the_peak_roofline():
    peak = DEVICES["h100-sxm"]
    roof = StepModel.roofline(peak.peak_flops, peak.mem_bandwidth)
    cost = step_cost(SMOL, 0, 0, 1, 1, 10)
    assert roof.cost_seconds(cost) == pytest.approx(
        max(cost.linear_flops / peak.peak_flops, cost.bytes / peak.mem_bandwidth)
        + cost.attention_flops / peak.peak_flops
    )
    assert roof.seconds(SMOL, 0, 0, 0, 0, 0) == 0.0  # an empty step costs nothing


def test_prefill_seconds_adds_chunks_that_attend_to_earlier_ones():
    whole = TRUE.prefill_seconds(SMOL, 1024, 2048)
    assert whole == pytest.approx(TRUE.seconds(SMOL, 1024, 1, 0, 0, 0))
    chunked = TRUE.prefill_seconds(SMOL, 1024, 256)
    assert chunked > whole  # four overheads, and later chunks attend to earlier ones
    assert chunked - 3 * TRUE.overhead_s - 3 * TRUE.per_sequence_s > whole * 0.99


def test_calibration_round_trip_and_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CALIBRATION_DIR", str(tmp_path))
    device, model = device_key(threads=1), model_key("/models/SmolLM2-135M-Instruct/", "bfloat16")
    assert device.startswith("cpu-") and device.endswith("-1t")
    assert model == "SmolLM2-135M-Instruct-bfloat16"
    assert device_key("NVIDIA H200") == "nvidia-h200"
    assert find_step_model(device, model) is None
    result = fit(SMOL, _records(TRUE))
    path = save_calibration(
        calibration_path(device, model), device, SMOL, result, {"max_num_batched_tokens": 512}
    )
    assert path.parent.parent == tmp_path
    loaded = load_calibration(path)
    assert loaded.model == SMOL and loaded.engine["max_num_batched_tokens"] == 512
    assert loaded.step_model.flops == pytest.approx(result.model.flops)
    assert loaded.step_model.source == f"calibrated:{path}"
    assert find_step_model(device, model).source == f"calibrated:{path}"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(FitError, match="version"):
        load_calibration(path)
    assert find_step_model(device, model) is None  # a bad file is ignored by engines
    path.write_text(json.dumps({**data, "step_model": {"flops": "x"}}))
    with pytest.raises(FitError, match="malformed"):
        load_calibration(path)


def _calibration(step: StepModel = TRUE, **engine) -> Calibration:
    return Calibration("cpu-test-1t", SMOL, step, {"max_num_batched_tokens": 2048, **engine}, {})


def test_calibrated_plan_prices_steps_with_the_model():
    cal = _calibration(request_overhead_s=0.02)
    device = DEVICES["h100-sxm"]
    plan = build_plan(SMOL, device, Workload(prompt_len=1536, output_len=16, rate=1), cal)
    est = plan["estimates"]
    assert est["source"] == "calibrated"
    assert est["ttft_s"] == pytest.approx(0.02 + TRUE.prefill_seconds(SMOL, 1536, 2048))
    assert est["tpot_s"] == pytest.approx(TRUE.decode_step_seconds(SMOL, 1, 1544))
    assert plan["calibration"]["request_overhead_s"] == 0.02
    roof = build_plan(SMOL, device, Workload(prompt_len=1536, output_len=16, rate=1))
    assert roof["estimates"]["ttft_s"] == pytest.approx(rf.prefill_seconds(SMOL, device, 1, 1536))
    assert roof["estimates"]["ttft_s"] < est["ttft_s"] / 100  # H100 peaks against a CPU core
    # P:D from the calibrated rates: one prefill device sustains 1 / prefill time
    assert plan["pools"]["prefill_requests_per_s"] == pytest.approx(
        1 / TRUE.prefill_seconds(SMOL, 1536, 2048)
    )


def test_short_prompts_share_a_prefill_step():
    one = calibrated_prefill(TRUE, SMOL, 1, 100, 2048)
    eight = calibrated_prefill(TRUE, SMOL, 8, 100, 2048)
    assert eight == pytest.approx(TRUE.seconds(SMOL, 800, 8, 0, 0, 0))
    assert one < eight < 8 * one
    assert calibrated_prefill(TRUE, SMOL, 2, 4096, 2048) == pytest.approx(
        2 * TRUE.prefill_seconds(SMOL, 4096, 2048)
    )


def test_calibrated_chunk_grows_with_the_step_overhead():
    light = calibrated_chunk(StepModel(0.0, 0.0, 150e9, 8e9, 0.0), SMOL)
    heavy = calibrated_chunk(StepModel(0.05, 0.0, 150e9, 8e9, 0.0), SMOL)
    assert light < heavy
    for chunk, step in ((light, 0.0), (heavy, 0.05)):
        model = StepModel(step, 0.0, 150e9, 8e9, 0.0)
        long = model.seconds(SMOL, 8192, 1, 0, 0, 0) / 8192
        assert model.seconds(SMOL, chunk, 1, 0, 0, 0) / chunk <= 1.1 * long
        if chunk > 1:
            assert model.seconds(SMOL, chunk // 2, 1, 0, 0, 0) / (chunk // 2) > 1.1 * long


def test_decode_batch_at_rate_is_littles_law():
    assert decode_batch_at_rate(2.0, 64, lambda b: 0.04) == pytest.approx(2 * 64 * 0.04)
    grows = decode_batch_at_rate(2.0, 64, lambda b: 0.03 + 0.001 * b)
    assert grows == pytest.approx(2 * 64 * (0.03 + 0.001 * round(grows)), rel=0.02)
    assert decode_batch_at_rate(100.0, 1000, lambda b: 0.05 * b, limit=512) == 512


def test_collector_keeps_step_records_and_prices_them():
    stats = NodeStats()
    collector = StatsCollector(stats)
    collector.model = SMOL
    collector.set_step_model(TRUE)
    stats.decode_context_tokens = 300
    reported = iter([10.0, 10.050, 10.080, 20.0, 20.031])
    collector.clock = lambda: next(reported)
    collector.record(_scheduler(_details(96, 1, 32, 32, 200.0)), None)
    collector.record(_scheduler(_details(0, 0, 4, 4, 40.0)), None)
    assert stats.busy_steps_total == 2 and stats.step_model_source == "truth"
    assert stats.predicted_busy_seconds_total == pytest.approx(
        TRUE.seconds(SMOL, 96, 1, 32, 32, 300) + TRUE.seconds(SMOL, 0, 0, 4, 4, 300)
    )
    seen, rows = collector.records_since(0)
    assert seen == 2 and rows[0] == [96, 1, 32, 32, 300, 0.2, None]  # no step before it
    assert collector.records_since(1)[0] == 2
    (second,) = collector.records_since(1)[1]
    assert second[:6] == [0, 0, 4, 4, 300, 0.04]
    assert second[6] == pytest.approx(0.010)  # reported 50 ms later, 40 of them computing
    # a step that leaves nothing running: the next one's start is not known (the engine idled)
    collector.record(_scheduler(_details(0, 0, 1, 1, 30.0), running=0), None)
    collector.record(_scheduler(_details(0, 0, 1, 1, 30.0)), None)
    collector.record(_scheduler(_details(0, 0, 1, 1, 30.0)), None)
    gaps = [row[6] for row in collector.records_since(2)[1]]
    assert gaps[0] == pytest.approx(0.0) and gaps[1] is None and gaps[2] == pytest.approx(0.001)
    assert StepRecord.from_list([0, 0, 1, 1, 30, 0.03]).gap_seconds is None  # older rows
    assert StepRecord.from_list(rows[0]) == StepRecord(96, 1, 32, 32, 300, 0.2)
    collector.clock = lambda: 0.0
    for _ in range(STEP_RECORDS + 10):  # the ring keeps the newest
        collector.record(_scheduler(_details(0, 0, 1, 1, 30.0)), None)
    seen, rows = collector.records_since(0)
    assert seen == STEP_RECORDS + 15 and len(rows) == STEP_RECORDS
    newest = collector.records_since(seen - 3)[1]
    assert [row[:6] for row in newest] == [[0, 0, 1, 1, 300, 0.03]] * 3


def test_a_stall_is_counted_and_told_once_a_long_prompt_is_not(caplog):
    """Every stream on an engine stops while a step runs far past its model or while nothing
    runs between two steps: counted in the node's stats (exported), warned of at most every
    `STALL_LOG_EVERY_S` with the step's make-up. A long prompt's step the model predicts is no
    stall, however long."""
    stats = NodeStats()
    collector = StatsCollector(stats, "decode-0")
    collector.model = SMOL
    collector.set_step_model(TRUE)
    decode = TRUE.seconds(SMOL, 0, 0, 8, 8, 0)
    prompt = TRUE.seconds(SMOL, 2000, 1, 0, 0, 0)
    assert prompt > STALL_S + decode  # (the model prices a long prompt's step long)
    t = [100.0]
    collector.clock = lambda: t[0]

    def step(seconds, prompt_tokens=0, after=0.0):
        t[0] += after + seconds
        details = _details(prompt_tokens, 1 if prompt_tokens else 0, 8, 8, seconds * 1e3)
        collector.record(_scheduler(details), None)

    with caplog.at_level(logging.WARNING, logger="pdserve_core.engine.stats"):
        step(decode)
        step(prompt, prompt_tokens=2000)  # as long as its model says: no stall
        step(decode, after=0.01)
        assert stats.stalls_total == 0 and not caplog.records
        step(decode + 1.2)  # the step itself stopped every stream
        assert stats.stalls_total == 1
        assert stats.stall_seconds_total == pytest.approx(1.2)
        step(decode, after=0.8)  # the engine sat 0.8 s between steps, requests running
        assert stats.stalls_total == 2
        assert stats.stall_seconds_total == pytest.approx(2.0)
        t[0] += STALL_LOG_EVERY_S
        step(decode, after=0.7)
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 2, told  # the second stall came within the warning's period
    assert "decode-0" in told[0] and "1.20 s in a step" in told[0] and "predicts" in told[0]
    assert "between two steps" in told[1] and "2 stall(s)" in told[1]
    collector.set_step_model(replace(TRUE, source="roofline"))  # no calibration here
    step(prompt * (STALL_FACTOR + 1), prompt_tokens=2000)
    assert stats.stalls_total == 3  # the roofline's guess of a step is not trusted that far
    step(decode + 1.2)
    assert stats.stalls_total == 4  # but a step 40 times as long as it is
    step(decode, after=0.8)
    assert stats.stalls_total == 5  # a pause between steps is a stall whatever the model
    collector.engine_gone()  # its engine died with requests running and is built again
    step(decode, after=20.0)
    assert stats.stalls_total == 5  # the new engine's first step is no pause after the old's


def _history(t, busy, predicted, steps, prompt_busy=0.0):
    return (
        t,
        {
            "busy_seconds_total": busy,
            "prompt_busy_seconds_total": prompt_busy,
            "predicted_busy_seconds_total": predicted,
            "busy_steps_total": steps,
        },
    )


def test_window_step_times_and_the_exported_series():
    window = Window.of([_history(0, 0, 0, 0), _history(10, 4.0, 2.0, 100)], 30)
    assert step_times(window) == pytest.approx((0.04, 0.02))
    assert step_times(Window.of([_history(0, 0, 0, 0), _history(10, 0, 0, 0)], 30)) is None

    def node(name, busy, predicted, source):
        n = Node(name, client=None)
        n.stats_asked = 0.0
        n.stats = NodeStats(
            busy_seconds_total=busy,
            predicted_busy_seconds_total=predicted,
            busy_steps_total=100,
            step_model_source=source,
            stalls_total=3,
            stall_seconds_total=2.5,
        )
        n.history.extend([_history(0, 0, 0, 0), _history(10, busy, predicted, 100)])
        return n

    pools = {
        "prefill": new_pool(
            "prefill", [node("p0", 6.0, 5.0, "calibrated:/x.json")], "least_outstanding"
        ),
        "decode": new_pool("decode", [node("d0", 2.0, 1.0, "roofline")], "least_outstanding"),
    }
    metrics = RouterMetrics(pools, "disaggregated", window_s=30, tpot_target_s=0.1)
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }

    def value(name, **labels):
        return values[(name, tuple(sorted(labels.items())))]

    assert value("pdserve_node_step_time_ratio", pool="prefill", node="p0") == pytest.approx(1.2)
    assert value("pdserve_node_step_time_ratio", pool="decode", node="d0") == pytest.approx(2.0)
    assert value(
        "pdserve_node_step_seconds", pool="prefill", node="p0", kind="predicted"
    ) == pytest.approx(0.05)
    assert value(
        "pdserve_node_predicted_busy_seconds_total", pool="prefill", node="p0", model="calibrated"
    ) == pytest.approx(5.0)
    assert value("pdserve_node_engine_steps_total", pool="decode", node="d0") == 100
    assert value("pdserve_node_engine_stalls_total", pool="decode", node="d0") == 3
    assert value("pdserve_node_engine_stall_seconds_total", pool="decode", node="d0") == 2.5
    assert value("pdserve_pool_calibrated_busy_ratio", pool="prefill") == pytest.approx(0.5)
    assert value("pdserve_pool_cost_pressure_ratio", pool="decode") == pytest.approx(0.01 / 0.1)
    assert value("pdserve_pool_balance_cost_ratio") == pytest.approx(0.5 / 0.1)


def test_cost_pressure_of_each_role():
    window = Window.of([_history(0, 0, 0, 0), _history(10, 4.0, 3.0, 100)], 30)
    # prefill: the share of time its steps take by the model (3 s of 10), plus its queue
    assert cost_pressure("prefill", window, 0.1) == pytest.approx(0.3)
    queued = NodeStats(max_num_seqs=64, waiting=16)
    assert cost_pressure("prefill", window, 0.1, queued) == pytest.approx(0.55)
    # decode: the predicted step (30 ms) against the TPOT target, or its slots if fuller
    assert cost_pressure("decode", window, 0.1) == pytest.approx(0.3)
    full = NodeStats(max_num_seqs=64, running=64, waiting=32)
    assert cost_pressure("decode", window, 0.1, full) == pytest.approx(1.5)
    assert cost_pressure("decode", None, 0.1) == 0.0


def test_plan_cli_with_a_calibration_and_a_measured_workload(tmp_path, capsys):
    result = Fit(TRUE, 400, 0.01, 0.02)
    path = save_calibration(
        tmp_path / "cal.json", "cpu-test-1t", SMOL, result, {"max_num_batched_tokens": 2048}
    )
    records = tmp_path / "records.jsonl"
    lines = [
        {"run": "a", "index": i, "kind": "steady", "prompt_tokens": 100 + 100 * (i % 2),
         "sent_s": i * 0.5, "token_times_s": [i * 0.5 + 0.1], "token_counts": [1],
         "output_tokens": 32, "end_s": i * 0.5 + 1, "error": None}
        for i in range(11)
    ]  # fmt: skip
    records.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert (
        main(["plan", "--calibration", str(path), "--workload-from", str(records), "--json"]) == 0
    )
    captured = capsys.readouterr()
    plan = json.loads(captured.out)
    assert "2.00 req/s, prompt 145 tokens, output 32 tokens" in captured.err
    assert plan["workload"]["rate"] == pytest.approx(2.0)
    assert plan["estimates"]["source"] == "calibrated"
    assert plan["model"]["name"] == SMOL.name and plan["device"]["name"] == "cpu-test-1t"
    assert main(["plan", "--calibration", str(tmp_path / "missing.json")]) == 2
    assert "cannot read calibration" in capsys.readouterr().err
    assert main(["plan", "--workload-from", str(records), "--run", "zzz"]) == 2
    assert "no run 'zzz'" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--no-traffic"]) == 2
    assert "--no-traffic needs --url" in capsys.readouterr().err
