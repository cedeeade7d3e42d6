"""Pools that follow the balance, simulated: a workload that shifts from decode-heavy to
prefill-heavy on 8 H100s serving LLaMA-3 8B (assumed GPU step model, pdserve.sim.main).

Phase 1 (0-60 s): chat, prompts 256 → outputs 400 tokens at 150 req/s. Phase 2 (60-120 s): long
prompts, 2000 → 8 tokens at 50 req/s. Fixed splits (2P6D, 4P4D, 6P2D) against the autoscaler
(router/decides/autoscale.py) starting from the wrong end for each phase (6P2D, then 2P6D). SLO:
TTFT ≤ 1 s and TPOT ≤ 50 ms.

    python benchmarks/autoscale_sim.py --out results/plan/autoscale
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve.bench.stats import percentile  # noqa: E402
from pdserve.sim.cluster import NodeSpec, SimRequest, Topology, simulate  # noqa: E402
from pdserve.sim.main import gpu_step_model  # noqa: E402
from pdserve_core.config import AutoscaleConfig, PlacementConfig  # noqa: E402
from pdserve_core.roofline.specs import PRESETS  # noqa: E402

SLO = (1.0, 0.05)
PHASES = (("chat", 0.0, 256, 400, 150.0), ("long prompts", 60.0, 2000, 8, 50.0))
"""(name, start s, prompt tokens, output tokens, requests/s)"""
PHASE_S = 60.0


def requests() -> list[SimRequest]:
    out = []
    for _, start, prompt, output, rate in PHASES:
        count = int(rate * PHASE_S)
        out += [SimRequest(len(out) + i, start + i / rate, prompt, output) for i in range(count)]
    return out


def run(prefill: int, decode: int, autoscale: AutoscaleConfig | None) -> dict:
    node = NodeSpec(gpu_step_model("h100-sxm"), 256, 2048)
    topology = Topology(
        PRESETS["llama-3-8b"],
        prefill=[node] * prefill,
        decode=[node] * decode,
        link_bytes_per_s=50e9,
        link_latency_s=0.001,
        placement=PlacementConfig(mode="remote"),
        autoscale=autoscale,
        tpot_target_s=SLO[1],
    )
    result = simulate(topology, requests(), keep_tokens=False)
    phases = {}
    for name, start, *_ in PHASES:
        mine = [r for r in result.records if start <= r.sent_s < start + PHASE_S]
        met = sum(
            1 for r in mine if r.ok and r.ttft <= SLO[0] and (r.tpot is None or r.tpot <= SLO[1])
        )
        phases[name] = {
            "attainment": met / len(mine),
            "ttft_p90_s": percentile([r.ttft for r in mine if r.ttft is not None], 90),
            "tpot_p90_s": percentile([r.tpot for r in mine if r.tpot is not None], 90),
        }
    return {"phases": phases, "moves": result.moves}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/plan/autoscale")
    args = parser.parse_args()
    policy = AutoscaleConfig(enabled=True, interval_s=5, cooldown_s=10, reversal_s=30)
    runs = {
        "fixed 2P6D": run(2, 6, None),
        "fixed 4P4D": run(4, 4, None),
        "fixed 6P2D": run(6, 2, None),
        "autoscaled from 6P2D": run(6, 2, policy),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "slo": SLO,
        "phases": PHASES,
        "policy": policy.__dict__,
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# Pools that follow the balance (simulated)",
        "",
        f"{results['date']}; `python benchmarks/autoscale_sim.py`. 8 H100s, LLaMA-3 8B (assumed "
        "step model): 0-60 s prompts 256 → 400 tokens at 150 req/s, 60-120 s prompts 2000 → 8 "
        f"tokens at 50 req/s. SLO TTFT ≤ {SLO[0]:g} s, TPOT ≤ {SLO[1] * 1e3:.0f} ms. "
        f"Autoscaler: check every {policy.interval_s:g} s, cool-down {policy.cooldown_s:g} s, "
        f"a reversal waits {policy.reversal_s:g} s, move at prefill ÷ decode pressure beyond "
        f"{policy.high:g}×.",
        "",
        "| run | chat: SLO met | TTFT p90 | TPOT p90 | long prompts: SLO met | TTFT p90 | "
        "TPOT p90 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        cells = []
        for phase in (p[0] for p in PHASES):
            f = r["phases"][phase]
            cells += [
                f"{f['attainment']:.0%}",
                f"{f['ttft_p90_s'] * 1e3:.0f} ms",
                f"{f['tpot_p90_s'] * 1e3:.1f} ms" if f["tpot_p90_s"] is not None else "–",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Moves of the autoscaled run:", ""]
    for move in runs["autoscaled from 6P2D"]["moves"]:
        lines.append(
            f"- {move['at_s']:.0f} s: {move['engine']} {move['action']} (prefill ÷ decode "
            f"{move['ratio']:.1f}) → {move['prefill']}P{move['decode']}D"
        )
    text = "\n".join(lines) + "\n"
    (out / "README.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
