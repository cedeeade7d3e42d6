"""The roofline against a real device: achieved FLOP/s and bytes/s of the shapes pdserve runs.

For a model's MLP projection (LLaMA-3 8B's gate_proj by default: 4096 × 14336, bf16) it times
y = x·Wᵀ at growing token counts T — decode-shaped (T = batch, 1..256: a GEMV that streams the
weights) and prefill-shaped (T = 512..16384: a GEMM) — and reports for each the arithmetic
intensity (2·T / dtype bytes), the planner's roofline time max(FLOPs ÷ peak, bytes ÷ bandwidth),
the measured time, the achieved TFLOP/s and TB/s and their share of the datasheet peaks, and the
ridge point the measurements put in evidence. With a GPU it also samples NVML (pdserve's
`GpuSampler`) during the runs. These achieved fractions are what `pdserve.sim.main.ASSUMED_GPU`
stands in for until measured. Runs on a CPU too (a smoke test of the script; the figures are the
core's).

    python benchmarks/gpu_roofline.py --device h200 --out results/plan/gpu [--model llama-3-8b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve_core.roofline.specs import DEVICES, PRESETS  # noqa: E402

DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 1024, 2048, 4096, 8192, 16384)


def time_matmul(torch, x, w, repeats: int, sync) -> float:
    """Median seconds of x @ w.T over `repeats` runs (after warm-up)."""
    for _ in range(3):
        torch.matmul(x, w.t())
    sync()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.matmul(x, w.t())
        sync()
        runs.append(time.perf_counter() - started)
    runs.sort()
    return runs[len(runs) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="h200", help="catalog entry for the peaks")
    parser.add_argument("--model", default="llama-3-8b", choices=list(PRESETS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--out", default="results/plan/gpu")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spec, m = DEVICES[args.device], PRESETS[args.model]
    d_in, d_out = m.hidden_size, m.intermediate_size
    w = torch.randn(d_out, d_in, dtype=torch.bfloat16, device=dev)
    sampler = None
    if cuda:
        from pdserve_core.engine.stats import GpuSampler
        from pdserve_core.engine.types import NodeStats

        sampler, nvml = GpuSampler.create(), NodeStats()
    rows = []
    for tokens in [t for t in (*DECODE_TOKENS, *PREFILL_TOKENS) if t <= args.max_tokens]:
        x = torch.randn(tokens, d_in, dtype=torch.bfloat16, device=dev)
        seconds = time_matmul(torch, x, w, args.repeats, sync)
        flops = 2.0 * tokens * d_in * d_out
        moved = 2.0 * (d_in * d_out + tokens * (d_in + d_out))  # weights + activations in/out
        roof = max(flops / spec.peak_flops, moved / spec.mem_bandwidth)
        row = {
            "tokens": tokens,
            "phase": "decode" if tokens in DECODE_TOKENS else "prefill",
            "intensity": flops / moved,
            "seconds": seconds,
            "roofline_seconds": roof,
            "achieved_tflops": flops / seconds / 1e12,
            "achieved_tbs": moved / seconds / 1e12,
            "flops_share": flops / seconds / spec.peak_flops,
            "bandwidth_share": moved / seconds / spec.mem_bandwidth,
        }
        if sampler is not None:
            sampler.sample(nvml)
            row["nvml_sm"], row["nvml_memory"] = (
                nvml.gpu_sm_utilization,
                nvml.gpu_memory_utilization,
            )
        rows.append(row)
        print(
            f"T={tokens:>6} AI {row['intensity']:8.1f}  {seconds * 1e6:9.1f} us "
            f"(roofline {roof * 1e6:8.1f})  {row['achieved_tflops']:7.1f} TFLOP/s "
            f"({row['flops_share']:.0%})  {row['achieved_tbs']:6.2f} TB/s "
            f"({row['bandwidth_share']:.0%})"
        )
    decode = [r for r in rows if r["phase"] == "decode"]
    prefill = [r for r in rows if r["phase"] == "prefill"]
    best_bw = max(r["achieved_tbs"] for r in decode) * 1e12
    best_flops = max((r["achieved_tflops"] for r in prefill), default=0.0) * 1e12
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "catalog": args.device,
        "model": args.model,
        "layer": f"gate_proj {d_in}x{d_out} bf16",
        "rows": rows,
        "achieved": {
            "bandwidth": best_bw,
            "flops": best_flops,
            "bandwidth_share": best_bw / spec.mem_bandwidth,
            "flops_share": best_flops / spec.peak_flops,
            "ridge_measured": best_flops / best_bw if best_bw else None,
            "ridge_datasheet": spec.peak_flops / spec.mem_bandwidth,
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["achieved"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
