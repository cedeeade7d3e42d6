"""`pdserve simulate`: a workload through a simulated xPyD cluster, reported as `pdserve bench`
reports a measured one."""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import get_args

from pdserve.bench.main import workload_from_args
from pdserve.bench.report import markdown_table, plot, read_records, write_json
from pdserve.bench.stats import summarize
from pdserve.bench.workload import Workload, arrival_times
from pdserve.sim.cluster import NodeSpec, SimRequest, Topology, requests_from_records, simulate
from pdserve_core.config import (
    AutoscaleConfig,
    PDServeConfig,
    PlacementConfig,
    RouterConfig,
    load_config,
)
from pdserve_core.roofline.specs import DEVICES, PRESETS, SpecError, load_model
from pdserve_core.roofline.stepmodel import Calibration, FitError, StepModel, load_calibration

ASSUMED_GPU = {
    "flops_efficiency": 0.6,
    "bandwidth_efficiency": 0.8,
    "step_overhead_ms": 2.0,
    "per_sequence_us": 10.0,
}
"""The step model of a GPU nobody has calibrated yet: shares of the datasheet peaks a tuned
engine reaches on large GEMMs and on weight streaming, and a step's fixed cost with CUDA graphs.
Assumptions, not measurements (docs/design.md, "The simulator")."""

CPU_LINK_GBS = 1.0
"""The P→D KV link of a calibrated CPU host: loopback TCP."""
LINK_LATENCY_MS = 1.0
HANDOVER_MS = 5.0
"""The router's relay of a prefilled request, beyond the KV pull."""


def calibrated_limits(calibration: Calibration) -> tuple[int, int, float]:
    """(max_num_seqs, max_num_batched_tokens, the router's added latency per request in
    seconds) of the engines a calibration measured."""
    engine = calibration.engine
    return (
        int(engine.get("max_num_seqs") or 64),
        int(engine.get("max_num_batched_tokens") or 2048),
        float(engine.get("request_overhead_s") or 0.0),
    )


def gpu_step_model(
    device: str,
    tp: int = 1,
    flops_efficiency: float = ASSUMED_GPU["flops_efficiency"],
    bandwidth_efficiency: float = ASSUMED_GPU["bandwidth_efficiency"],
    step_overhead_ms: float = ASSUMED_GPU["step_overhead_ms"],
    per_sequence_us: float = ASSUMED_GPU["per_sequence_us"],
) -> StepModel:
    """A catalog GPU's step model from assumed efficiencies; `tp` GPUs per engine (tensor
    parallel: their rates add up; the all-reduces are not priced)."""
    spec = DEVICES[device]
    flops = spec.peak_flops * flops_efficiency * tp
    return StepModel(
        step_overhead_ms / 1e3,
        per_sequence_us / 1e6,
        flops,
        spec.mem_bandwidth * bandwidth_efficiency * tp,
        1.0 / flops,
        f"assumed:{device}x{tp}",
    )


def synthetic_requests(
    workload: Workload, rate: float, count: int, seed: int = 0
) -> list[SimRequest]:
    """The bench's workloads (the same distributions; not the same draws: no token ids are
    made) with Poisson arrivals."""
    rng = random.Random(seed)
    times = arrival_times("poisson", rate, count, rng)
    requests = []
    for index, at in enumerate(times):
        if workload.name == "random":
            prompt = rng.randint(*workload.prompt_range)
            output = rng.randint(*workload.output_range)
        else:
            prompt, output = workload.prompt_len, workload.output_len
        requests.append(SimRequest(index, at, prompt, output))
    if workload.name == "interference":
        at, index = workload.long_every_s / 2, count
        while at <= times[-1]:
            requests.append(
                SimRequest(index, at, workload.long_prompt_len, workload.long_output_len, "long")
            )
            at, index = at + workload.long_every_s, index + 1
        requests.sort(key=lambda r: r.at_s)
    return requests


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _count_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def add_parser(commands) -> None:
    sim = commands.add_parser(
        "simulate",
        help="discrete-event simulation of an xPyD cluster (calibrated step model)",
        description="Run a workload (a bench record, or a synthetic mix as `pdserve bench` "
        "makes them) through a simulated cluster: engines step as vLLM's scheduler does, priced "
        "by a step-time model (a calibration from `pdserve plan calibrate`, or a catalog GPU "
        "with assumed efficiencies), the router's own placement and routing policies, and a KV "
        "link. Writes the same results.json / results.md / records.jsonl / plots as `pdserve "
        "bench run`.",
    )
    t = sim.add_argument_group("topology")
    t.add_argument("--prefill", type=_count, default=1, help="prefill engines (default 1)")
    t.add_argument("--decode", type=_count, default=1, help="decode engines (default 1)")
    t.add_argument(
        "--colocated", type=_count, default=0, help="colocated engines instead of P and D pools"
    )
    t.add_argument("--calibration", help="step model from this calibration file (a CPU node)")
    t.add_argument(
        "--gpu", choices=list(DEVICES), help="catalog GPU with assumed efficiencies instead"
    )
    t.add_argument("--model", help=f"with --gpu: a preset ({', '.join(PRESETS)}) or config.json")
    t.add_argument("--tp", type=_positive_int, default=1, help="with --gpu: GPUs per engine")
    t.add_argument(
        "--max-num-seqs", type=_positive_int, default=None, help="default: calibration's or 64"
    )
    t.add_argument(
        "--chunk", type=_positive_int, default=None, help="tokens per step (default 2048)"
    )
    t.add_argument(
        "--link-gbs",
        type=_positive,
        help="P→D KV link, GB/s (default: 1 with --calibration, loopback TCP on a CPU host; 50 "
        "with --gpu, a 400 Gb/s NIC)",
    )
    t.add_argument("--link-latency-ms", type=_count_float, default=LINK_LATENCY_MS)
    t.add_argument(
        "--handover-ms",
        type=_count_float,
        default=HANDOVER_MS,
        help="router relay of a prefilled request",
    )
    t.add_argument(
        "--config",
        help="the served cluster's config file (pdserve serve --config): its router section and "
        "pools.autoscale build the simulated router; the flags below override it",
    )
    router, autoscale = RouterConfig(), AutoscaleConfig()
    t.add_argument(
        "--placement",
        choices=list(get_args(PlacementConfig.model_fields["mode"].annotation)),
        help=f"router.placement.mode (the config's; default {router.placement.mode})",
    )
    a = sim.add_argument_group("pools that follow the balance (router/decides/autoscale.py)")
    a.add_argument(
        "--autoscale",
        action="store_true",
        help="move engines between the prefill and decode pools as the balance says "
        "(pools.autoscale.enabled)",
    )
    for flag, kind, field in (
        ("--autoscale-interval-s", _positive, "interval_s"),
        ("--autoscale-cooldown-s", _count_float, "cooldown_s"),
        ("--autoscale-reversal-s", _count_float, "reversal_s"),
        ("--min-prefill", _count, "min_prefill"),
        ("--min-decode", _positive_int, "min_decode"),
    ):
        default = getattr(autoscale, field)
        a.add_argument(flag, type=kind, help=f"pools.autoscale.{field} (default {default})")
    a.add_argument(
        "--tpot-target-s",
        type=_positive,
        help=f"router.tpot_target_s: the decode side of the balance (default "
        f"{router.tpot_target_s})",
    )
    w = sim.add_argument_group("workload")
    w.add_argument("--records", help="replay a bench records.jsonl(.xz)")
    w.add_argument("--run", help="with --records: which run")
    w.add_argument("--workload", choices=["fixed", "random", "interference"], default="fixed")
    w.add_argument("--prompt-len", type=_positive_int, default=128)
    w.add_argument("--output-len", type=_positive_int, default=64)
    w.add_argument(
        "--prompt-range", type=_positive_int, nargs=2, default=(32, 512), metavar=("MIN", "MAX")
    )
    w.add_argument(
        "--output-range", type=_positive_int, nargs=2, default=(16, 128), metavar=("MIN", "MAX")
    )
    w.add_argument("--long-prompt-len", type=_positive_int, default=1536)
    w.add_argument("--long-output-len", type=_positive_int, default=16)
    w.add_argument("--long-every-s", type=_positive, default=10.0)
    w.add_argument("--rate", type=_positive, default=1.0, help="requests/s (Poisson)")
    w.add_argument("--num-requests", type=_positive_int, default=200)
    w.add_argument("--seed", type=int, default=0)
    sim.add_argument("--ttft-slo-s", type=_positive, default=2.0)
    sim.add_argument("--tpot-slo-s", type=_positive, default=0.1)
    sim.add_argument("--out", default="sim-results", help="folder for the report")
    sim.set_defaults(func=cmd_simulate)


def topology_from_args(args: argparse.Namespace) -> Topology:
    request_overhead_s = 0.0
    if args.calibration:
        calibration = load_calibration(args.calibration)
        model, role_step = calibration.model, calibration.for_role
        seqs, chunk, request_overhead_s = calibrated_limits(calibration)
        seqs, chunk = args.max_num_seqs or seqs, args.chunk or chunk
    elif args.gpu:
        model = load_model(args.model or "llama-3-8b")
        step = gpu_step_model(args.gpu, args.tp)
        role_step = lambda role: step  # noqa: E731
        seqs, chunk = args.max_num_seqs or 256, args.chunk or 2048
    else:
        raise SpecError("give --calibration (a measured node) or --gpu (assumed efficiencies)")

    def nodes(role: str, count: int) -> list[NodeSpec]:
        return [NodeSpec(role_step(role), seqs, chunk)] * count

    pools = (
        {"colocated": nodes("colocated", args.colocated)}
        if args.colocated
        else {"prefill": nodes("prefill", args.prefill), "decode": nodes("decode", args.decode)}
    )
    topology = Topology(
        model,
        **pools,
        link_bytes_per_s=(args.link_gbs or (50.0 if args.gpu else CPU_LINK_GBS)) * 1e9,
        link_latency_s=args.link_latency_ms / 1e3,
        request_overhead_s=request_overhead_s,
        handover_latency_s=args.handover_ms / 1e3,
    )
    return replace(topology, config=config_from_args(args))


def config_from_args(args: argparse.Namespace) -> PDServeConfig:
    """The served config (`--config`, else the defaults) with the flags given laid over it, and
    the topology's pools as its mode and replicas."""
    config = load_config(args.config)
    if args.colocated:
        mode, sizes = "colocated", {"colocated": args.colocated}
    else:
        mode, sizes = "disaggregated", {"prefill": args.prefill, "decode": args.decode}
    replicas = {name: _over(getattr(config.pools, name), replicas=n) for name, n in sizes.items()}
    router = config.router
    placement = _over(router.placement, mode=args.placement)
    router = _over(router, placement=placement, tpot_target_s=args.tpot_target_s)
    autoscale = _over(
        config.pools.autoscale,
        enabled=True if args.autoscale else None,
        interval_s=args.autoscale_interval_s,
        cooldown_s=args.autoscale_cooldown_s,
        reversal_s=args.autoscale_reversal_s,
        min_prefill=args.min_prefill,
        min_decode=args.min_decode,
    )
    pools = _over(config.pools, autoscale=autoscale, **replicas)
    return _over(config, mode=mode, router=router, pools=pools)


def _over(section, **values):
    """`section` with the values that are not None put in, validated as a config file is."""
    given = {name: value for name, value in values.items() if value is not None}
    return type(section).model_validate({**dict(section), **given})


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        topology = topology_from_args(args)
        if args.records:
            runs = read_records(Path(args.records))
            if args.run and args.run not in runs:
                raise ValueError(f"no run {args.run!r} in {args.records}; runs: {', '.join(runs)}")
            chosen = runs[args.run] if args.run else [r for rs in runs.values() for r in rs]
            requests = requests_from_records(chosen)
        else:
            for name in ("prompt_range", "output_range"):
                low, high = getattr(args, name)
                if low > high:
                    raise ValueError(f"--{name.replace('_', '-')}: {low} is above {high}")
            workload = workload_from_args(args)
            requests = synthetic_requests(workload, args.rate, args.num_requests, args.seed)
    except (SpecError, FitError, ValueError, OSError) as error:
        print(f"pdserve simulate: {error}", file=sys.stderr)
        return 2
    if not requests:
        print("pdserve simulate: no requests to simulate", file=sys.stderr)
        return 2
    result = simulate(topology, requests)
    span = max(r.at_s for r in requests) - min(r.at_s for r in requests)
    summary = summarize(result.records, max(span, 1e-9), args.ttft_slo_s, args.tpot_slo_s)
    summary["placements"] = result.placements
    summary["busy_share"] = result.busy_share
    summary["autoscale_moves"] = result.moves
    label = "simulated"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    write_json(out, {"settings": settings, "runs": {label: summary}}, {label: result.records})
    text = f"# pdserve simulate\n\n{markdown_table({label: summary})}"
    (out / "results.md").write_text(text)
    plot(out, {label: result.records})
    print(text)
    print(
        f"placements: {json.dumps(result.placements)}; engines busy: "
        + ", ".join(f"{k} {v:.0%}" for k, v in result.busy_share.items())
    )
    for move in result.moves:
        print(
            f"autoscale at {move['at_s']:.1f} s: {move['engine']} {move['action']} (prefill ÷ "
            f"decode {move['ratio']:.2f}) → {move['prefill']}P{move['decode']}D"
        )
    print(f"wrote {out}/")
    return 0
