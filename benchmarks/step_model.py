"""The calibrated step-time model and the simulator against measured runs, on this machine.

1. Start pdserve (default 1P1D config) with no calibration: the engines price their steps with
   the roofline at peak. Run `pdserve plan calibrate`'s traffic, fit, save the calibration.
2. Restart pdserve with the calibration in place (PDSERVE_CALIBRATION_DIR): the engines now
   price each step with it (the live predicted/measured series).
3. Run three bench workloads (Poisson arrivals): chat (128 → 64 at 2 req/s), long output
   (512 → 128 at 0.5 req/s), interference (64 → 128 at 1 req/s + 1536 → 16 every 10 s), and
   a denser interference mix, the one the simulator was once 25–36 % off on (64 → 96 at 1.5
   req/s + 1536 → 8 every 8 s).
4. For each, predict the p50 TTFT and TPOT with the planner (calibrated, and the roofline at the
   engines' measured peaks for reference), and the p50/p90 TTFT and ITL with the simulator
   replaying the same requests; compare with what was measured. Also: the calibrated model's
   error on the steps the workloads ran (not the ones it was fitted on) and the live
   measured/predicted ratio the router exported.

    python benchmarks/step_model.py --out results/plan/validation [--duration-s 45]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve.bench import calibrate  # noqa: E402
from pdserve.bench.client import run_load, served_model  # noqa: E402
from pdserve.bench.compare import pdserve_server  # noqa: E402
from pdserve.bench.report import write_json  # noqa: E402
from pdserve.bench.stats import percentile, summarize  # noqa: E402
from pdserve.bench.sweep import placement_figures  # noqa: E402
from pdserve.bench.workload import Workload, build_requests  # noqa: E402
from pdserve.planner.fit import calibration_device  # noqa: E402
from pdserve.planner.plan import Workload as PlanWorkload  # noqa: E402
from pdserve.planner.plan import build_plan, decode_batch_at_rate  # noqa: E402
from pdserve.sim.cluster import NodeSpec, Topology, requests_from_records, simulate  # noqa: E402
from pdserve_core.roofline import model as rf  # noqa: E402
from pdserve_core.roofline.specs import DeviceSpec  # noqa: E402
from pdserve_core.roofline.stepmodel import (  # noqa: E402
    CALIBRATION_ENV,
    StepModel,
    StepRecord,
    load_calibration,
    step_cost,
)

WORKLOADS = {
    "chat": (Workload("fixed", 128, 64), 2.0),
    "long-output": (Workload("fixed", 512, 128), 0.5),
    "interference": (Workload("interference", 64, 128, long_prompt_len=1536), 1.0),
    "interference-8s": (
        Workload("interference", 64, 96, long_prompt_len=1536, long_output_len=8, long_every_s=8),
        1.5,
    ),
}
TARGET = 0.20


def _metric(text: str, name: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if line.startswith(name):
            labels, value = line[len(name) :].rsplit(" ", 1)
            node = re.search(r'node="([^"]+)"', labels)
            found[node.group(1) if node else labels] = float(value)
    return found


def held_out_errors(calibration, nodes: list[dict], seen: dict[str, int]) -> dict:
    """The calibrated model's relative error on steps recorded after `seen` (per node), and the
    engines' mean time between steps (`StepRecord.gap_seconds`), mean step time and median
    measured ÷ predicted step time (`speed`: how much slower than calibrated the engine ran),
    per role."""
    errors = []
    gaps: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for node in nodes:
        start = seen.get(node["node"], 0)
        kept_from = node["steps_seen"] - len(node["records"])
        for row in node["records"][max(0, start - kept_from) :]:
            r = StepRecord.from_list(row)
            if r.prompt_tokens + r.decode_tokens == 0 or r.seconds <= 0:
                continue
            cost = step_cost(
                calibration.model,
                r.prompt_tokens,
                r.prompt_sequences,
                r.decode_tokens,
                r.decode_sequences,
                r.context_tokens,
            )
            role = node.get("role") or "?"
            predicted = calibration.for_role(role).cost_seconds(cost)
            errors.append(abs(predicted - r.seconds) / r.seconds)
            ratios.setdefault(role, []).append(r.seconds / predicted)
            times.setdefault(role, []).append(r.seconds)
            if r.gap_seconds is not None:
                gaps.setdefault(role, []).append(r.gap_seconds)
        seen[node["node"]] = node["steps_seen"]
    return {
        "steps": len(errors),
        "median": percentile(errors, 50),
        "p90": percentile(errors, 90),
        "mean_step_s": {role: sum(v) / len(v) for role, v in times.items()},
        "mean_gap_s": {role: sum(v) / len(v) for role, v in gaps.items()},
        "speed": {role: percentile(v, 50) for role, v in ratios.items()},
    }


def predictions(calibration, peaks: tuple[float, float], workload: Workload, rate: float):
    m = calibration.model
    plan = build_plan(
        m,
        calibration_device(calibration),
        PlanWorkload(prompt_len=workload.prompt_len, output_len=workload.output_len, rate=rate),
        calibration,
    )
    device = DeviceSpec("cpu", peaks[0], peaks[1], 1e12, 1e9)
    mid = workload.prompt_len + workload.output_len // 2
    roof_batch = decode_batch_at_rate(
        rate, workload.output_len, lambda b: rf.decode_step_seconds(m, device, b, mid)
    )
    return {
        "calibrated": {
            "ttft_s": plan["estimates"]["ttft_s"],
            "tpot_s": plan["estimates"]["tpot_at_rate_s"],
            "decode_batch": plan["estimates"]["decode_batch_at_rate"],
        },
        "roofline": {
            "ttft_s": rf.prefill_seconds(m, device, 1, workload.prompt_len),
            "tpot_s": rf.decode_step_seconds(m, device, max(1, round(roof_batch)), mid),
        },
    }


def slower(step: StepModel, ratio: float) -> StepModel:
    """`step` with every step taking `ratio` times as long (the gap between steps as it was)."""
    return replace(
        step,
        overhead_s=step.overhead_s * ratio,
        per_sequence_s=step.per_sequence_s * ratio,
        flops=step.flops / ratio,
        mem_bandwidth=step.mem_bandwidth / ratio,
        attention_s_per_flop=step.attention_s_per_flop * ratio,
    )


def simulated(calibration, records, speed: dict[str, float] | None = None) -> dict:
    """The requests replayed by the simulator with the calibration's step models, or (`speed`)
    with them slowed to the served steps' own measured ÷ predicted ratio per role."""
    engine = calibration.engine
    seqs = int(engine.get("max_num_seqs") or 64)
    chunk = int(engine.get("max_num_batched_tokens") or 2048)
    speed = speed or {}
    steps = {
        role: slower(calibration.for_role(role), speed.get(role, 1.0))
        for role in ("prefill", "decode")
    }
    topology = Topology(
        calibration.model,
        prefill=[NodeSpec(steps["prefill"], seqs, chunk)],
        decode=[NodeSpec(steps["decode"], seqs, chunk)],
        link_bytes_per_s=1e9,
        link_latency_s=0.001,
        request_overhead_s=float(engine.get("request_overhead_s") or 0.0),
        handover_latency_s=0.005,
    )
    result = simulate(topology, requests_from_records(records))
    return {"records": result.records, "placements": result.placements}


def figures(summary: dict) -> dict:
    return {
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p90_s": summary["ttft_s"]["p90"],
        "itl_p50_s": summary["itl_s"]["p50"],
        "itl_p90_s": summary["itl_s"]["p90"],
        "tpot_p50_s": summary["tpot_s"]["p50"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/plan/validation")
    parser.add_argument("--duration-s", type=float, default=45.0, help="arrivals per workload")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "settings": {"duration_s": args.duration_s, "target": TARGET},
        "workloads": {},
    }
    all_records = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-stepmodel-") as tmp:
        work = Path(tmp)
        cal_dir = work / "calibration"
        os.environ[CALIBRATION_ENV] = str(work / "none")  # the first run: no calibration
        (work / "a").mkdir()
        with pdserve_server(None, work / "a") as url:
            logging.info("calibrating")
            alone = asyncio.run(calibrate.drive(url))
            nodes = calibrate.fetch_steps(url)
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            fitted = calibrate.fit_nodes(nodes, cal_dir, alone=alone)
        peak_flops = max(_metric(metrics, "pdserve_node_peak_flops_per_second").values())
        peak_bw = max(
            _metric(metrics, "pdserve_node_peak_memory_bandwidth_bytes_per_second").values()
        )
        roof_ratio = _metric(metrics, "pdserve_node_step_time_ratio")
        calibration = load_calibration(fitted[0].path)
        results["calibration"] = json.loads(fitted[0].path.read_text())
        results["uncalibrated_live_ratio"] = roof_ratio
        results["peaks"] = {"flops": peak_flops, "mem_bandwidth": peak_bw}
        logging.info("calibrated: %s", results["calibration"]["step_model"])
        os.environ[CALIBRATION_ENV] = str(cal_dir)
        (work / "b").mkdir()
        with pdserve_server(None, work / "b") as url:
            model = asyncio.run(served_model(url))
            seen: dict[str, int] = {}
            held_out_errors(calibration, calibrate.fetch_steps(url), seen)
            for name in args.workloads:
                workload, rate = WORKLOADS[name]
                count = int(rate * args.duration_s)
                logging.info("workload %s: %d requests at %.1f req/s", name, count, rate)
                warm = build_requests(workload, 5, "poisson", rate, seed=1)
                asyncio.run(run_load(url, warm, model, None, None, None, 300))
                held_out_errors(calibration, calibrate.fetch_steps(url), seen)
                requests = build_requests(workload, count, "poisson", rate, seed=0)
                before = httpx.get(f"{url}/metrics", timeout=30).text
                records, duration = asyncio.run(
                    run_load(url, requests, model, None, None, None, 300)
                )
                after = httpx.get(f"{url}/metrics", timeout=30).text
                placed = {
                    key: int(count)
                    for key, count in placement_figures(after, before)["placements"].items()
                    if count
                }
                steps = held_out_errors(calibration, calibrate.fetch_steps(url), seen)
                live = _metric(
                    httpx.get(f"{url}/metrics", timeout=30).text, "pdserve_node_step_time_ratio"
                )
                measured = summarize(records, duration, 1.0, 0.08)
                sim = simulated(calibration, records)
                sim_summary = summarize(sim["records"], duration, 1.0, 0.08)
                at_speed = simulated(calibration, records, steps["speed"])
                at_speed_summary = summarize(at_speed["records"], duration, 1.0, 0.08)
                predicted = predictions(calibration, (peak_flops, peak_bw), workload, rate)
                all_records[f"{name}/measured"] = records
                all_records[f"{name}/simulated"] = sim["records"]
                results["workloads"][name] = {
                    "workload": {
                        "prompt_len": workload.prompt_len,
                        "output_len": workload.output_len,
                        "rate": rate,
                        "kind": workload.name,
                        "requests": len(records),
                    },
                    "measured": figures(measured),
                    "simulated": figures(sim_summary),
                    "simulated_at_served_speed": figures(at_speed_summary),
                    "measured_placements": placed,
                    "simulated_placements": sim["placements"],
                    "planner": predicted,
                    "held_out_steps": steps,
                    "live_step_time_ratio": live,
                }
                logging.info("%s: %s", name, json.dumps(results["workloads"][name], indent=1))
    write_json(out, results, all_records)
    text = report(results)
    (out / "README.md").write_text(text)
    print(text)
    return 0


def _cell(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None:
        return "–"
    error = predicted / measured - 1
    mark = "" if abs(error) <= TARGET else " ✗"
    return f"{predicted * 1e3:.0f} ({error:+.0%}){mark}"


def _replayed(measured: dict, simulated: dict) -> str:
    """A replay's cells: each figure measured → simulated (error)."""
    keys = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "tpot_p50_s")
    return " | ".join(f"{measured[k] * 1e3:.0f} → {_cell(simulated[k], measured[k])}" for k in keys)


def _placements(counts: dict | None) -> str:
    if not counts:
        return "–"
    return ", ".join(f"{key} {value}" for key, value in sorted(counts.items()))


def _attention(seconds_per_flop: float) -> str:
    if not seconds_per_flop:
        return "not distinguishable from the rest (no term)"
    return f"at {1 / seconds_per_flop / 1e9:.0f} GFLOP/s"


def report(results: dict) -> str:
    cal = results["calibration"]
    step, fit = cal["step_model"], cal["fit"]
    lines = [
        "# The step-time model and the simulator against measured runs",
        "",
        f"{results['date']}, {results['machine']}; `python benchmarks/step_model.py` (pdserve "
        "1P1D default config: one engine thread on each of two cores; each workload "
        f"{results['settings']['duration_s']:.0f} s of Poisson arrivals after 5 warm-up "
        "requests).",
        "",
        "## Calibration",
        "",
        f"Fitted on {fit['steps']} steps of `pdserve plan calibrate`'s traffic, both engines "
        f"(device `{cal['device']}`): overhead {step['overhead_s'] * 1e3:.2f} ms/step + "
        f"{step['per_sequence_s'] * 1e3:.3f} ms/sequence, linear layers at "
        f"{step['flops'] / 1e9:.0f} GFLOP/s, memory at {step['mem_bandwidth'] / 1e9:.1f} GB/s, "
        f"attention {_attention(step['attention_s_per_flop'])}. "
        f"Fit error median {fit['median_error']:.1%}, p90 {fit['p90_error']:.1%}; "
        f"{step.get('gap_s', 0) * 1e3:.1f} ms between steps. The router "
        f"adds {cal['engine'].get('request_overhead_s', 0) * 1e3:.0f} ms to a first token beyond "
        "the steps.",
        "",
        *[
            f"- {role} engines alone ({entry['fit']['steps']} steps): "
            f"{entry['step_model']['overhead_s'] * 1e3:.2f} ms/step + "
            f"{entry['step_model']['per_sequence_s'] * 1e3:.3f} ms/sequence, "
            f"{entry['step_model']['flops'] / 1e9:.0f} GFLOP/s, "
            f"{entry['step_model']['mem_bandwidth'] / 1e9:.1f} GB/s; error median "
            f"{entry['fit']['median_error']:.1%}, p90 {entry['fit']['p90_error']:.1%}"
            for role, entry in cal.get("roles", {}).items()
        ],
        "",
        f"Engines' measured peaks: {results['peaks']['flops'] / 1e9:.0f} GFLOP/s, "
        f"{results['peaks']['mem_bandwidth'] / 1e9:.1f} GB/s. Live measured ÷ predicted step "
        "time during calibration, uncalibrated (roofline at those peaks): "
        + ", ".join(f"{k} {v:.2f}×" for k, v in results["uncalibrated_live_ratio"].items())
        + ".",
        "",
        f"## Planner: p50 TTFT and TPOT, ms (error against measured; ✗ beyond {TARGET:.0%})",
        "",
        "| workload | measured TTFT | calibrated | roofline | measured TPOT | calibrated | "
        "roofline |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        m, p = w["measured"], w["planner"]
        lines.append(
            f"| {name} | {m['ttft_p50_s'] * 1e3:.0f} | "
            f"{_cell(p['calibrated']['ttft_s'], m['ttft_p50_s'])} | "
            f"{_cell(p['roofline']['ttft_s'], m['ttft_p50_s'])} | "
            f"{m['tpot_p50_s'] * 1e3:.1f} | {_cell(p['calibrated']['tpot_s'], m['tpot_p50_s'])} | "
            f"{_cell(p['roofline']['tpot_s'], m['tpot_p50_s'])} |"
        )
    lines += [
        "",
        "## Simulator: the same requests replayed, ms (error against measured)",
        "",
        "| workload | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | TPOT p50 |",
        "|---|---|---|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        lines.append(f"| {name} | {_replayed(w['measured'], w['simulated'])} |")
    lines += [
        "",
        "The same requests replayed with each role's step model slowed (or sped) to the speed its",
        "engine ran the workload at: the served steps' median measured ÷ predicted time (last",
        "table). What is left is the simulator's own error — batching, queueing, routing — apart",
        "from how far the machine's speed moved between calibration and the run.",
        "",
        "| workload | speed (prefill, decode) | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | "
        "TPOT p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        speed = w["held_out_steps"]["speed"]
        pace = f"{speed.get('prefill', 1):.2f}, {speed.get('decode', 1):.2f}"
        lines.append(
            f"| {name} | {pace} | {_replayed(w['measured'], w['simulated_at_served_speed'])} |"
        )
    lines += [
        "",
        "## Where prompts were computed, measured → simulated (where/reason: requests)",
        "",
        "The router's placement reads each engine's prefill rate over its last minute of health",
        "checks (router/decides/rates.py), in the served cluster and in the simulator alike; where",
        "its estimates sit on the stall budget's edge, the two can still decide differently for",
        "the same request.",
        "",
        "| workload | measured | simulated |",
        "|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        lines.append(
            f"| {name} | {_placements(w.get('measured_placements'))} | "
            f"{_placements(w['simulated_placements'])} |"
        )
    lines += [
        "",
        "## The step model on steps it was not fitted on",
        "",
        "| workload | steps | median error | p90 error | median measured ÷ predicted | "
        "live measured ÷ predicted | decode step, gap (mean ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        h = w["held_out_steps"]
        live = ", ".join(
            f"{k.rsplit('-', 2)[-2]} {v:.2f}" for k, v in w["live_step_time_ratio"].items()
        )
        speed = ", ".join(f"{role} {ratio:.2f}" for role, ratio in h["speed"].items())
        step = h["mean_step_s"].get("decode", 0) * 1e3
        gap = h["mean_gap_s"].get("decode", 0) * 1e3
        lines.append(
            f"| {name} | {h['steps']} | {h['median']:.1%} | {h['p90']:.1%} | {speed} | {live} | "
            f"{step:.1f}, {gap:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
