"""pdserve's nixl plane on device memory: a KV server in one process, a client in another, the
blocks READ by NIXL from one CUDA cache into the other (UCX's cuda_ipc / cuda_copy on one GPU),
every byte compared, throughput per payload. `--plane tcp` runs pdserve's TCP plane instead (each
run staged through a host buffer on both sides), the figure NIXL replaces. The device check for a
lent GPU machine; with `--device cpu` the same run on host memory (a smoke test anywhere).

    python benchmarks/nixl_gpu.py [--device cuda] [--plane nixl|tcp] [--sizes-mib 16 64 256]
        [--repeats 5] [--out results/nixl_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM = 30, 3, 128, 64
BLOCK_BYTES = HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2  # bf16
SECRET = b"gpu-check-secret"


def caches(num_blocks: int, device: str, seed: int | None):
    import torch

    shape = (num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    if seed is None:
        return {f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16, device=device)
                for i in range(LAYERS)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
            for i in range(LAYERS)}  # fmt: skip


def plane(kv, kind: str = "nixl"):
    from pdserve_core.kv.layout import describe

    layout = describe(kv, "check", BLOCK_SIZE, HEADS, HEAD_DIM, 0, 1, kind)
    if kind == "tcp":
        from pdserve_core.kv.transport.tcp import TcpPlane

        return TcpPlane(layout, kv)
    from pdserve_core.kv.transport.nixl import NixlPlane

    return NixlPlane(layout, kv)


def serve(num_blocks: int, device: str, kind: str, offers, ports, stop) -> None:
    """Child process: the producer, offering what the parent asks for."""
    import threading

    from pdserve_core.kv.stats import TransferStats
    from prefill_node.kv_server import KVServer
    from prefill_node.leases import ProducerTable

    table = ProducerTable()
    server = KVServer(plane(caches(num_blocks, device, seed=1), kind), table, lambda: SECRET,
                      TransferStats(), engine_id="check")  # fmt: skip
    ports.put(server.start())

    def offer_loop() -> None:
        while True:
            request, blocks = offers.get()
            table.offer(request, blocks, time.time() + 60)
            ports.put("ok")

    threading.Thread(target=offer_loop, daemon=True).start()
    stop.wait()
    server.close()


def answer(ports, child, timeout_s: float):
    """The producer's next answer; an error as soon as it has died (a plane that failed to start)
    rather than at the deadline."""
    import queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return ports.get(timeout=0.5)
        except queue.Empty:
            if not child.is_alive():
                raise SystemExit(f"the producer exited ({child.exitcode}), error above") from None
    raise SystemExit(f"the producer did not answer in {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--plane", choices=("nixl", "tcp"), default="nixl")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/nixl_gpu.json")
    args = parser.parse_args()

    import torch

    from decode_node.kv_client import KVClient
    from pdserve_core.kv.handle import KVHandle

    sizes = {mib: -(-mib * 2**20 // (BLOCK_BYTES * LAYERS)) for mib in args.sizes_mib}
    num_blocks = max(sizes.values()) * 2
    ctx = multiprocessing.get_context("spawn")
    offers, ports, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    child = ctx.Process(
        target=serve, args=(num_blocks, args.device, args.plane, offers, ports, stop)
    )
    child.start()
    port = answer(ports, child, 300)
    local = caches(num_blocks, args.device, seed=None)
    side = plane(local, args.plane)
    client = KVClient(side, lambda: SECRET)
    source = caches(num_blocks, "cpu", seed=1)  # the producer's bytes, to compare with
    rows, pulls = [], 0
    try:
        for blocks in sizes.values():
            seconds = []
            for _ in range(args.repeats):
                pulls += 1
                remote = list(range(blocks))
                local_ids = list(range(num_blocks - blocks, num_blocks))
                request = f"check-{pulls}"
                offers.put((request, remote))
                assert answer(ports, child, 30) == "ok"
                handle = KVHandle("127.0.0.1", (port,), request, tuple(remote), blocks,
                                  time.time() + 60, "check", args.plane)  # fmt: skip
                started = time.perf_counter()
                client.pull(handle, remote, local_ids, 0, time.monotonic() + 60)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - started)
                for name in source:
                    got = local[name][local_ids].cpu()
                    assert torch.equal(got, source[name][remote]), f"{name} differs"
                    local[name].zero_()
            nbytes = blocks * BLOCK_BYTES * LAYERS
            row = {"payload_bytes": nbytes, "gbps": nbytes / statistics.median(seconds) / 1e9}
            rows.append(row)
            print(f"{nbytes / 2**20:>6.0f} MiB  {row['gbps']:6.2f} GB/s  (every byte equal)")
    finally:
        stop.set()
        child.join(timeout=30)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    record = {
        "device": device,
        "plane": args.plane,
        "memory": args.device,
        "repeats": args.repeats,
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
