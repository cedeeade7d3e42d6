"""The benchmark's own logic: arrivals, workloads, SSE parsing, percentiles and goodput, and the
report (markdown with ratios, plots)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from pdserve.bench.client import DONE, apply_event, parse_sse_line
from pdserve.bench.report import markdown_table, plot, read_records, write_json
from pdserve.bench.stats import RequestRecord, goodput, percentile, summarize
from pdserve.bench.workload import TOKEN_RANGE, Workload, arrival_times, build_requests


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    times = arrival_times("poisson", 4.0, 20_000, random.Random(1))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential: standard deviation equals the mean, and P(gap > mean) = e^-1
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.02)
    assert times == arrival_times("poisson", 4.0, 20_000, random.Random(1))  # seeded


def test_fixed_rate_arrivals_are_evenly_spaced():
    assert arrival_times("fixed", 2.0, 4, random.Random(0)) == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(ValueError, match="positive"):
        arrival_times("fixed", 0, 4, random.Random(0))


def test_workloads_have_exact_lengths():
    fixed = build_requests(Workload("fixed", 100, 20), 5, "fixed", 1.0)
    assert [len(r.prompt_token_ids) for r in fixed] == [100] * 5
    assert all(TOKEN_RANGE[0] <= t < TOKEN_RANGE[1] for r in fixed for t in r.prompt_token_ids)
    spread = build_requests(Workload("random", prompt_range=(10, 20), output_range=(3, 5)), 200,
                            "concurrency", 0)  # fmt: skip
    assert {len(r.prompt_token_ids) for r in spread} == set(range(10, 21))
    assert {r.max_tokens for r in spread} == {3, 4, 5}
    assert all(r.at_s is None for r in spread)


def test_interference_adds_periodic_long_prompts_within_the_run():
    workload = Workload("interference", 32, 64, long_prompt_len=1000, long_every_s=10)
    requests = build_requests(workload, 40, "fixed", 1.0)  # steady requests over 0..39 s
    long = [r for r in requests if r.kind == "long"]
    assert [r.at_s for r in long] == [5.0, 15.0, 25.0, 35.0]
    assert all(len(r.prompt_token_ids) == 1000 for r in long)
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)
    with pytest.raises(ValueError, match="timed arrivals"):
        build_requests(workload, 4, "concurrency", 0)


def test_sse_lines_parse_to_payloads_done_or_nothing():
    assert parse_sse_line('data: {"choices": [{"text": "hi"}]}') == {"choices": [{"text": "hi"}]}
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("event: message") is None
    with pytest.raises(ValueError, match="malformed"):
        parse_sse_line("data: {not json")


def test_stream_events_build_a_record():
    record = RequestRecord(0, "steady", 10, sent_s=1.0)
    for now, line in [
        (1.5, 'data: {"choices": [{"text": "a"}]}'),
        (1.6, 'data: {"choices": [{"text": "b"}]}'),
        (1.8, 'data: {"choices": [{"text": "c"}]}'),
        (1.8, 'data: {"choices": [], "usage": {"completion_tokens": 4}}'),
    ]:
        apply_event(record, parse_sse_line(line), now)
    record.end_s = 1.9
    assert record.ttft == pytest.approx(0.5)
    assert record.output_tokens == 4  # the usage event wins over the chunk count
    assert [g for _, g in record.itls()] == pytest.approx([0.1, 0.2])
    assert record.tpot == pytest.approx((0.9 - 0.5) / 3)
    failed = RequestRecord(1, "steady", 10, 0.0)
    apply_event(failed, parse_sse_line('data: {"error": {"type": "engine_error", "message": '
                                       '"decode node failed"}}'), 1.0)  # fmt: skip
    assert failed.error == "engine_error: decode node failed" and not failed.ok


def test_percentiles_interpolate_like_numpy():
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def _record(index, ttft, tpot, tokens=11, kind="steady", error=None):
    record = RequestRecord(index, kind, 10, sent_s=0.0, error=error)
    record.token_times_s = [ttft + i * tpot for i in range(tokens)]
    record.token_counts = [1] * tokens
    record.output_tokens = tokens
    record.end_s = record.token_times_s[-1] if error is None else None
    return record


def test_goodput_counts_requests_meeting_both_slos():
    records = [
        _record(0, 0.5, 0.05),  # good
        _record(1, 3.0, 0.05),  # TTFT too slow
        _record(2, 0.5, 0.30),  # TPOT too slow
        _record(3, 0.5, 0.05, error="timeout"),  # failed
        _record(4, 1.9, 0.09),  # good
    ]
    assert goodput(records, 10.0, ttft_slo_s=2.0, tpot_slo_s=0.1) == pytest.approx(0.2)
    summary = summarize(records, 10.0, 2.0, 0.1)
    assert summary["completed"] == 4 and summary["errors"] == 1
    assert summary["request_throughput"] == pytest.approx(0.4)
    assert summary["output_tokens_per_s"] == pytest.approx(4.4)
    assert summary["ttft_s"]["p50"] == pytest.approx(1.2)


def test_long_prompts_are_reported_apart():
    records = [_record(0, 0.2, 0.05), _record(1, 4.0, 0.05, kind="long")]
    summary = summarize(records, 10.0, 2.0, 0.1)
    assert summary["ttft_s"]["p99"] == pytest.approx(0.2)
    assert summary["long_prompt_ttft_s"]["p50"] == pytest.approx(4.0)
    assert summary["goodput"] == pytest.approx(0.1)


def test_report_puts_runs_side_by_side_with_ratios(tmp_path):
    a = summarize([_record(0, 0.4, 0.05)], 10.0, 2.0, 0.1)
    b = summarize([_record(0, 0.2, 0.10)], 10.0, 2.0, 0.1)
    table = markdown_table({"disaggregated": a, "colocated": b})
    assert table.splitlines()[0] == "| metric | disaggregated | colocated | ratio |"
    ttft = next(line for line in table.splitlines() if line.startswith("| TTFT p50"))
    assert ttft == "| TTFT p50 (s) | 0.400 | 0.200 | 2.00× |"
    records = {"disaggregated": [_record(0, 0.4, 0.05), _record(1, 1.0, 0.05, kind="long")]}
    files = plot(tmp_path, records)
    assert [f.name for f in files] == ["latency_cdf.png", "itl_over_time.png"]
    assert all(f.stat().st_size > 10_000 for f in files)


def test_records_round_trip_through_jsonl(tmp_path):
    records = {"colocated": [_record(0, 0.4, 0.05), _record(1, 0.2, 0.05, error="timeout")]}
    write_json(tmp_path, {"runs": {}}, records)
    assert read_records(tmp_path / "records.jsonl") == records
    assert json.loads((tmp_path / "results.json").read_text()) == {"runs": {}}


def test_report_command_recomputes_a_folder_with_other_slos(tmp_path):
    from pdserve.cli import main

    records = {"colocated": [_record(0, 0.4, 0.05), _record(1, 2.5, 0.05)]}
    settings = {"workload": "fixed", "ttft_slo_s": 3.0, "tpot_slo_s": 0.1}
    runs = {"colocated": summarize(records["colocated"], 10.0, 3.0, 0.1)}
    write_json(tmp_path, {"settings": settings, "runs": runs}, records)
    assert runs["colocated"]["goodput"] == pytest.approx(0.2)
    assert main(["bench", "report", str(tmp_path), "--ttft-slo-s", "1.0"]) == 0
    again = json.loads((tmp_path / "results.json").read_text())
    assert again["runs"]["colocated"]["goodput"] == pytest.approx(0.1)
    assert again["settings"]["ttft_slo_s"] == 1.0
    assert "| inter-token latency max (s) |" in (tmp_path / "results.md").read_text()
    assert main(["bench", "report", str(tmp_path / "missing")]) == 2


def test_bench_refuses_bad_settings_and_unreachable_endpoints(tmp_path, capsys):
    import socket

    from pdserve.cli import main

    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    out = str(tmp_path / "out")
    assert main(["bench", "run", "--url", url, "--num-requests", "2", "--out", out]) == 2
    assert f"cannot reach {url}" in capsys.readouterr().err
    assert main(["bench", "run", "--url", url, "--rate", "0", "--out", out]) == 2
    assert "--rate must be positive" in capsys.readouterr().err
    args = ["bench", "run", "--url", url, "--workload", "interference", "--arrivals", "concurrency"]
    assert main([*args, "--out", out]) == 2
    assert "needs timed arrivals" in capsys.readouterr().err


# ---- the rate sweep (pdserve/bench/sweep.py) ---------------------------------------------------


def _streamed(ttft: float, gaps: list[float], kind: str = "steady", ok: bool = True):
    times, now = [ttft], ttft
    for gap in gaps:
        now += gap
        times.append(now)
    return RequestRecord(
        0, kind, 64, 0.0, times, [1] * len(times), len(times), now if ok else None,
        None if ok else "HTTP 503",
    )  # fmt: skip


def test_slos_judge_first_token_tpot_and_the_longest_gap():
    from pdserve.bench.sweep import Slo, attainment, max_gap

    distserve = Slo("DistServe", 1.0, tpot_s=0.08)
    smooth = Slo("smooth", 1.0, max_gap_s=0.25)
    steady = _streamed(0.2, [0.05] * 10)
    stalled = _streamed(0.2, [0.05] * 20 + [0.6])  # TPOT 0.076: DistServe passes, a reader notices
    late = _streamed(1.5, [0.05] * 10)
    assert max_gap(stalled) == pytest.approx(0.6)
    assert distserve.met(steady) and smooth.met(steady)
    assert distserve.met(stalled) and not smooth.met(stalled)
    assert not distserve.met(late) and not smooth.met(late)
    assert not smooth.met(_streamed(0.2, [0.05], ok=False))  # a failed request misses
    long = _streamed(5.0, [0.05], kind="long")  # the disturbance is not judged
    assert attainment([steady, stalled, late, long], smooth) == pytest.approx(1 / 3)
    assert attainment([long], smooth) is None


def test_the_highest_rate_at_ninety_percent_interpolates_the_crossing():
    from pdserve.bench.sweep import highest_rate

    assert highest_rate([(1, 1.0), (2, 0.95), (4, 0.5)]) == {
        "rate": pytest.approx(2 + 2 * 0.05 / 0.45),
        "bound": "=",
    }
    assert highest_rate([(2, 0.8), (1, 0.5)]) == {"rate": 1, "bound": "<"}
    assert highest_rate([(1, 1.0), (3, 0.91)]) == {"rate": 3, "bound": "≥"}
    # the first fall below the goal counts, not a later recovery (noise)
    assert highest_rate([(1, 1.0), (2, 0.5), (3, 0.95)])["rate"] == pytest.approx(1.2)
    assert highest_rate([]) == {"rate": None, "bound": None}


def test_the_lenient_reading_goes_to_the_last_rate_still_at_ninety_percent():
    from pdserve.bench.sweep import Slo, headline, highest_rate, text

    dip = [(1, 0.88), (2, 0.93), (3, 0.94), (4, 0.5)]  # plain vLLM on the interference mix
    assert highest_rate(dip) == {"rate": 1, "bound": "<"}
    assert highest_rate(dip, reading="lenient") == {
        "rate": pytest.approx(3 + 0.04 / 0.44),
        "bound": "=",
    }
    assert highest_rate([(1, 1.0), (2, 0.5), (3, 0.95)], reading="lenient") == {
        "rate": 3,
        "bound": "≥",
    }
    assert highest_rate([(1, 0.5), (2, 0.8)], reading="lenient") == {"rate": 1, "bound": "<"}
    smooth = [(1, 1.0), (2, 0.95), (4, 0.5)]
    assert highest_rate(smooth, reading="lenient") == highest_rate(smooth)
    with pytest.raises(ValueError, match="reading"):
        highest_rate(smooth, reading="loose")
    slo = Slo("smooth", 1.0, max_gap_s=0.25)
    point = {
        "attainment": {"smooth": None},
        "ttft_s": {},
        "itl_s": {},
        "max_gap_s": {},
        "errors": 0,
    }
    results = {
        "points": {
            "steady": {
                "vllm": {str(r): {**point, "attainment": {"smooth": a}} for r, a in dip},
                "adaptive": {str(r): {**point, "attainment": {"smooth": a}} for r, a in smooth},
            }
        }
    }
    row = headline(results, [slo])["steady"]["smooth"]
    assert row["vllm"]["strict"]["bound"] == "<" and row["vllm"]["lenient"]["bound"] == "="
    results.update(headline=headline(results, [slo]), systems=["adaptive", "vllm"])
    results.update(machine="m", duration_s=30, fairness="f")
    for p in results["points"]["steady"].values():
        for v in p.values():
            v.update(ttft_s={"p50": 0.1, "p90": 0.2}, itl_s={"p50": 0.03, "p99": 0.05})
            v.update(max_gap_s={"p99": 0.1})
    table = text(results, [slo])
    assert "| steady | smooth | 2.22 | < 1.00 (lenient 3.09) |" in table


def test_handover_percentiles_come_from_the_histogram_buckets():
    from pdserve.bench.sweep import bucket_quantile, placement_figures

    text = "\n".join(
        [
            "# TYPE pdserve_handover_gap_seconds histogram",
            'pdserve_handover_gap_seconds_bucket{le="0.02"} 0.0',
            'pdserve_handover_gap_seconds_bucket{le="0.04"} 50.0',
            'pdserve_handover_gap_seconds_bucket{le="0.1"} 100.0',
            'pdserve_handover_gap_seconds_bucket{le="+Inf"} 100.0',
            "pdserve_handover_gap_seconds_count 100.0",
            "pdserve_handover_gap_seconds_sum 4.0",
            "# TYPE pdserve_prefill_placements_total counter",
            'pdserve_prefill_placements_total{reason="stall",where="remote"} 7.0',
            "",
        ]
    )
    figures = placement_figures(text)
    assert figures["handover_gaps"] == 100
    assert figures["handover_gap_p50_s"] == pytest.approx(0.04)
    assert figures["handover_gap_p99_s"] == pytest.approx(0.04 + 0.06 * 49 / 50)
    assert figures["placements"] == {"remote/stall": 7.0}
    assert bucket_quantile([], 0.5) is None
    # one point: what changed between two scrapes
    earlier = text.replace("} 50.0", "} 40.0").replace("} 100.0", "} 50.0")
    earlier = earlier.replace("} 7.0", "} 3.0")
    point = placement_figures(text, earlier)
    assert point["handover_gaps"] == 50 and point["placements"] == {"remote/stall": 4.0}
    assert point["handover_gap_p50_s"] == pytest.approx(0.04 + 0.06 * 15 / 40)


def test_sweep_configs_set_the_placement_and_the_overrides(tmp_path):
    import yaml

    from pdserve.bench.sweep import pdserve_config
    from pdserve_core.config import ConfigError, load_config
    from tests.conftest import REPO

    path = pdserve_config("remote", REPO, tmp_path, ["kv_transfer.load=async", "engine.seed=3"])
    config = load_config(path)
    assert config.router.placement.mode == "remote" and config.kv_transfer.load == "async"
    assert config.engine.seed == 3 and config.mode == "disaggregated"
    colocated = yaml.safe_load(pdserve_config("colocated", REPO, tmp_path).read_text())
    assert colocated["mode"] == "colocated" and "placement" not in colocated.get("router", {})
    blind = load_config(pdserve_config("blind", REPO, tmp_path))
    assert blind.router.placement.mode == "adaptive" and not blind.router.prefix_aware
    assert load_config(pdserve_config("adaptive", REPO, tmp_path)).router.prefix_aware
    with pytest.raises(ConfigError, match="router.placement.mode"):
        pdserve_config("remote", REPO, tmp_path, ["router.placement.mode=both"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        pdserve_config("remote", REPO, tmp_path, ["engine"])


async def test_a_conversation_sends_its_whole_history_back_each_turn():
    """`pdserve bench multiturn`'s client against a stand-in server: each turn's prompt is the
    last turn's prompt, the answer's token ids as returned, and the next message."""
    import httpx

    from pdserve.bench import conversations as conv

    prompts: list[list[int]] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompts.append(body["prompt"])
        assert body["return_token_ids"] and body["stream"]
        answer = [len(prompts) * 10 + i for i in range(body["max_tokens"])]
        events = [{"choices": [{"text": "x", "token_ids": [t]}]} for t in answer]
        events.append({"choices": [], "usage": {"completion_tokens": len(answer)}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    workload = conv.Conversations(1, 3, 8, 5, 4, 0.0, 0.0)
    records = await conv.run_conversations(
        "http://bench", workload, "m", transport=httpx.MockTransport(server)
    )
    system, (messages,) = workload.messages()
    assert prompts[0] == system + messages[0]
    assert prompts[1] == prompts[0] + [10, 11, 12, 13] + messages[1]
    assert prompts[2] == prompts[1] + [20, 21, 22, 23] + messages[2]
    assert [r.kind for r in records] == ["turn1", "turn2", "turn3"] and all(r.ok for r in records)
    summary = conv.summary(records, 3)
    assert summary["errors"] == 0 and len(summary["ttft_p50_by_turn_s"]) == 3
    assert summary["mean_prompt_tokens_later"] == (len(prompts[1]) + len(prompts[2])) / 2


def test_what_crossed_is_read_from_the_routers_metrics():
    from pdserve.bench import conversations as conv

    def text(received: float, cached: float) -> str:
        return (
            "# TYPE pdserve_kv_transfer_bytes counter\n"
            'pdserve_kv_transfer_bytes_total{pool="decode",node="d0",direction="received"} '
            f"{received}\n"
            'pdserve_kv_transfer_bytes_total{pool="prefill",node="p0",direction="sent"} 99\n'
            "# TYPE pdserve_kv_handover_blocks counter\n"
            'pdserve_kv_handover_blocks_total{pool="decode",node="d0",outcome="cached"} '
            f"{cached}\n"
        )

    moved = conv.difference(conv.crossing(text(300, 7)), conv.crossing(text(100, 2)))
    assert moved == {"kv_transfer_bytes/received": 200, "kv_handover_blocks/cached": 5}


def test_a_sweep_reports_the_layout_its_overrides_made():
    """The report's "Systems:" line is read from the config each system served with: a `--set`
    that shares the cores says so instead of the default's one core per engine."""
    from pdserve.bench.sweep import describe_layout
    from tests.conftest import REPO as repo

    assert describe_layout("adaptive", repo) == (
        "prefill engine on core 0, 1 thread + decode engine on core 1, 1 thread"
    )
    assert describe_layout("colocated", repo) == "one engine on cores 0-1, 2 threads"
    shared = ["engine.omp_threads=2", "pools.prefill.cpu_bind=['0-1']", "pools.decode.cpu_bind=[]"]
    assert describe_layout("remote", repo, [*shared, "pools.decode.replicas=2"]) == (
        "prefill engine on cores 0-1, 2 threads + 2× decode engine unbound, 2 threads"
    )
