"""`pdserve bench run` (one endpoint) and `pdserve bench compare` (disaggregated against
colocated on the same cores, plus the router's overhead and the KV micro-benchmark)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench import compare
from pdserve.bench import conversations as conv
from pdserve.bench import sweep as sweep_
from pdserve.bench.client import run_load, served_model
from pdserve.bench.report import markdown_table, plot, read_records, write_json
from pdserve.bench.stats import RequestRecord, summarize
from pdserve.bench.workload import RequestSpec, Workload, build_requests

logger = logging.getLogger(__name__)


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible endpoint, or compare serving modes",
        description="Load generator and report: TTFT, inter-token latency, TPOT and end-to-end "
        "percentiles, goodput at SLOs, JSON + markdown + PNG plots.",
    )
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="drive one endpoint (pdserve's router, or a plain vLLM server)",
        description="Drive one OpenAI-compatible endpoint with a workload and report.",
    )
    run.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    run.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    run.add_argument("--api-key", help="sent as `Authorization: Bearer <key>`")
    run.add_argument("--label", default="run", help="name of this run in the report")
    _add_workload_args(run)
    run.set_defaults(func=cmd_run)
    both = sub.add_parser(
        "compare",
        help="the same workload on pdserve disaggregated (1P1D) and colocated, same cores",
        description="Start pdserve disaggregated (1 prefill engine on core 0, 1 decode engine on "
        "core 1) and colocated (one engine on cores 0-1) in turn, run the same workload against "
        "each, and report them side by side with ratios; then measure the router's overhead "
        "against a plain vLLM server and run the KV transfer micro-benchmark.",
    )
    both.add_argument(
        "--modes", nargs="+", default=list(compare.MODES), choices=list(compare.MODES)
    )
    both.add_argument(
        "--overhead-requests",
        type=int,
        default=20,
        help="sequential requests per side for the router-overhead measurement (0: skip)",
    )
    both.add_argument("--no-kv-micro", action="store_true", help="skip the KV micro-benchmark")
    _add_workload_args(both)
    both.set_defaults(func=cmd_compare)
    sweep = sub.add_parser(
        "sweep",
        help="a request-rate sweep of pdserve adaptive, colocated and plain vLLM, same cores",
        description="Start each system in turn on this machine's two cores (pdserve 1P1D with "
        "adaptive placement, pdserve 1P1D with every prompt on the prefill node, pdserve "
        "colocated, plain vLLM's OpenAI server), send each mix at each rate (Poisson arrivals, "
        "the same requests for every system), and report SLO attainment per rate under two SLOs "
        "(DistServe's: TTFT and TPOT; smooth streaming: TTFT and the longest gap between "
        "tokens), goodput, TTFT / ITL percentiles, and each system's highest rate at >= 90 % "
        "attainment. `blind` is adaptive with router.prefix_aware=false. Writes results.json, "
        "records.jsonl, results.md and attainment.png.",
    )
    sweep.add_argument(
        "--systems", nargs="+", default=["adaptive", "colocated", "vllm"], choices=sweep_.SYSTEMS
    )
    sweep.add_argument("--mixes", nargs="+", default=list(sweep_.MIXES), choices=list(sweep_.MIXES))
    sweep.add_argument(
        "--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0], help="requests/s"
    )
    sweep.add_argument("--duration-s", type=float, default=60.0, help="arrivals per point")
    sweep.add_argument("--warmup-requests", type=int, default=10, help="per system and mix")
    sweep.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    sweep.add_argument("--seed", type=int, default=0)
    distserve, smooth = sweep_.SLOS["DistServe"], sweep_.SLOS["smooth"]
    sweep.add_argument("--ttft-slo-s", type=float, default=distserve.ttft_s, help="both SLOs")
    sweep.add_argument("--tpot-slo-s", type=float, default=distserve.tpot_s, help="DistServe's SLO")
    sweep.add_argument(
        "--max-gap-slo-s", type=float, default=smooth.max_gap_s, help="smooth: the longest gap"
    )
    _add_overrides(sweep)
    sweep.add_argument("--out", default="bench-sweep", help="folder for the report")
    sweep.set_defaults(func=cmd_sweep)
    chat = sub.add_parser(
        "multiturn",
        help="conversations that come back with their history: pdserve against plain vLLM",
        description="Start each system in turn on this machine's two cores (pdserve 1P1D as "
        "configured, pdserve 1P1D with router.prefix_aware=false, plain vLLM's OpenAI server "
        "with its default prefix caching), run the same conversations against each (a shared "
        "system prompt, then turns of a user message and the model's answer, each turn sending "
        "the whole history, with think time between turns), and report TTFT per turn and over "
        "turns >= 2, inter-token latency, and for pdserve what crossed between the pools. "
        "Writes results.json, records.jsonl and results.md.",
    )
    chat.add_argument("--systems", nargs="+", default=list(conv.SYSTEMS), choices=conv.SYSTEMS)
    chat.add_argument("--conversations", type=int, default=12)
    chat.add_argument("--turns", type=int, default=6)
    chat.add_argument("--system-tokens", type=int, default=128, help="shared system prompt")
    chat.add_argument("--message-tokens", type=int, default=128, help="each user message")
    chat.add_argument("--output-tokens", type=int, default=64, help="each answer")
    chat.add_argument("--think-s", type=float, default=2.0, help="pause between turns")
    chat.add_argument("--start-every-s", type=float, default=1.0, help="between conversations")
    chat.add_argument("--timeout-s", type=float, default=300.0, help="per turn")
    chat.add_argument("--seed", type=int, default=0)
    _add_overrides(chat)
    chat.add_argument("--out", default="bench-multiturn", help="folder for the report")
    chat.set_defaults(func=cmd_multiturn)
    again = sub.add_parser(
        "report",
        help="recompute a report folder's figures, tables and plots from its records",
        description="Read results.json and records.jsonl from a folder written by `run` or "
        "`compare` and write results.json, results.md and the plots again (after a change to "
        "how figures are computed, or with other SLOs).",
    )
    again.add_argument("folder", help="a folder written by `pdserve bench run` or `compare`")
    again.add_argument("--ttft-slo-s", type=float, help="default: the run's")
    again.add_argument("--tpot-slo-s", type=float, help="default: the run's")
    again.set_defaults(func=cmd_report)


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change the pdserve systems' config, e.g. --set kv_transfer.load=async (repeatable)",
    )
    parser.add_argument(
        "--vllm-arg",
        dest="plain_vllm_args",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more flag for plain vLLM's server, written with '=', e.g. "
        "--vllm-arg=--max-num-batched-tokens=256 (repeatable; default: vLLM's own settings, "
        "what `vllm serve` would run)",
    )


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=["fixed", "random", "interference"], default="fixed")
    w.add_argument("--prompt-len", type=int, default=128, help="fixed / interference steady")
    w.add_argument("--output-len", type=int, default=64, help="fixed / interference steady")
    w.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    w.add_argument("--output-range", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    w.add_argument("--long-prompt-len", type=int, default=1536, help="interference")
    w.add_argument("--long-output-len", type=int, default=16, help="interference")
    w.add_argument("--long-every-s", type=float, default=10.0, help="interference")
    w.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        help='JSON object merged into every request, e.g. \'{"stop": ["<<never>>"]}\'',
    )
    a = parser.add_argument_group("arrivals and bounds")
    a.add_argument("--arrivals", choices=["poisson", "fixed", "concurrency"], default="poisson")
    a.add_argument("--rate", type=float, default=1.0, help="requests/s (poisson, fixed)")
    a.add_argument("--concurrency", type=int, default=4, help="requests in flight (concurrency)")
    a.add_argument("--num-requests", type=int, default=100, help="steady requests at most")
    a.add_argument("--duration-s", type=float, default=None, help="stop sending after this")
    a.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument(
        "--warmup-requests",
        type=int,
        default=20,
        help="requests of the same workload sent first and not recorded (a fresh engine is "
        "slow on batch shapes it has not met yet)",
    )
    s = parser.add_argument_group("SLOs (goodput)")
    s.add_argument("--ttft-slo-s", type=float, default=2.0)
    s.add_argument("--tpot-slo-s", type=float, default=0.1)
    parser.add_argument("--out", default="bench-results", help="folder for the report")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload the `--workload`, length and interference flags describe."""
    return Workload(
        args.workload,
        args.prompt_len,
        args.output_len,
        tuple(args.prompt_range),
        tuple(args.output_range),
        args.long_prompt_len,
        args.long_output_len,
        args.long_every_s,
    )


def _requests(args: argparse.Namespace) -> list[RequestSpec]:
    return build_requests(
        workload_from_args(args), args.num_requests, args.arrivals, args.rate, seed=args.seed
    )


async def _measure(url: str, requests, args, model: str | None = None, api_key=None):
    model = model or await served_model(url, api_key)
    if args.warmup_requests:  # the same traffic, unrecorded: engines meet their shapes first
        warm = build_requests(
            workload_from_args(args),
            args.warmup_requests,
            args.arrivals,
            args.rate,
            seed=args.seed + 1,
        )
        concurrency = args.concurrency if args.arrivals == "concurrency" else None
        await run_load(
            url, warm, model, concurrency, None, api_key, args.timeout_s, args.extra_body
        )
    concurrency = args.concurrency if args.arrivals == "concurrency" else None
    return await run_load(
        url, requests, model, concurrency, args.duration_s, api_key, args.timeout_s, args.extra_body
    )


def _settings(args: argparse.Namespace) -> dict:
    keys = (
        "workload prompt_len output_len prompt_range output_range long_prompt_len "
        "long_output_len long_every_s extra_body arrivals rate concurrency num_requests "
        "duration_s seed "
        "warmup_requests "
        "ttft_slo_s tpot_slo_s"
    ).split()
    return {key: getattr(args, key) for key in keys}


def _machine() -> str:
    import os

    cpu = platform.machine()
    try:
        names = [line for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def _write(out: Path, results: dict, records: dict[str, list[RequestRecord]], text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out, results, records)
    (out / "results.md").write_text(text)
    plots = plot(out, records)
    print(text)
    print(
        f"wrote {out}/: results.json, records.jsonl, results.md, "
        + ", ".join(p.name for p in plots)
    )


def _quiet() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise


class BenchError(Exception):
    """A benchmark that cannot run as asked (bad settings, unreachable endpoint)."""


def _checked(func):
    """Turn setting and connection errors into one line on stderr and exit status 2."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (BenchError, ValueError, httpx.HTTPError) as error:
            print(f"pdserve bench {args.bench_command}: {error}", file=sys.stderr)
            return 2

    return wrapper


def _check_settings(args: argparse.Namespace) -> None:
    for name in ("num_requests", "concurrency", "rate", "ttft_slo_s", "tpot_slo_s"):
        if getattr(args, name) <= 0:
            raise BenchError(f"--{name.replace('_', '-')} must be positive")


@_checked
def cmd_run(args: argparse.Namespace) -> int:
    _quiet()
    _check_settings(args)
    requests = _requests(args)
    try:
        records, duration = asyncio.run(
            _measure(args.url, requests, args, args.model, args.api_key)
        )
    except httpx.HTTPError as error:
        raise BenchError(f"cannot reach {args.url}: {error}") from None
    summary = summarize(records, duration, args.ttft_slo_s, args.tpot_slo_s)
    results = {"settings": _settings(args), "machine": _machine(), "runs": {args.label: summary}}
    text = f"# pdserve bench: {args.label} ({args.url})\n\n" + markdown_table({args.label: summary})
    _write(Path(args.out), results, {args.label: records}, text)
    return 0 if summary["completed"] else 1


@_checked
def cmd_compare(args: argparse.Namespace) -> int:
    _quiet()
    _check_settings(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = _requests(args)
    summaries, records, kv = {}, {}, {}
    for mode in args.modes:
        logger.info("starting pdserve %s (%s)", mode, compare.MODES[mode])
        with compare.pdserve_server(compare.MODES[mode], compare.scratch(out, mode)) as url:
            before = compare.kv_totals(url) if mode == "disaggregated" else None
            logger.info("running %d requests against %s", len(requests), mode)
            records[mode], duration = asyncio.run(_measure(url, requests, args))
            if before is not None:
                after = compare.kv_totals(url)
                kv = {key: after[key] - before[key] for key in after}
        summaries[mode] = summarize(records[mode], duration, args.ttft_slo_s, args.tpot_slo_s)
    results = {
        "settings": _settings(args),
        "machine": _machine(),
        "fairness": "disaggregated: prefill engine on core 0 + decode engine on core 1, one "
        "thread each; colocated: one engine with two threads on cores 0-1; same engine settings, "
        "same requests at the same times, fresh server per mode",
        "runs": summaries,
        "kv_transfer_in_run": _kv_in_run(kv),
    }
    if args.overhead_requests:
        results["router_overhead"] = _router_overhead(out, args)
    if not args.no_kv_micro:
        results["kv_micro_benchmark"] = compare.kv_micro_benchmark(out)
    _write(out, results, records, _compare_text(results))
    return 0


@_checked
def cmd_sweep(args: argparse.Namespace) -> int:
    _quiet()
    if any(rate <= 0 for rate in args.rates) or args.duration_s <= 0:
        raise BenchError("--rates and --duration-s must be positive")
    args.slos = (
        sweep_.Slo("DistServe", args.ttft_slo_s, tpot_s=args.tpot_slo_s),
        sweep_.Slo("smooth", args.ttft_slo_s, max_gap_s=args.max_gap_slo_s),
    )
    with tempfile.TemporaryDirectory() as scratch:  # refuse a bad --set before starting anything
        for system in set(args.systems) - {"vllm"}:
            sweep_.pdserve_config(system, compare.REPO, Path(scratch), args.overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = sorted(args.rates)
    points: dict = {mix: {} for mix in args.mixes}
    records: dict[str, list[RequestRecord]] = {}
    for system in args.systems:
        work = compare.scratch(out, system)
        logger.info("starting %s", system)
        with _system(system, work, args.overrides, args.plain_vllm_args) as url:
            for mix in args.mixes:
                got: dict = {}
                disaggregated = system not in ("colocated", "vllm")
                by_rate = points[mix].setdefault(system, {})
                sweep_.run_points(url, mix, rates, args, got, by_rate, disaggregated)
                records.update({f"{system}/{mix}/{rate}": r for rate, r in got.items()})
    results = {
        "settings": {
            key: getattr(args, key)
            for key in "systems mixes rates duration_s warmup_requests seed overrides "
            "plain_vllm_args".split()
        },
        "machine": _machine(),
        "duration_s": args.duration_s,
        "systems": args.systems,
        "slos": [vars(slo) for slo in args.slos],
        "fairness": "; ".join(
            f"{system}: {sweep_.describe_layout(system, compare.REPO, args.overrides)}"
            for system in args.systems
            if system != "vllm"
        )
        + "; vllm: one engine with two threads on cores 0-1; same engine "
        f"settings ({sweep_.engines_dtype(compare.REPO, args.overrides)}, eager, max_model_len "
        "2048, 64 sequences, tcmalloc and Intel OpenMP preloaded), "
        f"{_steps_and_blocks(args)}, fresh server per system.",
        "points": points,
    }
    results["headline"] = sweep_.headline(results, args.slos)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out, results, records)
    report = sweep_.text(results, args.slos)
    (out / "results.md").write_text(report)
    figure = sweep_.plot(out, results, args.slos)
    print(report)
    print(f"wrote {out}/: results.json, records.jsonl, results.md, {figure.name}")
    return 0


@_checked
def cmd_multiturn(args: argparse.Namespace) -> int:
    _quiet()
    counts = (args.conversations, args.turns, args.message_tokens, args.output_tokens)
    if min(counts) <= 0 or args.system_tokens < 0 or min(args.think_s, args.start_every_s) < 0:
        raise BenchError("conversations, turns, message and output tokens must be positive")
    workload = conv.Conversations(
        args.conversations, args.turns, args.system_tokens, args.message_tokens,
        args.output_tokens, args.think_s, args.start_every_s, args.seed,
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    records: dict[str, list[RequestRecord]] = {}
    for system in args.systems:
        work = compare.scratch(out, system)
        logger.info("starting %s", system)
        system_ = {"pdserve": "adaptive"}.get(system, system)
        with _system(system_, work, args.overrides, args.plain_vllm_args) as url:
            model = asyncio.run(served_model(url))
            warm = conv.Conversations(2, 2, 16, 16, 8, 0.0, 0.0, args.seed + 1)
            asyncio.run(conv.run_conversations(url, warm, model, args.timeout_s))

            def metrics(url: str = url, system: str = system) -> dict:
                if system == "vllm":
                    return {}
                return conv.crossing(httpx.get(f"{url}/metrics", timeout=10).text)

            before = metrics()
            got = asyncio.run(conv.run_conversations(url, workload, model, args.timeout_s))
            runs[system] = conv.summary(got, args.turns)
            if system != "vllm":
                runs[system]["crossing"] = conv.difference(metrics(), before)
            records[system] = got
    results = {
        "settings": {
            key: getattr(args, key)
            for key in "systems conversations turns system_tokens message_tokens output_tokens "
            "think_s start_every_s seed overrides plain_vllm_args".split()
        },
        "machine": _machine(),
        "fairness": f"pdserve: {sweep_.describe_layout('adaptive', compare.REPO, args.overrides)}"
        "; vllm: one engine with two threads on cores 0-1; same engine settings but "
        f"{_steps_and_blocks(args)}, prefix caching on in all; the same conversations; fresh "
        "server per system.",
        "runs": runs,
        "kv_bytes_per_token": conv.kv_bytes_per_token(),
    }
    write_json(out, results, records)
    text = conv.text(results)
    (out / "results.md").write_text(text)
    print(text)
    print(f"wrote {out}/: results.json, records.jsonl, results.md")
    return 0 if all(not run["errors"] for run in runs.values()) else 1


def _steps_and_blocks(args: argparse.Namespace) -> str:
    """The prompt tokens each side's engine computes in a step and the tokens in each side's KV
    block, as the fairness line says them."""
    from pdserve_core.config import parse_config
    from pdserve_core.roofline.serving import (
        VLLM_CPU_BLOCK_TOKENS,
        VLLM_CPU_CHUNK_TOKENS,
        cpu_block_size,
        cpu_chunk_size,
    )

    engine = parse_config(sweep_.config_data("colocated", compare.REPO, args.overrides)).engine
    ours = {
        role: cpu_chunk_size(engine.max_num_batched_tokens, engine.max_num_seqs, role)
        or VLLM_CPU_CHUNK_TOKENS
        for role in ("decode", "prefill")
    }

    def theirs(flag: str, default: int) -> str:
        given = [a for a in args.plain_vllm_args if a.startswith(f"{flag}=")]
        return given[-1].split("=", 1)[1] if given else f"{default} (vLLM's default)"

    return (
        f"a step's tokens {ours['decode']} on pdserve's colocated and decode CPU engines, "
        f"{ours['prefill']} on its prefill engines, "
        f"{theirs('--max-num-batched-tokens', VLLM_CPU_CHUNK_TOKENS)} on vLLM's; "
        f"KV blocks of {cpu_block_size(engine.block_size)} tokens on pdserve's CPU engines, "
        f"{theirs('--block-size', VLLM_CPU_BLOCK_TOKENS)} on vLLM's"
    )


def _system(system: str, work: Path, overrides: list[str], vllm_args: list[str]):
    """A context manager serving `system` on this machine; yields its base URL."""
    if system == "vllm":
        from pdserve_core.model_prep import prepare_default_model

        model_dir = prepare_default_model()
        dtype = sweep_.engines_dtype(compare.REPO, overrides)
        return compare.plain_vllm_server(
            model_dir, model_dir.name, work, dtype=dtype, extra=tuple(vllm_args)
        )
    config = sweep_.pdserve_config(system, compare.REPO, work, overrides)
    return compare.pdserve_server(config, work)


def cmd_report(args: argparse.Namespace) -> int:
    out = Path(args.folder)
    try:
        results = json.loads((out / "results.json").read_text())
        records = read_records(out / "records.jsonl")
    except (OSError, ValueError) as error:
        print(f"pdserve bench report: cannot read {out}: {error}", file=sys.stderr)
        return 2
    settings = results["settings"]
    settings["ttft_slo_s"] = args.ttft_slo_s or settings["ttft_slo_s"]
    settings["tpot_slo_s"] = args.tpot_slo_s or settings["tpot_slo_s"]
    for name, runs in records.items():
        duration = results["runs"][name]["duration_s"]
        results["runs"][name] = summarize(
            runs, duration, settings["ttft_slo_s"], settings["tpot_slo_s"]
        )
    if "fairness" in results:
        text = _compare_text(results)
    else:
        (name,) = results["runs"]
        text = f"# pdserve bench: {name}\n\n" + markdown_table(results["runs"])
    _write(out, results, records, text)
    return 0


def _kv_in_run(kv: dict) -> dict | None:
    if not kv or not kv.get("transfers"):
        return None
    return {
        **kv,
        "mean_seconds": kv["seconds"] / kv["transfers"],
        "gbps": kv["bytes"] / kv["seconds"] / 1e9 if kv["seconds"] else None,
    }


def _router_overhead(out: Path, args: argparse.Namespace) -> dict:
    """Sequential identical requests through pdserve colocated and a plain vLLM server with the
    same engine settings on the same cores: the difference is what the router adds."""
    specs = build_requests(Workload("fixed", 128, 32), args.overhead_requests, "fixed", 1.0, 1)
    specs = [RequestSpec(s.index, s.prompt_token_ids, s.max_tokens) for s in specs]
    sides = {}
    from pdserve_core.model_prep import prepare_default_model

    model_dir = prepare_default_model()
    with compare.plain_vllm_server(model_dir, model_dir.name, compare.scratch(out, "vllm")) as url:
        sides["vllm"] = asyncio.run(_sequential(url, specs))
    config = compare.MODES["colocated"]
    with compare.pdserve_server(config, compare.scratch(out, "overhead")) as url:
        sides["pdserve"] = asyncio.run(_sequential(url, specs))
    result = {}
    for metric in ("ttft_s", "itl_s", "e2e_s"):
        ours, theirs = sides["pdserve"][metric]["p50"], sides["vllm"][metric]["p50"]
        result[metric] = {"pdserve_p50": ours, "vllm_p50": theirs, "added": ours - theirs}
    return result


async def _sequential(url: str, specs: list[RequestSpec]) -> dict:
    model = await served_model(url)
    await run_load(url, specs[:2], model, concurrency=1)  # warm-up
    started = time.monotonic()
    records, _ = await run_load(url, specs, model, concurrency=1)
    return summarize(records, time.monotonic() - started, 1e9, 1e9)


def _compare_text(results: dict) -> str:
    settings = results["settings"]
    lines = [
        "# pdserve bench compare",
        "",
        f"Machine: {results['machine']}. Workload: {settings['workload']}, arrivals "
        f"{settings['arrivals']} at {settings['rate']}/s, {settings['num_requests']} steady "
        f"requests. SLOs: TTFT ≤ {settings['ttft_slo_s']} s, TPOT ≤ {settings['tpot_slo_s']} s.",
        f"Fairness: {results['fairness']}.",
        "",
        markdown_table(results["runs"]),
    ]
    kv = results.get("kv_transfer_in_run")
    if kv:
        lines.append(
            f"KV transfer during the disaggregated run: {kv['transfers']:.0f} pulls, "
            f"{kv['bytes'] / 2**20:.1f} MiB, mean {kv['mean_seconds'] * 1e3:.1f} ms per pull "
            f"({kv['gbps']:.2f} GB/s while transferring).\n"
        )
    overhead = results.get("router_overhead")
    if overhead:
        lines += ["Router overhead (pdserve colocated − plain vLLM server, same engine, p50):", ""]
        lines += ["| metric | pdserve | vLLM | added |", "|---|---|---|---|"]
        for metric, row in overhead.items():
            lines.append(
                f"| {metric} | {row['pdserve_p50'] * 1e3:.1f} ms | {row['vllm_p50'] * 1e3:.1f} ms "
                f"| {row['added'] * 1e3:+.1f} ms |"
            )
        lines.append("")
    micro = results.get("kv_micro_benchmark")
    if micro:
        lines += ["KV transfer micro-benchmark (benchmarks/kv_transport.py, median):", ""]
        lines += ["| payload | raw TCP GB/s | pdserve TCP GB/s | ratio |", "|---|---|---|---|"]
        for row in micro["rows"]:
            lines.append(
                f"| {row['payload_bytes'] / 2**20:.0f} MiB | {row['raw_gbps']:.2f} | "
                f"{row['pdserve_tcp_gbps']:.2f} | {row['ratio']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"
