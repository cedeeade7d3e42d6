"""P:D at scale, simulated: LLaMA-3 8B and 70B on H100 and H200 clusters of 8 to 512 GPUs.

For each model and GPU, every xPyD cell of up to `--max-cell` engines (and one colocated
engine, for reference) is simulated (`pdserve.sim`) on a chat workload — prompts uniform in
[256, 2048], outputs uniform in [64, 512], Poisson arrivals — and the highest arrival rate at
which ≥ 90 % of requests meet the SLO is found by bisection. A cluster of N GPUs is then the
best whole number of copies of one cell (requests spread evenly over the copies; what a larger
pool gains from pooling is not counted, so the figures are a floor), and one full-size cluster
per model and GPU is simulated whole to check the copies hold.

The GPUs' step models are *assumed* (pdserve.sim.main.ASSUMED_GPU: 60 % of peak FLOP/s, 80 % of
peak bandwidth, 2 ms per step, 10 µs per sequence), not measured: the shape of the answer (which
P:D, how it moves with the model and the GPU) is what these tables are for. `pdserve plan
calibrate` on a real GPU replaces the assumption.

    python benchmarks/cluster_tables.py --out results/plan/cluster [--duration-s 30]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve.bench.workload import Workload  # noqa: E402
from pdserve.sim.cluster import NodeSpec, Topology, simulate  # noqa: E402
from pdserve.sim.main import ASSUMED_GPU, gpu_step_model, synthetic_requests  # noqa: E402
from pdserve_core.config import PlacementConfig  # noqa: E402
from pdserve_core.roofline.specs import PRESETS  # noqa: E402

CASES = {
    # (model, gpu): GPUs per engine (tensor parallel: the weights and a useful KV cache fit)
    ("llama-3-8b", "h100-sxm"): 1,
    ("llama-3-8b", "h200"): 1,
    ("llama-3-70b", "h100-sxm"): 4,
    ("llama-3-70b", "h200"): 2,
}
SLOS = {
    # model: {name: (TTFT s, TPOT s)}; "tight" is an interactive service's TPOT
    "llama-3-8b": {"relaxed": (1.0, 0.05), "tight": (0.5, 0.02)},
    "llama-3-70b": {"relaxed": (2.0, 0.10), "tight": (1.0, 0.04)},
}
SIZES = (8, 16, 32, 64, 128, 256, 512)
WORKLOAD = Workload("random", prompt_range=(256, 2048), output_range=(64, 512))
GOAL = 0.9
LINK = {"bytes_per_s": 50e9, "latency_s": 0.001}
"""A 400 Gb/s NIC per GPU between prefill and decode nodes, 1 ms per pull."""


def topology(model: str, gpu: str, tp: int, prefill: int, decode: int, colocated: int = 0):
    node = NodeSpec(gpu_step_model(gpu, tp), max_num_seqs=256, max_num_batched_tokens=2048)
    pools = (
        {"colocated": [node] * colocated}
        if colocated
        else {"prefill": [node] * prefill, "decode": [node] * decode}
    )
    return Topology(
        PRESETS[model],
        **pools,
        link_bytes_per_s=LINK["bytes_per_s"],
        link_latency_s=LINK["latency_s"],
        handover_latency_s=0.002,
        placement=PlacementConfig(mode="remote"),
    )


def attainment(topo: Topology, rate: float, duration_s: float, slo: tuple[float, float]) -> float:
    count = max(20, int(rate * duration_s))
    result = simulate(topo, synthetic_requests(WORKLOAD, rate, count, seed=7), keep_tokens=False)
    ttft_slo, tpot_slo = slo
    met = 0
    for r in result.records:
        if r.ok and r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tpot_slo):
            met += 1
    return met / len(result.records)


def best_rate(job) -> dict:
    """Highest rate with attainment ≥ GOAL (bisection on a log scale)."""
    model, gpu, tp, prefill, decode, colocated, duration_s, slo = job
    topo = topology(model, gpu, tp, prefill, decode, colocated)
    low, high = 0.0, 1.0
    while attainment(topo, high, duration_s, slo) >= GOAL:
        low, high = high, high * 2
        if high > 4096:
            break
    for _ in range(7):
        mid = (low + high) / 2 if low else high / 2
        if attainment(topo, mid, duration_s, slo) >= GOAL:
            low = mid
        else:
            high = mid
    engines = colocated or prefill + decode
    return {
        "model": model,
        "gpu": gpu,
        "tp": tp,
        "prefill": prefill,
        "decode": decode,
        "colocated": colocated,
        "gpus": engines * tp,
        "slo": list(slo),
        "rate": low,
        "rate_per_gpu": low / (engines * tp),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/plan/cluster")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--max-cell", type=int, default=6, help="engines per xPyD cell at most")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    started = time.monotonic()
    jobs = []
    for (model, gpu), tp in CASES.items():
        for slo in SLOS[model].values():
            jobs.append((model, gpu, tp, 0, 0, 1, args.duration_s, slo))
            for prefill in range(1, args.max_cell):
                for decode in range(1, args.max_cell - prefill + 1):
                    jobs.append((model, gpu, tp, prefill, decode, 0, args.duration_s, slo))
    with ProcessPoolExecutor(args.workers) as pool:
        cells = list(pool.map(best_rate, jobs))
    tables = {}
    checks = []
    for (model, gpu), tp in CASES.items():
        for slo_name, slo in SLOS[model].items():
            mine = [
                c
                for c in cells
                if c["model"] == model and c["gpu"] == gpu and c["slo"] == list(slo)
            ]
            colocated = next(c for c in mine if c["colocated"])
            rows = []
            for size in SIZES:
                engines = size // tp
                options = [
                    (c["rate"] * (engines // (c["prefill"] + c["decode"])), c)
                    for c in mine
                    if not c["colocated"] and c["prefill"] + c["decode"] <= engines
                ]
                if not options:
                    continue
                rate, cell = max(options, key=lambda o: o[0])
                copies = engines // (cell["prefill"] + cell["decode"])
                rows.append(
                    {
                        "gpus": size,
                        "engines": engines,
                        "prefill": cell["prefill"] * copies,
                        "decode": cell["decode"] * copies,
                        "cell": f"{cell['prefill']}P{cell['decode']}D",
                        "goodput": rate,
                        "goodput_per_gpu": rate / size,
                        "colocated_goodput": colocated["rate"] * engines,
                    }
                )
            name = f"{model} on {gpu}, {slo_name} SLO"
            tables[name] = {"tp": tp, "slo": slo, "rows": rows, "cells": mine}
            # the copies assumption, checked at 64 GPUs: the whole cluster at the predicted rate
            row = next(r for r in rows if r["gpus"] == 64)
            whole = topology(model, gpu, tp, row["prefill"], row["decode"])
            checks.append(
                {
                    "case": name,
                    "gpus": 64,
                    "pd": f"{row['prefill']}P{row['decode']}D",
                    "rate": row["goodput"],
                    "attainment": attainment(whole, row["goodput"], args.duration_s, slo),
                }
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "assumed_gpu": ASSUMED_GPU,
        "link": LINK,
        "workload": {"prompt_range": WORKLOAD.prompt_range, "output_range": WORKLOAD.output_range},
        "goal": GOAL,
        "duration_s": args.duration_s,
        "tables": tables,
        "whole_cluster_checks": checks,
        "seconds": round(time.monotonic() - started),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results)
    (out / "README.md").write_text(text)
    plot(results, out / "goodput.png")
    print(text)
    return 0


def report(results: dict) -> str:
    lines = [
        "# P:D at scale (simulated)",
        "",
        f"{results['date']}; `python benchmarks/cluster_tables.py` ({results['seconds']} s). "
        "Chat workload: prompts uniform in "
        f"{list(results['workload']['prompt_range'])}, outputs in "
        f"{list(results['workload']['output_range'])}, Poisson arrivals, "
        f"{results['duration_s']:.0f} s per point. Goodput: the highest rate at which "
        f"≥ {results['goal']:.0%} of requests meet the SLO. GPUs' step models assumed "
        f"({json.dumps(results['assumed_gpu'])}), KV link "
        f"{results['link']['bytes_per_s'] / 1e9:.0f} GB/s per pull, prompts always on a "
        "prefill node (`remote`). A cluster is estimated as whole copies of its best cell of "
        "at most 6 engines, at the cell's rate times the copies; the last table simulates each "
        "64-GPU cluster whole at that rate.",
        "",
    ]
    for name, table in results["tables"].items():
        ttft, tpot = table["slo"]
        lines += [
            f"## {name} (TP {table['tp']}; TTFT ≤ {ttft:g} s, TPOT ≤ {tpot * 1e3:.0f} ms)",
            "",
            "| GPUs | engines | best P:D | cell | goodput (req/s) | per GPU | colocated | "
            "disaggregated ÷ colocated |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in table["rows"]:
            ratio = row["goodput"] / row["colocated_goodput"] if row["colocated_goodput"] else 0
            lines.append(
                f"| {row['gpus']} | {row['engines']} | {row['prefill']}:{row['decode']} | "
                f"{row['cell']} | {row['goodput']:.1f} | {row['goodput_per_gpu']:.2f} | "
                f"{row['colocated_goodput']:.1f} | {ratio:.2f}× |"
            )
        lines.append("")
    lines += [
        "## The copies assumption, checked",
        "",
        "| case | GPUs | P:D | rate (req/s) | attainment simulated whole |",
        "|---|---|---|---|---|",
    ]
    for c in results["whole_cluster_checks"]:
        lines.append(
            f"| {c['case']} | {c['gpus']} | {c['pd']} | {c['rate']:.1f} | {c['attainment']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name, table in results["tables"].items():
        if "relaxed" not in name:
            continue
        gpus = [r["gpus"] for r in table["rows"]]
        line = ax.loglog(gpus, [r["goodput"] for r in table["rows"]], marker="o", label=name)
        ax.loglog(
            gpus,
            [r["colocated_goodput"] for r in table["rows"]],
            linestyle=":",
            color=line[0].get_color(),
        )
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput at SLO (req/s)")
    ax.set_title("Relaxed SLOs: disaggregated (solid, best P:D), colocated (dotted), simulated")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
