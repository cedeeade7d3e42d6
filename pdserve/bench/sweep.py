"""`pdserve bench sweep`: a request-rate sweep of several systems on the same cores, judged by SLO
attainment (DistServe's measure: the highest rate at which ≥ 90 % of requests meet their SLO).

Systems (each started fresh, one after the other, on the same two cores):
- `adaptive`: pdserve 1P1D, each prompt placed by the adaptive rule (router/decides/placement.py);
- `remote`: pdserve 1P1D, every prompt on the prefill node (pdserve 0.2's behaviour);
- `colocated`: pdserve with one engine on both cores;
- `vllm`: plain vLLM's OpenAI server with the colocated engine's settings on both cores (what a
  user would run instead).
Mixes: `interference` (64→128 at the swept rate, plus a 1536→16 prompt every 10 s) and `steady`
(128→64 at the swept rate). Each point sends Poisson arrivals for `duration_s` and waits for what
is in flight; the same requests (same seed) go to every system.

Two SLOs, per steady request (the interference mix's long prompts are the disturbance, not
judged): **DistServe** — TTFT ≤ 1 s and TPOT ≤ 80 ms; **smooth streaming** — TTFT ≤ 1 s and no
gap between two streamed chunks above 250 ms (what a reader notices). A request that failed
misses both.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdserve.bench.stats import RequestRecord, distribution, summarize
from pdserve.bench.workload import Workload, build_requests

logger = logging.getLogger(__name__)

SYSTEMS = ("adaptive", "blind", "remote", "colocated", "vllm")
MIXES = {
    "interference": Workload("interference", 64, 128, long_prompt_len=1536, long_output_len=16),
    "steady": Workload("fixed", 128, 64),
}
MIX_SLO = {"steady": "DistServe", "interference": "smooth"}
"""The SLO each mix is judged by first (docs/benchmarks.md)."""
ATTAINMENT_GOAL = 0.9
READINGS = ("strict", "lenient")


@dataclass(frozen=True)
class Slo:
    name: str
    ttft_s: float
    tpot_s: float | None = None
    max_gap_s: float | None = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft is None or record.ttft > self.ttft_s:
            return False
        if self.tpot_s is not None and record.tpot is not None and record.tpot > self.tpot_s:
            return False
        if self.max_gap_s is not None and max_gap(record) > self.max_gap_s:
            return False
        return True


SLOS = {
    "DistServe": Slo("DistServe", 1.0, tpot_s=0.08),
    "smooth": Slo("smooth", 1.0, max_gap_s=0.25),
}
"""The sweep's two SLOs at their default bounds (its flags change them)."""


def max_gap(record: RequestRecord) -> float:
    """The longest wait between two streamed chunks of a request (0 with fewer than two)."""
    times = record.token_times_s
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def attainment(records: Sequence[RequestRecord], slo: Slo) -> float | None:
    """Share of the steady requests sent that met `slo`."""
    steady = [r for r in records if r.kind == "steady"]
    return sum(slo.met(r) for r in steady) / len(steady) if steady else None


def highest_rate(
    points: Sequence[tuple[float, float]], goal: float = ATTAINMENT_GOAL, reading: str = "strict"
) -> dict:
    """The highest rate at which attainment stays ≥ `goal`, from (rate, attainment) points,
    interpolated linearly to where it crosses the goal. Two readings, which differ only where
    attainment dips below the goal and comes back at a higher rate:

    - "strict" (DistServe's): up to the first crossing: the last rate before attainment first
      falls below the goal;
    - "lenient": up to the last crossing: the highest rate tried whose attainment is ≥ the goal.

    `bound` says whether the figure is exact ("="), below the lowest rate tried ("<"), or at
    least the highest ("≥")."""
    if reading not in READINGS:
        raise ValueError(f"reading must be one of {READINGS}, not {reading!r}")
    points = sorted(points)
    if not points:
        return {"rate": None, "bound": None}
    met = [index for index, (_, a) in enumerate(points) if a >= goal]
    if not met or (met[0] != 0 and reading == "strict"):
        return {"rate": points[0][0], "bound": "<"}
    if reading == "strict":
        last = next((i - 1 for i in range(len(points)) if points[i][1] < goal), len(points) - 1)
    else:
        last = met[-1]
    if last == len(points) - 1:
        return {"rate": points[-1][0], "bound": "≥"}
    (r0, a0), (r1, a1) = points[last], points[last + 1]
    rate = r0 + (r1 - r0) * (a0 - goal) / (a0 - a1) if a0 != a1 else r0
    return {"rate": rate, "bound": "="}


def point_summary(records: Sequence[RequestRecord], duration_s: float, slos: Sequence[Slo]) -> dict:
    """One (system, mix, rate) point: attainment under each SLO, goodput and the latencies."""
    first = slos[0]
    summary = summarize(records, duration_s, first.ttft_s, first.tpot_s or math.inf)
    steady = [r for r in records if r.kind == "steady" and r.ok]
    summary["max_gap_s"] = distribution([max_gap(r) for r in steady])
    summary["attainment"] = {slo.name: attainment(records, slo) for slo in slos}
    summary["goodput_by_slo"] = {
        slo.name: sum(slo.met(r) for r in records if r.kind == "steady") / duration_s
        for slo in slos
    }
    return summary


def headline(results: dict, slos: Sequence[Slo]) -> dict:
    """Per mix and SLO: each system's highest rate at ≥ 90 % attainment, in both readings
    ({"strict": …, "lenient": …}, see `highest_rate`)."""
    out: dict = {}
    for mix, systems in results["points"].items():
        for slo in slos:
            row = out.setdefault(mix, {}).setdefault(slo.name, {})
            for system, points in systems.items():
                pairs = [
                    (float(rate), p["attainment"][slo.name])
                    for rate, p in points.items()
                    if p["attainment"][slo.name] is not None
                ]
                row[system] = {how: highest_rate(pairs, reading=how) for how in READINGS}
    return out


def apply_overrides(data: dict, overrides: Sequence[str]) -> None:
    """Set each "dotted.key=YAML value" of `overrides` in the config `data`."""
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise ValueError(f"--set wants KEY=VALUE, not {override!r}")
        *parents, leaf = key.split(".")
        target = data
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ValueError(f"--set {key}: {part} is not a section")
        target[leaf] = yaml.safe_load(value)


def engines_dtype(repo: Path, overrides: Sequence[str] = ()) -> str:
    """The dtype every system's engines run on this host (plain vLLM is given the same): the
    repo's config with `overrides` applied, `native` resolved for this CPU."""
    from pdserve_core.config import parse_config
    from pdserve_core.engine.dtype import resolve

    data = yaml.safe_load((repo / "deploy/config/local-cpu.yaml").read_text())
    apply_overrides(data, overrides)
    return resolve(parse_config(data).engine.dtype, gpu=False)


def config_data(system: str, repo: Path, overrides: Sequence[str] = ()) -> dict:
    """The config a pdserve system serves with, as YAML data: the repo's, with the placement mode
    set and `overrides` ("dotted.key=YAML value") applied. `blind` is `adaptive` without
    prefix-aware routing."""
    name = "local-cpu-colocated.yaml" if system == "colocated" else "local-cpu.yaml"
    data = yaml.safe_load((repo / "deploy/config" / name).read_text())
    if system != "colocated":
        router = data.setdefault("router", {})
        router["placement"] = {"mode": "adaptive" if system == "blind" else system}
        if system == "blind":
            router["prefix_aware"] = False
    apply_overrides(data, overrides)
    return data


def describe_layout(system: str, repo: Path, overrides: Sequence[str] = ()) -> str:
    """Where a pdserve system's engines run, read from the config it serves with (so a `--set`
    that moves them is reported as run): "prefill engine on cores 0-1, 2 threads + ..."."""
    from pdserve_core.config import engine_threads, parse_config

    config = parse_config(config_data(system, repo, overrides))
    pools = ("colocated",) if config.mode == "colocated" else ("prefill", "decode")
    parts = []
    for role in pools:
        pool = getattr(config.pools, role)
        threads = engine_threads(config.engine, pool)
        binds = list(dict.fromkeys(pool.cpu_bind))
        several = len(binds) > 1 or any(mark in b for b in binds for mark in "-,")
        where = f"on core{'s' * several} {' / '.join(binds)}" if binds else "unbound"
        count = f"{pool.replicas}× " if pool.replicas != 1 else ""
        name = "one engine" if role == "colocated" else f"{role} engine"
        parts.append(f"{count}{name} {where}, {threads} thread{'s' * (threads != 1)}")
    return " + ".join(parts)


def pdserve_config(system: str, repo: Path, work: Path, overrides: Sequence[str] = ()) -> Path:
    """The config file a pdserve system serves with (`config_data`), written into `work`."""
    data = config_data(system, repo, overrides)
    path = work / f"{system}.yaml"
    path.write_text(yaml.safe_dump(data))
    from pdserve_core.config import load_config

    load_config(path)  # a bad override fails here, naming the field
    return path


def placement_snapshot(text: str) -> dict:
    """From a pdserve router's /metrics text: placement decisions and the hand-over gap's
    cumulative histogram buckets."""
    from prometheus_client.parser import text_string_to_metric_families

    placements: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve_prefill_placements_total":
                placements[f"{s.labels['where']}/{s.labels['reason']}"] = s.value
            elif s.name == "pdserve_handover_gap_seconds_bucket":
                buckets[float(s.labels["le"])] = s.value
    return {"placements": placements, "buckets": buckets}


def placement_figures(after: str, before: str | None = None) -> dict:
    """Placement decisions and the hand-over gap's count and p50 / p99 (interpolated within the
    histogram's buckets) between two /metrics texts (or since the start)."""
    now = placement_snapshot(after)
    then = placement_snapshot(before) if before else {"placements": {}, "buckets": {}}
    placements = {
        key: value - then["placements"].get(key, 0.0) for key, value in now["placements"].items()
    }
    buckets = sorted(
        (bound, count - then["buckets"].get(bound, 0.0)) for bound, count in now["buckets"].items()
    )
    return {
        "placements": placements,
        "handover_gaps": buckets[-1][1] if buckets else 0.0,
        "handover_gap_p50_s": bucket_quantile(buckets, 0.5),
        "handover_gap_p99_s": bucket_quantile(buckets, 0.99),
    }


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def run_points(
    url: str,
    mix: str,
    rates: Sequence[float],
    args,
    records: dict,
    points: dict,
    disaggregated: bool = False,
) -> None:
    """Every rate of one mix against one running system (after an unrecorded warm-up); for
    pdserve 1P1D, each point's placements and hand-over gaps from the router's /metrics."""
    import httpx

    from pdserve.bench.client import run_load, served_model

    def metrics() -> str | None:
        return httpx.get(f"{url}/metrics", timeout=10).text if disaggregated else None

    workload = MIXES[mix]
    model = asyncio.run(served_model(url))
    if args.warmup_requests:
        warm = build_requests(workload, args.warmup_requests, "poisson", rates[0], args.seed + 1)
        asyncio.run(run_load(url, warm, model, timeout_s=args.timeout_s))
    for rate in rates:
        count = max(1, math.ceil(rate * args.duration_s))
        requests = build_requests(workload, count, "poisson", rate, seed=args.seed)
        logger.info("%s at %.2f req/s: %d requests", mix, rate, len(requests))
        before = metrics()
        got, duration = asyncio.run(
            run_load(url, requests, model, None, args.duration_s, None, args.timeout_s)
        )
        records[str(rate)] = got
        points[str(rate)] = point_summary(got, duration, args.slos)
        if disaggregated:
            points[str(rate)]["placement"] = placement_figures(metrics(), before)


def text(results: dict, slos: Sequence[Slo]) -> str:
    """results.md: the headline, then per mix a table of attainment and latencies per rate."""
    systems = results["systems"]
    lines = [
        "# pdserve bench sweep",
        "",
        f"Machine: {results['machine']}. {results['duration_s']:.0f} s of Poisson arrivals per "
        f"point, the same requests for every system. SLOs: "
        + "; ".join(describe_slo(slo) for slo in slos)
        + ".",
        f"Systems: {results['fairness']}",
        "",
        "## Highest rate at ≥ 90 % SLO attainment (requests/s)",
        "",
        "Strict: up to where attainment first falls below 90 % (DistServe's reading); lenient: "
        "up to the highest rate still at ≥ 90 %. One figure where both agree.",
        "",
        "| mix | SLO | " + " | ".join(systems) + " |",
        "|---|---|" + "---|" * len(systems),
    ]
    for mix, by_slo in results["headline"].items():
        for slo_name, row in by_slo.items():
            cells = [_rate(row.get(s)) for s in systems]
            lines.append(f"| {mix} | {slo_name} | " + " | ".join(cells) + " |")
    lines.append("")
    for mix, by_system in results["points"].items():
        lines += [f"## {mix}", ""]
        header = ["system", "rate", *[f"{s.name} attainment" for s in slos]]
        header += ["TTFT p50", "TTFT p90", "ITL p50", "ITL p99", "max gap p99", "errors"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for system, points in by_system.items():
            for rate, p in points.items():
                cells = [system, rate]
                cells += [_pct(p["attainment"][s.name]) for s in slos]
                cells += [
                    _ms(p["ttft_s"]["p50"]),
                    _ms(p["ttft_s"]["p90"]),
                    _ms(p["itl_s"]["p50"]),
                    _ms(p["itl_s"]["p99"]),
                    _ms(p["max_gap_s"]["p99"]),
                    str(p["errors"]),
                ]
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    rows = [
        (mix, system, rate, p["placement"], p["itl_s"]["p50"])
        for mix, by_system in results["points"].items()
        for system, points in by_system.items()
        for rate, p in points.items()
        if p.get("placement")
    ]
    if rows:
        lines += ["## Placement and hand-over (pdserve 1P1D, per point)", ""]
        header = "| mix | system | rate | decisions | hand-overs | gap p50 | gap p99 | ITL p50 |"
        lines += [header, "|" + "---|" * 8]
        for mix, system, rate, fig, itl in rows:
            decisions = ", ".join(f"{k} {v:.0f}" for k, v in fig["placements"].items() if v)
            lines.append(
                f"| {mix} | {system} | {rate} | {decisions or '–'} | {fig['handover_gaps']:.0f} "
                f"| {_ms(fig['handover_gap_p50_s'])} | {_ms(fig['handover_gap_p99_s'])} "
                f"| {_ms(itl)} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def describe_slo(slo: Slo) -> str:
    """`DistServe (TTFT ≤ 1 s and TPOT ≤ 80 ms)`."""
    parts = [f"TTFT ≤ {slo.ttft_s:g} s"]
    if slo.tpot_s is not None:
        parts.append(f"TPOT ≤ {slo.tpot_s * 1e3:g} ms")
    if slo.max_gap_s is not None:
        parts.append(f"no gap > {slo.max_gap_s * 1e3:g} ms")
    return f"{slo.name} ({' and '.join(parts)})"


def _rate(cell: dict | None) -> str:
    """A headline cell: "2.12", or "2.12 (lenient 3.30)" where the readings differ."""
    if not cell:
        return "–"
    strict, lenient = _reading(cell.get("strict")), _reading(cell.get("lenient"))
    return strict if lenient == strict else f"{strict} (lenient {lenient})"


def _reading(value: dict | None) -> str:
    if not value or value["rate"] is None:
        return "–"
    return f"{'' if value['bound'] == '=' else value['bound'] + ' '}{value['rate']:.2f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.0f} %"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1e3:.0f} ms"


def plot(out: Path, results: dict, slos: Sequence[Slo]) -> Path:
    """attainment.png: attainment against rate, one panel per (mix, SLO), a line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(results["points"])
    fig, axes = plt.subplots(
        len(mixes), len(slos), figsize=(5.5 * len(slos), 3.8 * len(mixes)), squeeze=False
    )
    for row, mix in enumerate(mixes):
        for col, slo in enumerate(slos):
            ax = axes[row, col]
            for system, points in results["points"][mix].items():
                pairs = sorted((float(r), p["attainment"][slo.name]) for r, p in points.items())
                ax.plot([r for r, _ in pairs], [a * 100 for _, a in pairs], "o-", label=system)
            ax.axhline(ATTAINMENT_GOAL * 100, color="grey", linestyle="--", linewidth=1)
            ax.set_title(f"{mix}: {slo.name}")
            ax.set_xlabel("request rate (requests/s)")
            ax.set_ylabel("SLO attainment (%)")
            ax.set_ylim(0, 105)
            ax.grid(True, alpha=0.3)
    axes[0, 0].legend()
    fig.tight_layout()
    path = out / "attainment.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
