"""The token plane and tenants, tried as a hostile peer and a second tenant would, on a real
`pdserve serve` (the default 1P1D, with prompt-token details on so usage shows cache hits).

Phases:
- baseline: normal requests alone (a 4-token completion over HTTP and over gRPC, the median of
  --samples each);
- hostile: N connections to the nodes' token-stream ports (read from the router's log), each
  sending 32 random bytes (what a channel key used to be) and then nothing; the normal requests
  again beside them; how many the nodes still hold after their hello deadline;
- junk: 8 connections to each node sending 64 MiB each; the engine actors' RSS before and after;
- tenants: for each way the decode node samples the first token (a stop string, n = 2, a
  structured output, a seed) and for a plain greedy request, tenant A sends a 400-token prompt
  with a `cache_salt`, tenant B the same prompt without: B's `cached_tokens` (0 expected).
The delay a phase adds is its median minus the baseline's (the target: at most 100 ms).
Prints a summary and writes results/token_plane.json:
    python benchmarks/token_plane.py [--connections 1000] [--samples 15]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.connections import API_KEY, close_all, medians, still_open  # noqa: E402
from tests.e2e.conftest import finish_server, start_server  # noqa: E402

STREAM_OPEN = re.compile(r"token stream to (\S+) open \((\S+):(\d+)\)")
ENGINE_UP = re.compile(r"engine (\S+) up in \S+ s \(pid (\d+)\)")
JUNK_BYTES = 64 << 20


def token_ports(server) -> list[tuple[str, int]]:
    """The nodes' token-stream listeners, as the router's log names them once it connected."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = {(m[2], int(m[3])) for m in STREAM_OPEN.finditer(server.log.read_text())}
        if len(found) >= 2:
            return sorted(found)
        time.sleep(0.2)
    raise RuntimeError("the router's log names no token streams")


def actor_rss_mib(server) -> dict[str, float]:
    import psutil

    pids = {m[1]: int(m[2]) for m in ENGINE_UP.finditer(server.log.read_text())}
    return {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}


def hostile(ports: list[tuple[str, int]], count: int) -> list[socket.socket]:
    opened = []
    for i in range(count):
        try:
            raw = socket.create_connection(ports[i % len(ports)], timeout=10)
            raw.sendall(os.urandom(32))
        except OSError:  # refused at once past the caps: that is the point
            continue
        opened.append(raw)
    return opened


def junk(ports: list[tuple[str, int]]) -> int:
    """8 connections per node, each offering 64 MiB; the bytes the nodes took in all."""
    taken = 0
    chunk = os.urandom(1 << 20)
    for address in ports:
        for _ in range(8):
            try:
                with socket.create_connection(address, timeout=5) as raw:
                    raw.settimeout(5)
                    for _ in range(JUNK_BYTES // len(chunk)):
                        taken += raw.send(chunk)
            except OSError:
                pass  # closed by the node once it read what a proof may hold
    return taken


def tenants(server) -> dict[str, int]:
    """B's cached tokens after A's salted send, per sampling path."""
    import httpx

    from tests.conftest import REPO as repo

    words = (repo / "docs/design.md").read_text().split()
    ways = {
        "greedy": {},
        "stop": {"stop": ["@@@@"]},
        "n2": {"n": 2, "temperature": 1.0, "seed": 3},
        "structured": {"structured_outputs": {"choice": ["yes", "no"]}},
        "seed": {"temperature": 1.0, "seed": 3},
    }
    found = {}
    for i, (way, fields) in enumerate(ways.items()):
        prompt = f"{way} {i}: " + " ".join(words[400 * i + 1000 : 400 * i + 1300])
        body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        url, headers = f"{server.url}/v1/completions", server.headers
        salted = {**body, **fields, "cache_salt": f"tenant-a-{way}"}
        httpx.post(url, json=salted, headers=headers, timeout=120).raise_for_status()
        twin = httpx.post(url, json=body, headers=headers, timeout=120)
        twin.raise_for_status()
        usage = twin.json()["usage"]
        found[way] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        found[f"{way}_prompt_tokens"] = usage["prompt_tokens"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--out", default=str(REPO / "results/token_plane.json"))
    args = parser.parse_args()
    found: dict = {"connections": args.connections, "samples": args.samples}
    with tempfile.TemporaryDirectory(prefix="pdserve-token-plane-") as work:
        config = Path(work) / "pdserve.yaml"
        config.write_text(f"router: {{api_key: {API_KEY}, enable_prompt_tokens_details: true}}\n")
        server = start_server(Path(work), "--config", str(config), api_key=API_KEY)
        try:
            medians(server, 3)  # warm-up: the router's token streams are open after it
            ports = token_ports(server)
            found["baseline"] = medians(server, args.samples)
            flood = hostile(ports, args.connections)
            found["hostile"] = medians(server, args.samples)
            found["hostile_accepted"] = len(flood)
            found["hostile_open_after_7s"] = still_open(flood, 7.0)
            close_all(flood)
            found["rss_before_junk_mib"] = actor_rss_mib(server)
            found["junk_bytes_taken"] = junk(ports)
            found["rss_after_junk_mib"] = actor_rss_mib(server)
            found["after_junk"] = medians(server, 3)
            found["twin_cached_tokens"] = tenants(server)
        finally:
            finish_server(server)
    base = found["baseline"]
    for phase in ("hostile",):
        found[phase]["http_delay_s"] = found[phase]["http_s"] - base["http_s"]
        found[phase]["grpc_delay_s"] = found[phase]["grpc_s"] - base["grpc_s"]
    Path(args.out).write_text(json.dumps(found, indent=2) + "\n")
    print(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
