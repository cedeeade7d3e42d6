"""bf16 against float32 on this host's CPU, with plain vLLM's OpenAI server (what `engine.dtype:
native` decides between: pdserve_core/engine/dtype.py).

    python benchmarks/cpu_dtype.py [--rounds 1] [--dtypes bfloat16 float32] [--out DIR]

Each dtype in turn (bf16 first, then float32, `--rounds` times in alternation), one server with
two threads on cores 0-1, sent: three 512-token prompts one at a time with one output token
(prefill time), then closed loops of 128 → 64-token streams, 1 and 4 at a time (TTFT, ITL).
Prints, and writes to DIR/results.json and DIR/results.md, each figure and float32 ÷ bf16 (when
both ran), with the CPU's bf16 flags and the dtype `native` picks here. `--dtypes float32` alone
compares hosts: under scripts/as_avx2_host.sh, bf16 falls to a kernel far slower than a real
AVX2-only CPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from pdserve.bench import compare
from pdserve.bench.client import run_load, served_model
from pdserve.bench.stats import summarize
from pdserve.bench.workload import RequestSpec, Workload, build_requests
from pdserve_core.engine.dtype import bf16_flags, native_dtype

DTYPES = ("bfloat16", "float32")


def specs(prompt: int, output: int, count: int, seed: int) -> list[RequestSpec]:
    built = build_requests(Workload("fixed", prompt, output), count, "fixed", 1.0, seed)
    return [RequestSpec(s.index, s.prompt_token_ids, s.max_tokens) for s in built]


async def measure(url: str, per_stream: int) -> dict:
    model = await served_model(url)
    await run_load(url, specs(128, 8, 2, 3), model, concurrency=1)  # warm-up
    prefill = []
    for spec in specs(512, 1, 3, 5):
        started = time.monotonic()
        records, _ = await run_load(url, [spec], model, concurrency=1)
        assert records[0].ok, records[0].error
        prefill.append(time.monotonic() - started)
    out = {"prefill_512_s": statistics.median(prefill)}
    for streams in (1, 4):
        load = specs(128, 64, per_stream * streams, 7)
        records, duration = await run_load(url, load, model, streams)
        summary = summarize(records, duration, 1e9, 1e9)
        out[f"{streams}"] = {
            "ttft_p50_s": summary["ttft_s"]["p50"],
            "itl_p50_s": summary["itl_s"]["p50"],
            "output_tokens_per_s": summary["output_tokens_per_s"],
            "errors": summary["errors"],
        }
    return out


def table(results: dict) -> str:
    rounds = results["rounds"]
    rows = [("prefill, 512 tokens (s)", ("prefill_512_s",))]
    for streams in ("1", "4"):
        rows += [
            (f"TTFT p50, {streams} stream(s) (s)", (streams, "ttft_p50_s")),
            (f"ITL p50, {streams} stream(s) (s)", (streams, "itl_p50_s")),
            (f"output tokens/s, {streams} stream(s)", (streams, "output_tokens_per_s")),
        ]
    dtypes = results.get("dtypes", DTYPES)
    both = tuple(dtypes) == DTYPES
    heads = [f"{d} (round {i + 1})" for i in range(len(rounds)) for d in dtypes]
    lines = [
        f"CPU bf16 flags: {results['bf16_flags'] or 'none'}; `native` here: {results['native']}",
        "",
        "| figure | " + " | ".join(heads) + (" | float32 ÷ bf16 (mean) |" if both else " |"),
        "|---|" + "---|" * (len(heads) + both),
    ]
    for label, path in rows:
        cells, ratios = [], []
        for round_ in rounds:
            values = []
            for dtype in dtypes:
                value = round_[dtype]
                for key in path:
                    value = value[key]
                values.append(value)
                cells.append(f"{value:.3f}")
            if both:
                ratios.append(values[1] / values[0])
        ratio = f" {statistics.mean(ratios):.2f} |" if both else ""
        lines.append(f"| {label} | " + " | ".join(cells) + " |" + ratio)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--per-stream", type=int, default=4)
    parser.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="in this order"
    )
    parser.add_argument("--out", type=Path, default=Path("results/bench/cpu-dtype"))
    args = parser.parse_args()
    from pdserve_core.model_prep import prepare_default_model

    model_dir = Path(prepare_default_model())
    results = {
        "bf16_flags": sorted(bf16_flags()),
        "native": native_dtype(gpu=False),
        "dtypes": args.dtypes,
        "rounds": [],
    }
    for _ in range(args.rounds):
        round_ = {}
        for dtype in args.dtypes:
            work = compare.scratch(args.out, f"vllm-{dtype}")
            with compare.plain_vllm_server(model_dir, model_dir.name, work, dtype=dtype) as url:
                round_[dtype] = asyncio.run(measure(url, args.per_stream))
            print(dtype, json.dumps(round_[dtype]), flush=True)
        results["rounds"].append(round_)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
