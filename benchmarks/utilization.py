"""Each node's compute and bandwidth utilization under load, as the router's /metrics reports it,
sampled once a second: what docs/metrics.md quotes, on the host kind it runs on.

    python benchmarks/utilization.py [--layouts split colocated] [--points steady@1 steady@4
        interference@1 streams@8] [--duration-s 30] [--out DIR]

For each layout (`split`: the default 1P1D, one thread per engine; `colocated`:
deploy/config/local-cpu-colocated.yaml, one engine on both cores) one `pdserve serve` in the
host's native dtype (bfloat16 where the CPU has bf16 instructions, float32 where not; under
scripts/as_avx2_host.sh, float32), sent each point in turn: `steady@R` 128 → 64-token requests at
R a second (Poisson), `interference@R` the same plus a 1536 → 16 prompt every 10 s, `streams@N`
N closed-loop streams of 128 → 64 (the engines saturated). While a point runs, /metrics is read
every second; per node the report gives the utilizations' median and maximum over those reads
(each a 15 s window of the router's), the peaks and where they came from, and from the counters'
difference over the point: the share of time the engine stepped, the FLOP/s and bytes/s it
achieved while stepping as shares of its peaks, and the arithmetic intensity. Every read must lie
in [0, 1]; the script says which did not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench import compare
from pdserve.bench.client import run_load, served_model
from pdserve.bench.workload import Workload, build_requests
from pdserve_core.engine.dtype import bf16_flags, native_dtype

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"split": None, "colocated": REPO / "deploy/config/local-cpu-colocated.yaml"}
RATIOS = {
    "pdserve_node_compute_utilization_ratio": "compute",
    "pdserve_node_bandwidth_utilization_ratio": "bandwidth",
}
COUNTERS = {
    "pdserve_node_estimated_flops_total": "flops",
    "pdserve_node_estimated_memory_bytes_total": "bytes",
    "pdserve_node_busy_seconds_total": "busy_s",
}
PEAKS = {
    "pdserve_node_peak_flops_per_second": "peak_flops",
    "pdserve_node_peak_memory_bandwidth_bytes_per_second": "peak_bytes_per_s",
}


def scrape(url: str) -> dict[str, dict]:
    """Per node ("pool/node"): the ratios, counters and peaks of one read of /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    nodes: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = RATIOS.get(sample.name) or COUNTERS.get(sample.name) or PEAKS.get(sample.name)
            if name is None:
                continue
            node = nodes.setdefault(f"{sample.labels['pool']}/{sample.labels['node']}", {})
            node[name] = sample.value
            if sample.name in PEAKS:
                node["peak_source"] = sample.labels.get("source")
    return nodes


class Sampler:
    """Reads /metrics every `period_s` in a thread of its own until stopped."""

    def __init__(self, url: str, period_s: float = 1.0) -> None:
        self.url, self.period_s = url, period_s
        self.reads: list[dict[str, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="utilization-sampler")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.reads.append(scrape(self.url))
            except httpx.HTTPError as error:  # a read lost to a busy host is a gap, not a fault
                print(f"  /metrics read failed: {error!r}", flush=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def requests_for(point: str, duration_s: float, seed: int):
    """The point's requests and how many streams send them (None: at their times)."""
    kind, _, value = point.partition("@")
    if kind == "streams":
        streams = int(value)
        count = streams * max(4, int(duration_s))  # more than the duration lets them finish
        return build_requests(Workload("fixed"), count, "concurrency", 1.0, seed), streams
    rate = float(value)
    workload = Workload("interference" if kind == "interference" else "fixed")
    if kind not in ("steady", "interference"):
        raise SystemExit(f"unknown point {point!r}: steady@RATE, interference@RATE, streams@N")
    return build_requests(workload, int(rate * duration_s) + 1, "poisson", rate, seed), None


def summarize_point(before: dict, after: dict, reads: list[dict], seconds: float) -> dict:
    out = {}
    for node, last in after.items():
        first = before.get(node, {})
        delta = {k: last.get(k, 0.0) - first.get(k, 0.0) for k in COUNTERS.values()}
        busy = delta["busy_s"]
        figures: dict = {
            "peak_flops": last.get("peak_flops"),
            "peak_bytes_per_s": last.get("peak_bytes_per_s"),
            "peak_source": last.get("peak_source"),
            "peaks_raised": (
                first.get("peak_flops") is not None
                and (
                    last.get("peak_flops") != first.get("peak_flops")
                    or last.get("peak_bytes_per_s") != first.get("peak_bytes_per_s")
                )
            ),
            "busy_share": busy / seconds,
            "intensity_flops_per_byte": delta["flops"] / delta["bytes"] if delta["bytes"] else None,
        }
        if busy > 0 and last.get("peak_flops"):
            figures["compute_while_busy"] = delta["flops"] / busy / last["peak_flops"]
            figures["bandwidth_while_busy"] = delta["bytes"] / busy / last["peak_bytes_per_s"]
        for ratio in RATIOS.values():
            values = [read[node][ratio] for read in reads if ratio in read.get(node, {})]
            figures[ratio] = {
                "reads": len(values),
                "p50": statistics.median(values) if values else None,
                "max": max(values) if values else None,
                "outside_0_1": [v for v in values if not 0.0 <= v <= 1.0],
            }
        out[node] = figures
    return out


async def _load(url: str, point: str, duration_s: float, seed: int) -> dict:
    model = await served_model(url)
    requests, streams = requests_for(point, duration_s, seed)
    records, _ = await run_load(url, requests, model, streams, duration_s if streams else None)
    return {"requests": len(records), "errors": sum(1 for r in records if not r.ok)}


def measure(url: str, points: list[str], duration_s: float) -> dict:
    asyncio.run(_load(url, "streams@2", 4, 99))  # warm-up: both engines have stepped
    results = {}
    for seed, point in enumerate(points):
        before, started = scrape(url), time.monotonic()
        with Sampler(url) as sampler:
            sent = asyncio.run(_load(url, point, duration_s, seed))
        seconds = time.monotonic() - started
        results[point] = {
            **sent,
            "seconds": seconds,
            "nodes": summarize_point(before, scrape(url), sampler.reads, seconds),
        }
        print(point, json.dumps(results[point]), flush=True)
    return results


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def table(results: dict) -> str:
    lines = [
        f"CPU bf16 flags: {' '.join(results['bf16_flags']) or 'none'}; engines' dtype (native): "
        f"{results['native']}",
        "",
        "| layout | point | node | peak GFLOP/s, GB/s (source) | busy | compute p50 / max | "
        "bandwidth p50 / max | compute while busy | bandwidth while busy | FLOP/byte |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    outside = []
    for layout, points in results["layouts"].items():
        for point, result in points.items():
            for node, f in result["nodes"].items():
                c, b = f["compute"], f["bandwidth"]
                outside += [(layout, point, node, v) for v in c["outside_0_1"] + b["outside_0_1"]]
                peaks = "–"
                if f["peak_flops"]:
                    peaks = (
                        f"{f['peak_flops'] / 1e9:.0f}, {f['peak_bytes_per_s'] / 1e9:.1f} "
                        f"({f['peak_source']}{', raised' if f['peaks_raised'] else ''})"
                    )
                intensity = f["intensity_flops_per_byte"]
                lines.append(
                    f"| {layout} | {point} | {node} | {peaks} | {_pct(f['busy_share'])} | "
                    f"{_pct(c['p50'])} / {_pct(c['max'])} | {_pct(b['p50'])} / {_pct(b['max'])} | "
                    f"{_pct(f.get('compute_while_busy'))} | "
                    f"{_pct(f.get('bandwidth_while_busy'))} | "
                    f"{'–' if intensity is None else f'{intensity:.1f}'} |"
                )
    reads = sum(
        f[ratio]["reads"]
        for points in results["layouts"].values()
        for result in points.values()
        for f in result["nodes"].values()
        for ratio in RATIOS.values()
    )
    lines += [
        "",
        f"{reads} utilization reads; outside [0, 1]: "
        + (", ".join(f"{la} {p} {n}: {v:.3f}" for la, p, n, v in outside) if outside else "none"),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument(
        "--points",
        nargs="+",
        default=["steady@1", "steady@4", "interference@1", "streams@8"],
        help="steady@RATE, interference@RATE (requests/s) or streams@N (closed loop)",
    )
    parser.add_argument("--duration-s", type=float, default=30.0, help="of each point's arrivals")
    parser.add_argument("--out", type=Path, default=Path("results/bench/utilization"))
    args = parser.parse_args()
    for point in args.points:
        requests_for(point, 1, 0)  # a bad point fails before any server starts
    results = {
        "bf16_flags": sorted(bf16_flags()),
        "native": native_dtype(gpu=False),
        "points": args.points,
        "duration_s": args.duration_s,
        "layouts": {},
    }
    for layout in args.layouts:
        work = compare.scratch(args.out, f"utilization-{layout}")
        with compare.pdserve_server(LAYOUTS[layout], work) as url:
            results["layouts"][layout] = measure(url, args.points, args.duration_s)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
