"""KV transport throughput against a raw socket on the same machine, in the same run.

The sending side runs in its own process (as a prefill worker would), the receiving side here.
For each payload size: (a) raw TCP, the ceiling: connect, one sendall of a buffer into one
recv_into of a preallocated buffer, same socket buffer sizes; (b) pdserve's TCP transport: a full
pull (connect, mutual HMAC authentication, layout handshake, signed lease, control messages) of
that many bytes of KV blocks laid out like SmolLM2-135M's CPU cache (30 layers, 96 KiB per
block per layer), with scattered block ids so every block of every layer is its own run;
(c) pdserve's NIXL transport: the same pull, the blocks READ by NIXL's UCX backend out of the
sender's registered cache (UCX picks its transports unless --ucx-tls says, e.g. `tcp`).
Each figure is the median of --repeats transfers. Prints a table and writes a JSON file:
    python benchmarks/kv_transport.py [--sizes-mib 16 64 256] [--repeats 9] [--ucx-tls tcp]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import socket
import statistics
import struct
import time
from pathlib import Path

LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM = 30, 3, 128, 64
BLOCK_BYTES = HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2  # bf16
SECRET = b"bench-secret"
TRANSPORTS = ("tcp", "nixl")


def caches(num_blocks: int, fill: bool):
    import torch

    shape = (num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    if fill:
        return {f"layer.{i}": torch.randn(shape).to(torch.bfloat16) for i in range(LAYERS)}
    # touched, like a serving engine's cache after warm-up (untouched pages would charge the
    # transport for first-touch page faults that the raw baseline's buffer never pays)
    return {f"layer.{i}": torch.empty(shape, dtype=torch.bfloat16).fill_(1) for i in range(LAYERS)}


def plane(kv, transport: str):
    from pdserve_core.kv.layout import describe
    from pdserve_core.kv.transport import plane_class

    layout = describe(kv, "bench", BLOCK_SIZE, HEADS, HEAD_DIM, 0, 1, transport)
    return plane_class(transport)(layout, kv)


def serve(max_blocks: int, ports, stop) -> None:
    """Child process: a raw sender and pdserve KV servers (tcp, nixl) over the same cache."""
    import threading

    from pdserve_core.kv.stats import TransferStats
    from pdserve_core.kv.transport.tcp import _tune
    from prefill_node.kv_server import KVServer
    from prefill_node.leases import ProducerTable

    kv = caches(max_blocks, fill=True)
    kv_ports = {}
    for transport in TRANSPORTS:
        server = KVServer(plane(kv, transport), ProducerTable(), lambda: SECRET, TransferStats())
        kv_ports[transport] = server.start()
    payload = bytearray(b"\x01" * (max_blocks * BLOCK_BYTES * LAYERS))
    raw = socket.create_server(("127.0.0.1", 0))

    def raw_loop() -> None:
        while True:
            conn, _ = raw.accept()
            with conn:
                _tune(conn)
                (size,) = struct.unpack(">Q", conn.recv(8, socket.MSG_WAITALL))
                conn.sendall(memoryview(payload)[:size])
                conn.recv(1)

    threading.Thread(target=raw_loop, daemon=True).start()
    ports.put((raw.getsockname()[1], kv_ports))
    stop.wait()


def raw_transfer(port: int, nbytes: int, target: memoryview) -> float:
    from pdserve_core.kv.transport.tcp import _tune
    from pdserve_core.kv.wire import recv_exact_into

    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as client:
        _tune(client)
        client.sendall(struct.pack(">Q", nbytes))
        recv_exact_into(client, target[:nbytes])
        elapsed = time.perf_counter() - started
        client.sendall(b"k")
    return elapsed


def pdserve_pull(client, port: int, num_blocks: int, max_blocks: int, rng, transport) -> float:
    from pdserve_core.kv.handle import KVHandle
    from pdserve_core.kv.wire import lease_token

    remote = rng.sample(range(max_blocks), num_blocks)
    local = rng.sample(range(max_blocks), num_blocks)
    rid, deadline = f"bench-{rng.random()}", time.time() + 60
    handle = KVHandle(
        "127.0.0.1",
        (port,),
        rid,
        tuple(remote),
        num_blocks * BLOCK_SIZE,
        deadline,
        "bench",
        transport,
        lease_token(SECRET, "", rid, remote, deadline, 1),
    )
    started = time.perf_counter()
    client.pull(handle, remote, local, 0, time.monotonic() + 60)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="results/kv_transport.json")
    parser.add_argument("--ucx-tls", help="UCX_TLS for the nixl transport (default: UCX picks)")
    args = parser.parse_args()
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # before either side starts UCX (the child inherits)

    from decode_node.kv_client import KVClient

    sizes = {mib: -(-mib * 2**20 // (BLOCK_BYTES * LAYERS)) for mib in args.sizes_mib}
    max_blocks = max(sizes.values())
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(max_blocks, ports, stop), daemon=True)
    server.start()
    raw_port, kv_ports = ports.get(timeout=120)
    local = caches(max_blocks, fill=False)
    clients = {t: KVClient(plane(local, t), lambda: SECRET) for t in TRANSPORTS}
    target = memoryview(bytearray(b"\x01" * (max_blocks * BLOCK_BYTES * LAYERS)))
    rng = random.Random(0)
    rows = []
    heads = ("payload", 9), ("raw GB/s", 9), ("tcp GB/s", 9), ("ratio", 6), ("nixl GB/s", 10)
    print(" ".join(f"{name:>{width}}" for name, width in heads), f"{'ratio':>6}")
    try:
        for num_blocks in sizes.values():
            nbytes = num_blocks * BLOCK_BYTES * LAYERS
            raw, ours = [], {t: [] for t in TRANSPORTS}
            for _ in range(args.repeats):  # interleaved, so all see the same machine load
                raw.append(raw_transfer(raw_port, nbytes, target))
                for t in TRANSPORTS:
                    ours[t].append(
                        pdserve_pull(clients[t], kv_ports[t], num_blocks, max_blocks, rng, t)
                    )
            row = {
                "payload_bytes": nbytes,
                "blocks": num_blocks,
                "runs_per_pull": num_blocks * LAYERS,
                "raw_gbps": nbytes / statistics.median(raw) / 1e9,
            }
            for t in TRANSPORTS:
                row[f"pdserve_{t}_gbps"] = nbytes / statistics.median(ours[t]) / 1e9
                row[f"{t}_ratio"] = row[f"pdserve_{t}_gbps"] / row["raw_gbps"]
            rows.append(row)
            print(
                f"{nbytes / 2**20:>6.0f} MiB {row['raw_gbps']:>9.2f} "
                f"{row['pdserve_tcp_gbps']:>9.2f} {row['tcp_ratio']:>6.2f} "
                f"{row['pdserve_nixl_gbps']:>10.2f} {row['nixl_ratio']:>6.2f}"
            )
    finally:
        stop.set()
        server.join(timeout=10)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores, loopback",
                "ucx_tls": args.ucx_tls or "UCX's choice",
                "repeats": args.repeats,
                "statistic": "median",
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"written to {out}")


if __name__ == "__main__":
    main()
