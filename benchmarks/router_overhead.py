"""What the router adds to each token, against plain vLLM with the engine on the same core.

    python benchmarks/router_overhead.py [--rounds 2] [--streams 1 4] [--per-stream 6] [--out DIR]

Every system runs one engine with one thread bound to core 1, so the engine's work is the same
and the router (or vLLM's API server) has core 0 to itself:
- `vllm`: plain vLLM's OpenAI server (what a user would run instead);
- `direct`: pdserve colocated, tokens over each node's token stream (`router.token_stream:
  direct`, the default);
- `ray`: pdserve colocated, tokens as Ray streaming calls (`router.token_stream: ray`);
- `worker`: `direct` with the model worker in a process of its own beside the EngineCore
  (`engine.cpu_worker_process: true`), as vLLM runs it on a CPU; pdserve's default runs it
  inside the EngineCore's process.
Each system is started in turn, `--rounds` times in alternation (the machine is noisy: the
figures that count are differences within one round), and sent closed loops of 64 → 128-token
streams, `--streams` at a time. Prints, and writes to DIR/results.json and DIR/results.md, the
TTFT and ITL p50 of each, each pdserve system's overhead over vLLM in the same round, and the CPU
each generated token cost each group of processes (the engine's own, EngineCore and worker,
apart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path

import yaml

from pdserve.bench import compare
from pdserve.bench.client import run_load, served_model
from pdserve.bench.stats import summarize
from pdserve.bench.workload import RequestSpec, Workload, build_requests

SYSTEMS = ("vllm", "direct", "ray", "worker")
CORE = "1"
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_by_process() -> dict[str, float]:
    """CPU seconds (user + system) every process on this machine has used, summed by its name
    (vLLM and Ray name theirs: VLLM::EngineCore, VLLM::Worker, ray::EngineActor, ...), this
    benchmark's own process (the clients) left out."""
    totals: dict[str, float] = {}
    own = Path(f"/proc/{os.getpid()}/stat")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if stat == own:
            continue
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * TICK_S
    return totals


def pdserve_config(system: str, work: Path) -> Path:
    data = yaml.safe_load(compare.MODES["colocated"].read_text())
    data["pools"]["colocated"] = {"replicas": 1, "num_cpus": 1, "cpu_bind": [CORE]}
    engine = data.setdefault("engine", {})
    engine["omp_threads"] = 1
    engine["cpu_worker_process"] = system == "worker"
    data.setdefault("router", {})["token_stream"] = "ray" if system == "ray" else "direct"
    path = work / f"{system}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def closed_loops(url: str, streams: list[int], per_stream: int) -> dict:
    """`per_stream` requests per stream, for each number of streams at once."""
    model = await served_model(url)
    specs = build_requests(Workload("fixed", 64, 128), per_stream * max(streams), "fixed", 1.0, 7)
    specs = [RequestSpec(s.index, s.prompt_token_ids, s.max_tokens) for s in specs]
    await run_load(url, specs[:2], model, concurrency=1)  # warm-up
    out = {}
    for count in streams:
        before = cpu_by_process()
        records, duration = await run_load(url, specs[: per_stream * count], model, count)
        after = cpu_by_process()
        summary = summarize(records, duration, 1e9, 1e9)
        tokens = sum(r.output_tokens for r in records if r.ok)
        used = {name: after[name] - before.get(name, 0.0) for name in after}
        out[str(count)] = {
            "ttft_p50_s": summary["ttft_s"]["p50"],
            "itl_p50_s": summary["itl_s"]["p50"],
            "errors": summary["errors"],
            "requests": summary["requests"],
            "tokens": tokens,
            "cpu_ms_per_token": {
                name: round(seconds / tokens * 1e3, 3)
                for name, seconds in sorted(used.items(), key=lambda item: -item[1])
                if seconds / tokens * 1e3 >= 0.05
            },
        }
    return out


def run_system(system: str, work: Path, streams: list[int], per_stream: int) -> dict:
    from pdserve_core.model_prep import prepare_default_model

    if system == "vllm":
        model_dir = prepare_default_model()
        server = compare.plain_vllm_server(model_dir, model_dir.name, work, cores=CORE)
    else:
        server = compare.pdserve_server(pdserve_config(system, work), work)
    with server as url:
        return asyncio.run(closed_loops(url, streams, per_stream))


PATH_GROUPS = {
    "router / API server": lambda name: name == "python",
    "engine actor": lambda name: name.startswith("ray::EngineActo"),
    "Ray daemons": lambda name: (
        name in ("gcs_server", "raylet")
        or (name.startswith("ray::") and not name.startswith("ray::EngineActo"))
    ),
}
"""The processes a token passes through outside the engine, and Ray's own, whose work is mostly
the control plane's."""

ENGINE = "engine (EngineCore, worker)"
"""vLLM's own processes: the EngineCore, and its model worker where it has a process of its own
(vLLM's server, `worker`); what the EngineCore spends waiting for that worker shows here."""


def _in_engine(name: str) -> bool:
    return name.startswith("VLLM::")


def path_cpu(cpu: dict[str, float]) -> dict[str, float]:
    """CPU ms per token by `PATH_GROUPS` group, and their sum."""
    groups = {
        group: sum(ms for name, ms in cpu.items() if belongs(name))
        for group, belongs in PATH_GROUPS.items()
    }
    engine = sum(ms for name, ms in cpu.items() if _in_engine(name))
    return {**groups, "total": sum(groups.values()), ENGINE: engine}


def cpu_table(rounds: list[dict], streams: list[int], systems: list[str]) -> list[str]:
    lines = [
        "CPU per generated token (ms, mean across rounds): outside the engine, their total, and",
        "the engine's own processes",
        "",
        "| streams | system | " + " | ".join(PATH_GROUPS) + f" | total | {ENGINE} |",
        "|---|---|" + "---|" * (len(PATH_GROUPS) + 2),
    ]
    for count in map(str, streams):
        for system in systems:
            per_round = [path_cpu(r[system][count]["cpu_ms_per_token"]) for r in rounds]
            cells = [
                f"{statistics.mean(p[group] for p in per_round):.2f}"
                for group in (*PATH_GROUPS, "total", ENGINE)
            ]
            lines.append(f"| {count} | {system} | " + " | ".join(cells) + " |")
    return lines


def report(rounds: list[dict], streams: list[int]) -> str:
    """The rounds' tables, for the systems they ran (vLLM among them: the rest are read
    against it)."""
    systems = [system for system in SYSTEMS if system in rounds[0]]
    lines = [
        "| round | streams | system | TTFT p50 | ITL p50 | TTFT over vLLM | ITL over vLLM |",
        "|---|---|---|---|---|---|---|",
    ]
    added: dict[tuple[str, str, str], list[float]] = {}
    for index, result in enumerate(rounds):
        for count in map(str, streams):
            base = result["vllm"][count]
            for system in systems:
                row = result[system][count]
                over = ["", ""]
                if system != "vllm":
                    for i, key in enumerate(("ttft_p50_s", "itl_p50_s")):
                        delta = row[key] - base[key]
                        added.setdefault((count, system, key), []).append(delta)
                        over[i] = f"{delta * 1e3:+.1f} ms"
                lines.append(
                    f"| {index} | {count} | {system} | {row['ttft_p50_s'] * 1e3:.1f} ms "
                    f"| {row['itl_p50_s'] * 1e3:.1f} ms | {over[0]} | {over[1]} |"
                )
    lines += ["", "Mean overhead over vLLM across rounds:", ""]
    lines += ["| streams | system | TTFT p50 | ITL p50 |", "|---|---|---|---|"]
    for count in map(str, streams):
        for system in systems[1:]:
            ttft = statistics.mean(added[(count, system, "ttft_p50_s")])
            itl = statistics.mean(added[(count, system, "itl_p50_s")])
            lines.append(f"| {count} | {system} | {ttft * 1e3:+.1f} ms | {itl * 1e3:+.1f} ms |")
    if all("cpu_ms_per_token" in r[s][str(c)] for r in rounds for s in systems for c in streams):
        lines += ["", *cpu_table(rounds, streams, systems)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--per-stream", type=int, default=6, help="requests per stream")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--out", type=Path, default=Path("results/bench/router-overhead"))
    parser.add_argument(
        "--report", action="store_true", help="only rewrite DIR/results.md from DIR/results.json"
    )
    args = parser.parse_args()
    if args.report:
        text = report(json.loads((args.out / "results.json").read_text()), args.streams)
        (args.out / "results.md").write_text(text)
        print(text)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for index in range(args.rounds):
        result = {}
        for system in args.systems:
            result[system] = run_system(
                system,
                compare.scratch(args.out, f"{index}-{system}"),
                args.streams,
                args.per_stream,
            )
            print(index, system, json.dumps(result[system]), flush=True)
        rounds.append(result)
        (args.out / "results.json").write_text(json.dumps(rounds, indent=1))
    if "vllm" in args.systems:
        text = report(rounds, args.streams)
        (args.out / "results.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
