"""KV transport throughput against a raw socket on the same machine, in the same run.

The sending side runs in its own process (as a prefill worker would), the receiving side here.
For each payload size: (a) raw TCP, the ceiling: connect, one sendall of a buffer into one
recv_into of a preallocated buffer, same socket buffer sizes; (b) pdserve's TCP transport: a full
pull (connect, mutual HMAC authentication, layout handshake, signed lease, control messages) of
that many bytes of KV blocks laid out like SmolLM2-135M's CPU cache (30 layers, 96 KiB per
block per layer), with scattered block ids so every block of every layer is its own run.
Each figure is the median of --repeats transfers. Prints a table and writes a JSON file:
    python benchmarks/kv_transport.py [--sizes-mib 16 64 256] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
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


def caches(num_blocks: int, fill: bool):
    import torch

    shape = (num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    if fill:
        return {f"layer.{i}": torch.randn(shape).to(torch.bfloat16) for i in range(LAYERS)}
    # touched, like a serving engine's cache after warm-up (untouched pages would charge the
    # transport for first-touch page faults that the raw baseline's buffer never pays)
    return {f"layer.{i}": torch.empty(shape, dtype=torch.bfloat16).fill_(1) for i in range(LAYERS)}


def layout_of(kv):
    from pdserve_core.kv.layout import describe

    return describe(kv, "bench", BLOCK_SIZE, HEADS, HEAD_DIM, 0, 1, "tcp")


def serve(max_blocks: int, ports, stop) -> None:
    """Child process: a raw sender and a pdserve KV server over the same cache memory."""
    import threading

    from pdserve_core.kv.stats import TransferStats
    from pdserve_core.kv.transport.tcp import TcpPlane, _tune
    from prefill_node.kv_server import KVServer
    from prefill_node.leases import ProducerTable

    kv = caches(max_blocks, fill=True)
    server = KVServer(TcpPlane(layout_of(kv), kv), ProducerTable(), lambda: SECRET, TransferStats())
    kv_port = server.start()
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
    ports.put((raw.getsockname()[1], kv_port))
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


def pdserve_pull(client, port: int, num_blocks: int, max_blocks: int, rng) -> float:
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
        "tcp",
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
    args = parser.parse_args()

    from decode_node.kv_client import KVClient
    from pdserve_core.kv.transport.tcp import TcpPlane

    sizes = {mib: -(-mib * 2**20 // (BLOCK_BYTES * LAYERS)) for mib in args.sizes_mib}
    max_blocks = max(sizes.values())
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(max_blocks, ports, stop), daemon=True)
    server.start()
    raw_port, kv_port = ports.get(timeout=120)
    local = caches(max_blocks, fill=False)
    client = KVClient(TcpPlane(layout_of(local), local), lambda: SECRET)
    target = memoryview(bytearray(b"\x01" * (max_blocks * BLOCK_BYTES * LAYERS)))
    rng = random.Random(0)
    rows = []
    print(f"{'payload':>9} {'raw GB/s':>9} {'pdserve GB/s':>13} {'ratio':>6}")
    try:
        for num_blocks in sizes.values():
            nbytes = num_blocks * BLOCK_BYTES * LAYERS
            raw, ours = [], []
            for _ in range(args.repeats):  # interleaved, so both see the same machine load
                raw.append(raw_transfer(raw_port, nbytes, target))
                ours.append(pdserve_pull(client, kv_port, num_blocks, max_blocks, rng))
            row = {
                "payload_bytes": nbytes,
                "blocks": num_blocks,
                "runs_per_pull": num_blocks * LAYERS,
                "raw_gbps": nbytes / statistics.median(raw) / 1e9,
                "pdserve_tcp_gbps": nbytes / statistics.median(ours) / 1e9,
            }
            row["ratio"] = row["pdserve_tcp_gbps"] / row["raw_gbps"]
            rows.append(row)
            print(
                f"{nbytes / 2**20:>6.0f} MiB {row['raw_gbps']:>9.2f} "
                f"{row['pdserve_tcp_gbps']:>13.2f} {row['ratio']:>6.2f}"
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
