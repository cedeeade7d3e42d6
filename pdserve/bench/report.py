"""Writes a benchmark's results: `results.json`, `results.md` (tables), and PNG plots (latency
CDFs; inter-token latency over time with the long-prompt arrivals marked)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.stats import RequestRecord

ROWS = (
    ("request_throughput", "requests/s", 1),
    ("output_tokens_per_s", "output tokens/s", 1),
    ("goodput", "goodput (requests/s within both SLOs)", 1),
    ("ttft_s.p50", "TTFT p50 (s)", 1),
    ("ttft_s.p90", "TTFT p90 (s)", 1),
    ("ttft_s.p99", "TTFT p99 (s)", 1),
    ("itl_s.p50", "inter-token latency p50 (s)", 1),
    ("itl_s.p90", "inter-token latency p90 (s)", 1),
    ("itl_s.p99", "inter-token latency p99 (s)", 1),
    ("itl_s.max", "inter-token latency max (s)", 1),
    ("tpot_s.p50", "TPOT p50 (s)", 1),
    ("tpot_s.p99", "TPOT p99 (s)", 1),
    ("e2e_s.p50", "end-to-end p50 (s)", 1),
    ("e2e_s.p99", "end-to-end p99 (s)", 1),
    ("long_prompt_ttft_s.p50", "long-prompt TTFT p50 (s)", 1),
    ("completed", "requests completed", 1),
    ("errors", "errors", 1),
)


def lookup(summary: dict, path: str):
    value = summary
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


def markdown_table(summaries: dict[str, dict]) -> str:
    """Runs side by side; with exactly two runs, a ratio column (first ÷ second)."""
    names = list(summaries)
    header = ["metric", *names] + (["ratio"] if len(names) == 2 else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path, label, _ in ROWS:
        values = [lookup(summaries[name], path) for name in names]
        if all(v is None for v in values):
            continue
        cells = [label, *(_fmt(v) for v in values)]
        if len(names) == 2:
            a, b = values
            cells.append(f"{a / b:.2f}×" if a is not None and b else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_json(out: Path, results: dict, records: dict[str, Sequence[RequestRecord]]) -> None:
    """results.json (settings and figures) and records.jsonl (one request per line, with
    `run`: every token's arrival time, to recompute any figure later)."""
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        json.dumps({"run": name, **asdict(record)}, separators=(",", ":"))
        for name, runs in records.items()
        for record in runs
    ]
    (out / "records.jsonl").write_text("\n".join(lines) + "\n")


def read_records(path: Path) -> dict[str, list[RequestRecord]]:
    """records.jsonl (or records.jsonl.xz) → run name → records."""
    path = Path(path)
    if path.suffix == ".xz":
        import lzma

        text = lzma.decompress(path.read_bytes()).decode()
    else:
        text = path.read_text()
    records: dict[str, list[RequestRecord]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        try:
            data = json.loads(line)
            records.setdefault(data.pop("run"), []).append(RequestRecord(**data))
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"{path}:{number}: not a bench record ({error})") from None
    return records


def measured_workload(path: str | Path, run: str | None = None) -> dict:
    """What a bench record says about its traffic: arrival rate (requests over the span of send
    times) and mean prompt and output lengths; `run`: one run of the file (default: all)."""
    runs = read_records(Path(path))
    if run is not None:
        if run not in runs:
            raise ValueError(f"no run {run!r} in {path}; runs: {', '.join(runs)}")
        runs = {run: runs[run]}
    rates, prompts, outputs = [], [], []
    for records in runs.values():
        sent = sorted(r.sent_s for r in records)
        if len(sent) >= 2 and sent[-1] > sent[0]:
            rates.append((len(sent) - 1) / (sent[-1] - sent[0]))
        prompts += [r.prompt_tokens for r in records]
        outputs += [r.output_tokens for r in records if r.ok]
    if not rates or not outputs:
        raise ValueError(f"{path}: too few completed requests to measure a workload")
    return {
        "requests": len(prompts),
        "rate": sum(rates) / len(rates),
        "prompt_len": max(1, round(sum(prompts) / len(prompts))),
        "output_len": max(1, round(sum(outputs) / len(outputs))),
    }


def plot(out: Path, records: dict[str, Sequence[RequestRecord]]) -> list[Path]:
    """latency_cdf.png and itl_over_time.png for one or more runs; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, runs in records.items():
        steady = [r for r in runs if r.ok and r.kind == "steady"]
        series = {
            "time to first token (s)": [r.ttft for r in steady if r.ttft is not None],
            "inter-token latency (s)": [g for r in steady for _, g in r.itls()],
            "end-to-end latency (s)": [r.e2e for r in steady if r.e2e is not None],
        }
        for ax, (label, values) in zip(axes, series.items(), strict=True):
            values = sorted(values)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=name)
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests" if "inter" not in label else "fraction of tokens")
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle("Latency CDFs (steady requests)")
    fig.tight_layout()
    written.append(out / "latency_cdf.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(
        len(records), 1, figsize=(12, 3.2 * len(records)), squeeze=False, sharey=True
    )
    for ax, (name, runs) in zip(axes[:, 0], records.items(), strict=True):
        points = [(t, g) for r in runs if r.ok and r.kind == "steady" for t, g in r.itls()]
        if points:
            ax.scatter([t for t, _ in points], [g for _, g in points], s=3, alpha=0.5)
        for i, r in enumerate(r for r in runs if r.kind == "long"):
            ax.axvline(
                r.sent_s, color="red", alpha=0.6, label="long prompt sent" if i == 0 else None
            )
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_ylabel("inter-token latency (s)")
        ax.grid(True, alpha=0.3)
        if any(r.kind == "long" for r in runs):
            ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("time since the start of the run (s)")
    fig.tight_layout()
    written.append(out / "itl_over_time.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
