"""A thousand idle or slow connections on the router's faces, and a normal request beside them.

Against a real `pdserve serve` (the default 1P1D, started here), phase by phase:
- baseline: normal requests alone — a non-streamed 4-token completion over HTTP, and the same
  over gRPC `Generate`, one at a time (--samples each);
- slow HTTP: N connections that send half a request head and stop, then the normal requests
  again; and how many of the N the router still holds after `router.header_timeout_s`;
- idle gRPC: N gRPC channels connected (TLS-less HTTP/2, settings exchanged) that make no call,
  plus N raw connections that never send the HTTP/2 preface; then the normal requests again, and
  how many raw ones are still open after the handshake bound.
The delay a phase adds is its median minus the baseline's (the target: at most 100 ms).
Prints a table and writes results/connections.json:
    python benchmarks/connections.py [--connections 1000] [--samples 15]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import finish_server, start_server  # noqa: E402

API_KEY = "bench-key"


def http_request_s(server) -> float:
    import httpx

    body = {"model": server.model, "prompt": "The sea is", "max_tokens": 4, "temperature": 0}
    started = time.monotonic()
    answer = httpx.post(
        f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60
    )
    answer.raise_for_status()
    return time.monotonic() - started


def grpc_request_s(server) -> float:
    import grpc

    from pdserve_proto.v1 import generate_pb2 as pb
    from pdserve_proto.v1 import generate_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(text="The sea is", sampling=pb.SamplingOptions(max_tokens=4))
    auth = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(server.grpc) as channel:
        started = time.monotonic()
        replies = list(pb_grpc.GenerationStub(channel).Generate(request, metadata=auth, timeout=60))
        assert replies[-1].usage.completion_tokens == 4
        return time.monotonic() - started


def medians(server, samples: int) -> dict:
    http = [http_request_s(server) for _ in range(samples)]
    grpc_ = [grpc_request_s(server) for _ in range(samples)]
    return {"http_s": statistics.median(http), "grpc_s": statistics.median(grpc_)}


def _address(url_or_address: str) -> tuple[str, int]:
    host, port = url_or_address.removeprefix("http://").rstrip("/").rsplit(":", 1)
    return host, int(port)


def slow_http(server, count: int) -> list[socket.socket]:
    address = _address(server.url)
    opened = []
    for _ in range(count):
        raw = socket.create_connection(address, timeout=10)
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")
        opened.append(raw)
    return opened


def silent_tcp(address: tuple[str, int], count: int) -> list[socket.socket]:
    return [socket.create_connection(address, timeout=10) for _ in range(count)]


def idle_grpc(server, count: int) -> list:
    import grpc

    channels = []
    for _ in range(count):
        channel = grpc.insecure_channel(
            server.grpc, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        grpc.channel_ready_future(channel).result(timeout=30)
        channels.append(channel)
    return channels


def still_open(sockets: list[socket.socket], within_s: float) -> int:
    """How many of `sockets` the server has not closed `within_s` from now (polled)."""
    deadline = time.monotonic() + within_s
    open_ = list(sockets)
    while open_ and time.monotonic() < deadline:
        left = []
        for raw in open_:
            raw.setblocking(False)
            try:
                if raw.recv(4096) == b"":
                    continue  # closed by the server
            except BlockingIOError:
                pass
            except OSError:
                continue
            left.append(raw)
        open_ = left
        time.sleep(0.2)
    return len(open_)


def close_all(things) -> None:
    for thing in things:
        thing.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--out", default=str(REPO / "results/connections.json"))
    args = parser.parse_args()
    found: dict = {"connections": args.connections, "samples": args.samples}
    with tempfile.TemporaryDirectory(prefix="pdserve-connections-") as work:
        config = Path(work) / "pdserve.yaml"
        config.write_text(f"router: {{api_key: {API_KEY}}}\n")
        server = start_server(Path(work), "--config", str(config), api_key=API_KEY)
        try:
            medians(server, 3)  # warm-up
            found["baseline"] = medians(server, args.samples)
            slow = slow_http(server, args.connections)
            found["slow_http"] = medians(server, args.samples)
            found["slow_http_open_after_12s"] = still_open(slow, 12.0)
            close_all(slow)
            channels = idle_grpc(server, args.connections)
            silent = silent_tcp(_address(server.grpc), args.connections)
            found["idle_grpc"] = medians(server, args.samples)
            found["silent_grpc_open_after_12s"] = still_open(silent, 12.0)
            close_all(silent)
            close_all(channels)
        finally:
            finish_server(server)
    base = found["baseline"]
    for phase in ("slow_http", "idle_grpc"):
        found[phase]["http_delay_s"] = found[phase]["http_s"] - base["http_s"]
        found[phase]["grpc_delay_s"] = found[phase]["grpc_s"] - base["grpc_s"]
    Path(args.out).write_text(json.dumps(found, indent=2) + "\n")
    print(f"{args.connections} connections; median of {args.samples} normal requests each:")
    print(f"  {'phase':12s} {'HTTP':>9s} {'gRPC':>9s} {'HTTP +':>9s} {'gRPC +':>9s}")
    for phase in ("baseline", "slow_http", "idle_grpc"):
        row = found[phase]
        extra = [row.get("http_delay_s", 0.0), row.get("grpc_delay_s", 0.0)]
        print(f"  {phase:12s} {row['http_s'] * 1e3:7.1f}ms {row['grpc_s'] * 1e3:7.1f}ms "
              f"{extra[0] * 1e3:+7.1f}ms {extra[1] * 1e3:+7.1f}ms")  # fmt: skip
    print(f"  slow HTTP connections still open 12 s later: {found['slow_http_open_after_12s']}")
    print(f"  silent gRPC connections still open 12 s later: {found['silent_grpc_open_after_12s']}")


if __name__ == "__main__":
    main()
