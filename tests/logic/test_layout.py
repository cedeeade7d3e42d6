"""Choosing one CPU host's layout (pdserve/sim/layout.py): the candidates and the config each
serves with, the ranking, the fallbacks, and the choice made from the calibrations measured on a
2-core host (results/plan/layouts), which must rank the layouts as the measured runs did."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.serve import layout_advice
from pdserve.sim import layout
from pdserve.sim.layout import (
    Judged,
    Layout,
    auto_layout,
    best,
    candidates,
    choose,
    measured_rule,
)
from pdserve_core.config import (
    ConfigError,
    LayoutConfig,
    PDServeConfig,
    engine_threads,
    with_settings,
)
from pdserve_core.roofline.stepmodel import CALIBRATION_ENV
from tests.helpers.layouts import MODEL, file_measured_calibrations

STEADY = LayoutConfig(prompt_len=128, output_len=64, rate=2.0)
INTERFERENCE = LayoutConfig(
    prompt_len=64,
    output_len=128,
    rate=1.0,
    long_prompt_len=1536,
    tpot_slo_s=None,
    max_gap_slo_s=0.25,
)


@pytest.fixture
def calibrations(tmp_path):
    return file_measured_calibrations(tmp_path)


def test_each_candidate_serves_with_engines_on_cores_of_their_own():
    assert candidates(2) == [Layout((2,)), Layout((1, 1))]
    assert [c.name for c in candidates(4)] == [
        "colocated (4 threads)",
        "partitioned 1+3",
        "partitioned 2+2",
        "partitioned 3+1",
    ]
    with pytest.raises(ValueError):
        candidates(0)
    base = with_settings(PDServeConfig(), ["engine.omp_threads=3", "mode=colocated"])
    for candidate in candidates(4):
        config = with_settings(base, candidate.settings())
        pools = config.pools
        if candidate.colocated:
            assert config.mode == "colocated"
            assert engine_threads(config.engine, pools.colocated) == 4
            assert pools.colocated.cpu_bind == ["0-3"]
        else:
            p, d = candidate.threads
            assert config.mode == "disaggregated"
            assert engine_threads(config.engine, pools.prefill) == p
            assert engine_threads(config.engine, pools.decode) == d
            bound = [pools.prefill.cpu_bind[0], pools.decode.cpu_bind[0]]
            assert bound == [
                "0" if p == 1 else f"0-{p - 1}",
                "3" if d == 1 else f"{p}-3",
            ]


def test_the_highest_attainment_wins_and_a_tie_goes_to_the_faster_median_request():
    fast = Judged(Layout((2,)), 0.995, 0.10, 0.030)
    smooth = Judged(Layout((1, 1)), 1.0, 0.12, 0.045)
    assert best([fast, smooth], output_len=64).layout == Layout((2,))  # within a point
    assert best([Judged(Layout((2,)), 0.9, 0.1, 0.03), smooth], 64).layout == Layout((1, 1))
    missing = Judged(Layout((2,)), missing=["/nowhere"])
    assert best([missing, smooth], 64) is smooth
    assert best([missing], 64) is None
    assert "not simulated" in missing.describe() and "/nowhere" in missing.describe()


def test_the_measured_calibrations_rank_the_layouts_as_the_measured_runs_did(calibrations):
    """Uniform prompts: one engine on both cores (plain vLLM's speed); long prompts among
    streams with gaps judged: the split (results/bench/layouts)."""
    steady = choose(2, MODEL, STEADY, calibrations)
    assert steady.layout == Layout((2,))
    assert "simulated with this host's calibrations" in steady.reason
    assert all(j.attainment is not None for j in steady.judged)
    smooth = choose(2, MODEL, INTERFERENCE, calibrations)
    assert smooth.layout == Layout((1, 1))
    by_name = {j.layout.name: j for j in smooth.judged}
    assert by_name["partitioned 1+1"].attainment > by_name["colocated (2 threads)"].attainment
    # the colocated engine's streams wait out the long prompt: the gap the split removes
    assert (
        by_name["colocated (2 threads)"].max_gap_p99_s
        > 0.25
        > by_name["partitioned 1+1"].max_gap_p99_s
    )


def test_without_calibrations_two_cores_follow_the_measured_rule_and_others_keep_the_config(
    tmp_path,
):
    uniform = choose(2, MODEL, STEADY, tmp_path)
    assert uniform.layout == Layout((2,)) and "rule measured on two cores" in uniform.reason
    assert "pdserve plan calibrate" in uniform.reason
    assert all(j.attainment is None and j.missing for j in uniform.judged)
    assert measured_rule(2, INTERFERENCE) == Layout((1, 1))
    assert measured_rule(2, INTERFERENCE.model_copy(update={"max_gap_slo_s": None})) == Layout((2,))
    eight = choose(8, MODEL, STEADY, tmp_path)
    assert eight.layout is None and "no measured rule" in eight.reason


def test_serve_lays_out_the_cores_as_chosen_and_leaves_gpus_and_clusters_alone(
    calibrations, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv(CALIBRATION_ENV, str(calibrations))
    model_dir = tmp_path / "SmolLM2-135M-Instruct"
    config = with_settings(
        PDServeConfig(), ["layout.auto=true", "layout.rate=2", "engine.dtype=bfloat16"]
    )
    with caplog.at_level("INFO", logger="pdserve.sim.layout"):
        served = auto_layout(config, model_dir, host_cores=2)
    assert served.mode == "colocated" and served.pools.colocated.cpu_bind == ["0-1"]
    assert "layout: colocated (2 threads), simulated" in caplog.text
    gaps = with_settings(
        config, ["layout.long_prompt_len=1536", "layout.max_gap_slo_s=0.25", "layout.rate=1"]
    )
    assert auto_layout(gaps, model_dir, host_cores=2).mode == "disaggregated"
    for change in (
        "pools.decode.num_gpus=1",
        "ray.address=127.0.0.1:6379",
        "pools.autoscale.enabled=true",
    ):
        kept = with_settings(config, [change])
        assert auto_layout(kept, model_dir, host_cores=2) == kept, change
    assert "--layout auto" in layout_advice(PDServeConfig(), host_cores=2)


def test_the_traffic_is_checked_like_any_config_field():
    for bad in ("layout.rate=0", "layout.prompt_len=0", "layout.max_gap_slo_s=-1"):
        with pytest.raises(ConfigError, match="layout"):
            with_settings(PDServeConfig(), [bad])


def test_plan_layout_reports_every_rate(calibrations, capsys):
    args = ["plan", "layout", "--mix", "interference", "--rate", "0.5", "1"]
    assert main([*args, "--calibration-dir", str(calibrations), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["traffic"]["rate"] for row in rows] == [0.5, 1.0]
    assert {row["layout"] for row in rows} == {"partitioned 1+1"}
    assert all(row["traffic"]["max_gap_slo_s"] == 0.25 for row in rows)
    steady = ["plan", "layout", "--mix", "steady", "--rate", "2"]
    assert main([*steady, "--calibration-dir", str(calibrations)]) == 0
    text = capsys.readouterr().out
    assert "2 requests/s: colocated (2 threads)" in text
    assert "serve it: pdserve serve --set 'mode=colocated'" in text
    assert main(["plan", "layout", "--rate", "-1"]) == 2
    assert "layout.rate" in capsys.readouterr().err


def test_simulated_traffic_is_enough_requests_to_judge():
    assert layout.MIN_REQUESTS >= 100 and layout.SIMULATED_S >= 30
