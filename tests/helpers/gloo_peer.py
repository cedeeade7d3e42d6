"""One side of a gloo KV transfer, run as its own process by tests/sockets/test_kv_gloo.py:

gloo_peer.py send-then-die HEX_PAIR_ID   join as the producer, send one run, exit at once
gloo_peer.py serve HOST OUT.json         a KV server on HOST for two pulls; digests to OUT
gloo_peer.py pull HOST PORT              pull both from HOST:PORT; digests as a JSON line
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.sockets.test_kv_gloo import caches, handle, plane  # noqa: E402

PULLS = {"r0": ([1, 2, 7], [0, 3, 4]), "r1": ([5, 6], [8, 9])}


def digest(kv, blocks: list[int]) -> str:
    out = hashlib.sha256()
    for name in sorted(kv):
        out.update(kv[name][blocks].contiguous().view(-1).view(dtype=__import__("torch").uint8)
                   .numpy().tobytes())  # fmt: skip
    return out.hexdigest()


def send_then_die(pair_id_hex: str) -> None:
    kv = caches(seed=1)
    side = plane(kv)
    backend = side.pairing.backend
    comm = backend.join(bytes.fromhex(pair_id_hex), 0, "127.0.0.1", time.monotonic() + 30)
    first = next(side.runs([0, 1, 2])).reshape(-1).view(__import__("torch").uint8)
    comm.group.send([first], 1, 0).wait()
    os._exit(1)  # the process dies with the rest of the transfer unsent


def serve(host: str, out: str) -> None:
    from pdserve_core.kv.stats import TransferStats
    from prefill_node.kv_server import KVServer
    from prefill_node.leases import ProducerTable

    kv, table = caches(seed=1), ProducerTable()
    server = KVServer(plane(kv), table, lambda: b"secret", TransferStats(), host=host)
    port = server.start()
    for request, (remote, _) in PULLS.items():
        table.offer(request, remote, time.time() + 60)
    print(f"PORT {port}", flush=True)
    done, deadline = set(), time.monotonic() + 90
    while len(done) < len(PULLS) and time.monotonic() < deadline:
        done |= table.collect_done()
        time.sleep(0.05)
    digests = {r: digest(kv, remote) for r, (remote, _) in PULLS.items()}
    Path(out).write_text(json.dumps({"digests": digests, "done": sorted(done)}))
    server.close()


def pull(host: str, port: str) -> None:
    from decode_node.kv_client import KVClient

    kv = caches(seed=None)
    side = plane(kv)
    client = KVClient(side, lambda: b"secret")
    for request, (remote, local) in PULLS.items():
        client.pull(handle(host, int(port), request, remote), remote, local, 0,
                    time.monotonic() + 60)  # fmt: skip
    digests = {r: digest(kv, local) for r, (_, local) in PULLS.items()}
    print(json.dumps({"digests": digests, "pairs": len(side.pairing._by_key)}))


if __name__ == "__main__":
    {"send-then-die": send_then_die, "serve": serve, "pull": pull}[sys.argv[1]](*sys.argv[2:])
