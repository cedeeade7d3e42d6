"""Which layout of one CPU host's cores serves a given traffic best.

The candidates are the ones a host's cores allow: one engine on every core (`colocated`), or a
prefill engine on k cores and a decode engine on the rest (`partitioned k+n`). Sharing the cores
between both roles is not a candidate: measured on two cores it lost to both (docs/design.md, "Two
cores"). Each candidate runs the traffic through the simulator (pdserve/sim) with the step models
calibrated on this host for its engines' thread counts (`pdserve plan calibrate`: a calibration is
stored per CPU model and thread count), and is judged by SLO attainment as `pdserve bench sweep`
judges a measured run; among layouts within a point of the best, the one whose median request
finishes first wins.

Without the calibrations a two-core host falls back on the rule its measurements gave (colocated
unless long prompts arrive among streams and gaps are judged); any other host keeps its config.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from pdserve_core.config import DEFAULT_MODEL, LayoutConfig, PDServeConfig, with_settings
from pdserve_core.engine import dtype
from pdserve_core.model_prep import DEFAULT_MODEL_DIRNAME
from pdserve_core.roofline.stepmodel import (
    Calibration,
    FitError,
    calibration_path,
    device_key,
    load_calibration,
    model_key,
)

logger = logging.getLogger(__name__)

TIE = 0.01
"""Attainments this close count as equal; the faster median request then decides."""
SIMULATED_S = 60.0
"""Seconds of arrivals simulated per candidate (at least `MIN_REQUESTS` requests)."""
MIN_REQUESTS = 100


@dataclass(frozen=True)
class Layout:
    """Threads per engine: (colocated,) or (prefill, decode)."""

    threads: tuple[int, ...]

    @property
    def colocated(self) -> bool:
        return len(self.threads) == 1

    @property
    def name(self) -> str:
        if self.colocated:
            return f"colocated ({self.threads[0]} threads)"
        return f"partitioned {self.threads[0]}+{self.threads[1]}"

    def settings(self) -> list[str]:
        """The `--set` items that serve this layout: one replica per pool, each engine bound to
        cores of its own, as many threads as cores."""
        common = ["engine.omp_threads=null"]
        if self.colocated:
            (n,) = self.threads
            return [
                *common,
                "mode=colocated",
                "pools.colocated.replicas=1",
                f"pools.colocated.num_cpus={n}",
                f"pools.colocated.cpu_bind=[{_cores(0, n)}]",
            ]
        p, d = self.threads
        return [
            *common,
            "mode=disaggregated",
            "pools.prefill.replicas=1",
            "pools.decode.replicas=1",
            f"pools.prefill.num_cpus={p}",
            f"pools.decode.num_cpus={d}",
            f"pools.prefill.cpu_bind=[{_cores(0, p)}]",
            f"pools.decode.cpu_bind=[{_cores(p, d)}]",
        ]


def _cores(first: int, count: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND's spelling of `count` cores from `first`, quoted for YAML."""
    return f'"{first}"' if count == 1 else f'"{first}-{first + count - 1}"'


def candidates(cores: int) -> list[Layout]:
    """Colocated on every core, then each split of the cores between a prefill and a decode
    engine (prefill's share first)."""
    if cores < 1:
        raise ValueError(f"a host needs at least one core, not {cores}")
    return [Layout((cores,)), *(Layout((k, cores - k)) for k in range(1, cores))]


@dataclass
class Judged:
    layout: Layout
    attainment: float | None = None
    """Share of the (steady) requests that met the SLO; None where it could not be simulated."""
    ttft_p50_s: float | None = None
    tpot_p50_s: float | None = None
    max_gap_p99_s: float | None = None
    missing: list[str] = field(default_factory=list)
    """Calibration files it needed and did not find."""

    def median_request_s(self, output_len: int) -> float:
        if self.ttft_p50_s is None:
            return math.inf
        return self.ttft_p50_s + (self.tpot_p50_s or 0.0) * max(0, output_len - 1)

    def describe(self) -> str:
        if self.attainment is None:
            return f"{self.layout.name}: not simulated (no calibration {', '.join(self.missing)})"
        parts = [
            f"{self.attainment:.0%} within the SLO",
            f"TTFT p50 {self.ttft_p50_s * 1e3:.0f} ms",
        ]
        if self.tpot_p50_s is not None:
            parts.append(f"TPOT p50 {self.tpot_p50_s * 1e3:.0f} ms")
        if self.max_gap_p99_s is not None:
            parts.append(f"max gap p99 {self.max_gap_p99_s * 1e3:.0f} ms")
        return f"{self.layout.name}: " + ", ".join(parts)


@dataclass
class Choice:
    layout: Layout | None
    """None: keep the config's own layout."""
    judged: list[Judged]
    reason: str


def find_calibrations(threads: set[int], model: str, root: str | Path | None = None) -> dict:
    """{threads: Calibration} of this host's CPU for `model` (a model key: folder name and
    dtype), and {threads: path} of those not found; a file that cannot be read counts as not
    found."""
    found, missing = {}, {}
    for n in sorted(threads):
        path = calibration_path(device_key(threads=n), model, root)
        try:
            found[n] = load_calibration(path)
        except FitError:
            missing[n] = path
    return {"found": found, "missing": missing}


def simulate(
    layout: Layout, calibrations: dict[int, Calibration], traffic: LayoutConfig, seed: int = 0
) -> Judged:
    """The traffic through the layout in the simulator, judged as `pdserve bench sweep` judges
    a run (steady requests only: long prompts are the disturbance)."""
    from pdserve.bench.stats import distribution
    from pdserve.bench.sweep import attainment, max_gap
    from pdserve.bench.workload import Workload
    from pdserve.sim.cluster import NodeSpec, Topology
    from pdserve.sim.cluster import simulate as run_sim
    from pdserve.sim.main import (
        CPU_LINK_GBS,
        HANDOVER_MS,
        LINK_LATENCY_MS,
        calibrated_limits,
        synthetic_requests,
    )

    def node(threads: int, role: str) -> NodeSpec:
        seqs, chunk, _ = calibrated_limits(calibrations[threads])
        return NodeSpec(calibrations[threads].for_role(role), seqs, chunk)

    roles = ("colocated",) if layout.colocated else ("prefill", "decode")
    first = calibrations[layout.threads[0]]  # the engine that takes each request first
    topology = Topology(
        first.model,
        **{role: [node(n, role)] for role, n in zip(roles, layout.threads, strict=True)},
        link_bytes_per_s=CPU_LINK_GBS * 1e9,
        link_latency_s=LINK_LATENCY_MS / 1e3,
        request_overhead_s=calibrated_limits(first)[2],
        handover_latency_s=HANDOVER_MS / 1e3,
        config=with_settings(PDServeConfig(), layout.settings()),
    )
    workload = Workload(
        "interference" if traffic.long_prompt_len else "fixed",
        traffic.prompt_len,
        traffic.output_len,
        long_prompt_len=traffic.long_prompt_len or 1,
        long_output_len=traffic.long_output_len,
        long_every_s=traffic.long_every_s,
    )
    count = max(MIN_REQUESTS, round(traffic.rate * SIMULATED_S))
    result = run_sim(topology, synthetic_requests(workload, traffic.rate, count, seed))
    slo = slo_of(traffic)
    steady = [r for r in result.records if r.kind == "steady" and r.ok]
    ttft = distribution([r.ttft for r in steady if r.ttft is not None])
    tpot = distribution([r.tpot for r in steady if r.tpot is not None])
    gaps = distribution([max_gap(r) for r in steady])
    return Judged(
        layout,
        attainment(result.records, slo),
        ttft.get("p50"),
        tpot.get("p50"),
        gaps.get("p99"),
    )


def judge(
    cores: int, model: str, traffic: LayoutConfig, root: str | Path | None = None, seed: int = 0
) -> list[Judged]:
    """Every candidate of a `cores`-core host, simulated where its calibrations exist."""
    layouts = candidates(cores)
    calibrations = find_calibrations({n for lay in layouts for n in lay.threads}, model, root)
    judged = []
    for layout in layouts:
        missing = [
            str(calibrations["missing"][n])
            for n in sorted(set(layout.threads))
            if n in calibrations["missing"]
        ]
        if missing:
            judged.append(Judged(layout, missing=missing))
        else:
            judged.append(simulate(layout, calibrations["found"], traffic, seed))
    return judged


def best(judged: list[Judged], output_len: int) -> Judged | None:
    """The highest attainment; within `TIE` of it, the fastest median request."""
    simulated = [j for j in judged if j.attainment is not None]
    if not simulated:
        return None
    top = max(j.attainment for j in simulated)
    close = [j for j in simulated if j.attainment >= top - TIE]
    return min(close, key=lambda j: j.median_request_s(output_len))


def measured_rule(cores: int, traffic: LayoutConfig) -> Layout | None:
    """What the two-core measurements say without a calibration (docs/design.md, "Two cores"):
    one engine on both cores for uniform prompts, the split when long prompts arrive among
    streams and the gaps between chunks are judged. None on other hosts: not measured."""
    if cores != 2:
        return None
    if traffic.long_prompt_len and traffic.max_gap_slo_s is not None:
        return Layout((1, 1))
    return Layout((2,))


def choose(
    cores: int, model: str, traffic: LayoutConfig, root: str | Path | None = None, seed: int = 0
) -> Choice:
    """The layout to serve `traffic` with on a `cores`-core CPU host, and why."""
    judged = judge(cores, model, traffic, root, seed)
    winner = best(judged, traffic.output_len)
    lines = [j.describe() for j in judged]
    if winner is not None:
        return Choice(
            winner.layout,
            judged,
            f"{winner.layout.name}, simulated with this host's calibrations for "
            f"{_traffic(traffic)}: " + "; ".join(lines),
        )
    rule = measured_rule(cores, traffic)
    hint = "`pdserve plan calibrate` once per candidate's thread count (docs/planner.md)"
    if rule is not None:
        return Choice(
            rule,
            judged,
            f"{rule.name}, by the rule measured on two cores (docs/design.md, 'Two cores'): no "
            f"calibration of this host to simulate {_traffic(traffic)} with; {hint}",
        )
    return Choice(
        None,
        judged,
        f"the config's own layout: no calibration of this {cores}-core host to simulate "
        f"{_traffic(traffic)} with, and no measured rule for it; {hint}",
    )


def _traffic(traffic: LayoutConfig) -> str:
    text = f"{traffic.prompt_len} → {traffic.output_len} tokens at {traffic.rate:g} requests/s"
    if traffic.long_prompt_len:
        text += (
            f" plus {traffic.long_prompt_len} → {traffic.long_output_len} every "
            f"{traffic.long_every_s:g} s"
        )
    from pdserve.bench.sweep import describe_slo

    return f"{text}, {describe_slo(slo_of(traffic))}"


def slo_of(traffic: LayoutConfig):
    """The SLO `traffic` is judged by, as `pdserve bench sweep` judges one."""
    from pdserve.bench.sweep import Slo

    return Slo("SLO", traffic.ttft_slo_s, traffic.tpot_slo_s, traffic.max_gap_slo_s)


def as_dict(choice: Choice, traffic: LayoutConfig) -> dict:
    """`pdserve plan layout --json`: one entry per rate."""
    return {
        "traffic": traffic.model_dump(),
        "layout": choice.layout.name if choice.layout else None,
        "settings": choice.layout.settings() if choice.layout else [],
        "reason": choice.reason,
        "judged": [
            {
                "layout": j.layout.name,
                "threads": list(j.layout.threads),
                "attainment": j.attainment,
                "ttft_p50_s": j.ttft_p50_s,
                "tpot_p50_s": j.tpot_p50_s,
                "max_gap_p99_s": j.max_gap_p99_s,
                "missing": j.missing,
            }
            for j in choice.judged
        ],
    }


def served_model_key(
    config: PDServeConfig, model: str | Path | None = None, dtype_name=None
) -> str:
    """The calibration name of the model `config` serves (or `model`), in its engines' dtype
    as this host resolves it."""
    folder = str(model or config.model)
    name = DEFAULT_MODEL_DIRNAME if folder == DEFAULT_MODEL else Path(folder).name
    return model_key(name, dtype_name or dtype.resolve(config.engine.dtype, gpu=False))


def auto_layout(
    config: PDServeConfig, model_dir: str | Path, host_cores: int | None = None
) -> PDServeConfig:
    """`config` laid out as `layout.auto` chooses, with the choice and its reason logged;
    unchanged where there is nothing to choose (a GPU, a joined cluster, pools the autoscaler
    resizes)."""
    pools = config.pools
    gpus = any(pool.num_gpus for pool in (pools.prefill, pools.decode, pools.colocated))
    if config.ray.address or gpus:
        logger.info("layout: auto chooses among one CPU host's layouts; kept mode %s", config.mode)
        return config
    if pools.autoscale.enabled:
        logger.info("layout: pools.autoscale moves engines between the pools; kept the config's")
        return config
    cores = config.ray.num_cpus or host_cores or os.cpu_count() or 1
    choice = choose(cores, served_model_key(config, model_dir), config.layout)
    if choice.layout is None:
        logger.warning("layout: %s", choice.reason)
        return config
    logger.info("layout: %s", choice.reason)
    return with_settings(config, choice.layout.settings())
