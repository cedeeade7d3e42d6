"""A prefill node's KV server on the nixl plane, as its own process, for
tests/sockets/test_kv_nixl.py. It prints `PORT n`, then obeys one command per stdin line:

offer REQUEST BLOCKS LEASE_S   offer these blocks (comma-separated) for LEASE_S seconds
done                           print the requests whose pulls completed, as a JSON list
freeze                         from now on, stop this process (SIGSTOP) when it offers blocks,
                               before it serves their READ
Its KV cache is `caches(seed=1)` of the test module, so the test knows every byte.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve_core.kv.stats import TransferStats  # noqa: E402
from prefill_node.kv_server import KVServer  # noqa: E402
from prefill_node.leases import ProducerTable  # noqa: E402
from tests.sockets.test_kv_nixl import caches, plane  # noqa: E402


def main() -> None:
    kv, table = caches(seed=1), ProducerTable()
    side = plane(kv)
    server = KVServer(side, table, lambda: b"secret", TransferStats(), engine_id="e")
    print(f"PORT {server.start()}", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "offer":
            request, blocks, lease_s = args
            table.offer(request, [int(b) for b in blocks.split(",")], time.time() + float(lease_s))
            print("ok", flush=True)
        elif command == "done":
            print(json.dumps(sorted(table.collect_done())), flush=True)
        elif command == "freeze":

            def stop(*args, **kwargs):  # the first progress after an offer
                os.kill(os.getpid(), signal.SIGSTOP)

            side.agent.get_new_notifs = stop
            print("ok", flush=True)


if __name__ == "__main__":
    main()
