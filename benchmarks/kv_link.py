"""KV transfer across a link between two hosts, against the link's shaped rate.

Two emulated hosts (network namespaces, `pdserve hosts`; root): a prefill-like producer on one
with a KV server over SmolLM2-135M-shaped CPU caches (30 layers, 96 KiB per block per layer,
bf16), a consumer on the other pulling whole requests' blocks. The producer host's link is
shaped with tc htb (both ways) to each rate in turn; each figure is the median of --repeats
pulls (connect, authentication, handshake and lease included), per transport (tcp, gloo, nixl
over UCX's TCP transport).
Prints a table and writes results/kv_link.json:
    python benchmarks/kv_link.py [--rates 1gbit 10gbit] [--mib 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM = 30, 3, 128, 64
BLOCK_BYTES = HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2
SECRET = b"bench-secret"
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def rate_bytes(rate: str) -> float:
    for unit, scale in UNITS.items():
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * scale / 8
    raise ValueError(rate)


def _plane(transport: str, blocks: int, fill: bool):
    import torch

    from pdserve_core.kv.layout import describe
    from pdserve_core.kv.settings import ConnectorSettings
    from pdserve_core.kv.transport import plane_class

    shape = (blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    kv = {
        f"layer.{i:02d}": (torch.randn(shape) if fill else torch.ones(shape)).to(torch.bfloat16)
        for i in range(LAYERS)
    }
    layout = describe(kv, "bench", BLOCK_SIZE, HEADS, HEAD_DIM, 0, 1, transport)
    # nixl: UCX over TCP, so the bytes cross the shaped link (on one machine UCX would otherwise
    # read the other namespace's memory directly)
    settings = ConnectorSettings(ucx={"TLS": "tcp"})
    return plane_class(transport).from_settings(layout, kv, settings)


def producer(transport: str, host: str, blocks: str, pulls: str) -> None:
    """On the producer host: serve `pulls` pulls of all `blocks`, then exit."""
    from pdserve_core.kv.stats import TransferStats
    from prefill_node.kv_server import KVServer
    from prefill_node.leases import ProducerTable

    count, table = int(blocks), ProducerTable()
    server = KVServer(_plane(transport, count, True), table, lambda: SECRET, TransferStats(), host)
    port = server.start()
    for pull in range(int(pulls)):
        table.offer(f"r{pull}", list(range(count)), time.time() + 600)
    print(f"PORT {port}", flush=True)
    done, deadline = set(), time.monotonic() + 600
    while len(done) < int(pulls) and time.monotonic() < deadline:
        done |= table.collect_done()
        time.sleep(0.05)
    server.close()


def consumer(transport: str, host: str, port: str, blocks: str, pulls: str) -> None:
    """On the consumer host: pull each request's blocks; print the seconds of each pull."""
    from decode_node.kv_client import KVClient
    from pdserve_core.kv.handle import KVHandle

    count = int(blocks)
    client = KVClient(_plane(transport, count, False), lambda: SECRET)
    seconds = []
    for pull in range(int(pulls)):
        handle = KVHandle(host, (int(port),), f"r{pull}", tuple(range(count)), count * BLOCK_SIZE,
                          time.time() + 600, "bench", transport)  # fmt: skip
        started = time.monotonic()
        client.pull(handle, list(range(count)), list(range(count)), 0, time.monotonic() + 300)
        seconds.append(time.monotonic() - started)
    print(json.dumps(seconds))


def measure(hosts, transport: str, blocks: int, repeats: int) -> list[float]:
    me = [sys.executable, __file__]
    server = hosts.popen("prod", [*me, "producer", transport, hosts.address("prod"), str(blocks),
                                  str(repeats + 1)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port = server.stdout.readline().split()[1]
        pulled = hosts.run(
            "cons", [*me, "consumer", transport, hosts.address("prod"), port, str(blocks),
                     str(repeats + 1)], capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if pulled.returncode != 0:
            raise RuntimeError(pulled.stderr[-3000:])
        return json.loads(pulled.stdout.splitlines()[-1])[1:]  # the first pull pairs and warms up
    finally:
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--mib", type=int, default=64, help="payload per pull")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", nargs="+", default=["tcp", "gloo", "nixl"])
    parser.add_argument("--out", default=str(REPO / "results/kv_link.json"))
    args = parser.parse_args()

    from pdserve.hosts import EmulatedCluster, HostsError

    try:
        EmulatedCluster.find("pdb").down()
    except HostsError:
        pass
    hosts = EmulatedCluster.up(["prod", "cons"], "pdb", "127.104.0.0/24")
    blocks = max(1, args.mib * 2**20 // (BLOCK_BYTES * LAYERS))
    payload = blocks * BLOCK_BYTES * LAYERS
    rows = []
    try:
        for rate in [*args.rates, "none"]:
            hosts.shape("prod", None if rate == "none" else rate)
            for transport in args.transports:
                seconds = statistics.median(measure(hosts, transport, blocks, args.repeats))
                achieved = payload / seconds
                shaped = None if rate == "none" else rate_bytes(rate)
                rows.append({
                    "rate": rate, "transport": transport, "payload_bytes": payload,
                    "seconds": seconds, "bytes_per_s": achieved,
                    "ratio_to_link": achieved / shaped if shaped else None,
                })  # fmt: skip
                ratio = f"{achieved / shaped:.2f}" if shaped else "-"
                size = f"{payload / 2**20:6.0f} MiB"
                speed = f"{seconds * 1e3:8.1f} ms {achieved / 1e9:6.3f} GB/s"
                print(f"{rate:>7} {transport:>5} {size} {speed}  x link {ratio}")
    finally:
        hosts.down()
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("producer", "consumer"):
        {"producer": producer, "consumer": consumer}[sys.argv[1]](*sys.argv[2:])
    else:
        main()
