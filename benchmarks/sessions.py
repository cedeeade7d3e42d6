"""A server's session and its speed on a small host: pdserve 1P1D (the default config) and plain
vLLM's OpenAI server (one engine on both cores), each started twice — in this script's session,
and in a session of its own — and sent the same short requests one at a time (the engines'
dtype and the client's habits are options).

On Linux a session is a scheduler autogroup (`/proc/sys/kernel/sched_autogroup_enabled`): a
server in another session than its client shares the cores with it group against group. The
client here is this script, the requests are one at a time, so what is measured is each request's
latency with the server's processes in or out of the client's autogroup.

    python benchmarks/sessions.py --rounds 2 --out results/bench/sessions/default
    python benchmarks/sessions.py --rounds 2 --dtype float32 --fresh-client \
        --out results/bench/sessions/parity-like

Writes results.json (every request's seconds, per system, session and round) and prints the
medians. Runs take about 1.5 min per server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from pdserve.bench.compare import pdserve_server, plain_vllm_server  # noqa: E402
from pdserve.serve import resolve_model  # noqa: E402
from pdserve_core.config import PDServeConfig  # noqa: E402

PROMPTS = (
    "Complete this sentence with emojis: I love coding",
    "What colour is the sky? Answer in one sentence.",
    "Name three fruits.",
    "Write 'hello' in Russian, Greek and Hindi:",
    "The capital of France is",
    "Describe a party in one sentence.",
)


def autogroup(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().strip()
    except OSError:
        return "?"


def one(client: httpx.Client, url: str, model: str, i: int) -> None:
    """Request `i`: a completion or, every other one, a streamed chat; 12 tokens."""
    prompt = PROMPTS[i % len(PROMPTS)]
    if i % 2:
        body = {"model": model, "max_tokens": 12, "temperature": 0, "stream": True}
        body["messages"] = [{"role": "user", "content": prompt}]
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for _ in response.iter_lines():
                pass
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        client.post(f"{url}/v1/completions", json=body).raise_for_status()


def requests(url: str, count: int, fresh_client: bool) -> list[float]:
    """`count` requests, one at a time: each one's seconds, after two unrecorded.
    `fresh_client`: a new HTTP client for each request (its TLS context costs the client some
    10-30 ms of CPU), as the parity tests send."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    seconds = []
    with httpx.Client(timeout=120) as shared:
        for i in range(count + 2):
            began = time.perf_counter()
            if fresh_client:
                with httpx.Client(timeout=120) as client:
                    one(client, url, model, i)
            else:
                one(shared, url, model, i)
            if i >= 2:
                seconds.append(time.perf_counter() - began)
    return seconds


def server(system: str, work: Path, own_session: bool, dtype: str):
    if system == "vllm":
        model = resolve_model(PDServeConfig())
        return plain_vllm_server(model, model.name, work, dtype=dtype, own_session=own_session)
    config = work / "pdserve.yaml"
    config.write_text(json.dumps({"engine": {"dtype": dtype}}))  # JSON is YAML
    return pdserve_server(config, work, own_session=own_session)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", default=["pdserve", "vllm"])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="native", help="every engine's (engine.dtype)")
    parser.add_argument("--fresh-client", action="store_true", help="a new client per request")
    parser.add_argument("--out", type=Path, default=REPO / "results/bench/sessions")
    args = parser.parse_args()
    enabled = Path("/proc/sys/kernel/sched_autogroup_enabled")
    results = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "autogroup_enabled": enabled.read_text().strip() if enabled.exists() else None,
        "host": os.uname().release,
        "runs": [],
    }
    for round_ in range(args.rounds):
        order = [(s, own) for s in args.systems for own in (False, True)]
        for system, own in order if round_ % 2 == 0 else order[::-1]:
            with (
                tempfile.TemporaryDirectory() as work,
                server(system, Path(work), own, args.dtype) as url,
            ):
                seconds = requests(url, args.requests, args.fresh_client)
            session = "own" if own else "shared"
            run = {"system": system, "session": session, "round": round_ + 1, "seconds": seconds}
            results["runs"].append(run)
            print(f"round {round_ + 1} {system:8s} {session:6s} session: median "
                  f"{statistics.median(seconds) * 1000:.0f} ms", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'results.json'} (this script's autogroup: {autogroup(os.getpid())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
