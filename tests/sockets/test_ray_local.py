"""`pdserve serve` without an address starts a Ray of its own, even where `ray start` left a
cluster's address behind (Ray's `ray_current_cluster` file, which a bare `ray.init()` joins)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

START = """
import ray
from pdserve_core.config import PDServeConfig
from pdserve.serve import _init_ray
assert _init_ray(PDServeConfig()) is True
pools = ray.cluster_resources()
print("OWN", pools.get("prefill_pool"), pools.get("decode_pool"))
ray.shutdown()
"""


def test_serve_starts_its_own_ray_whatever_cluster_the_machine_last_started():
    with tempfile.TemporaryDirectory(prefix="pdr-", dir="/tmp") as short:  # socket paths: short
        (Path(short) / "ray").mkdir()
        (Path(short) / "ray/ray_current_cluster").write_text("127.0.0.1:1\n")  # nobody there
        env = dict(os.environ, RAY_TMPDIR=short, RAY_AUTH_MODE="disabled")
        done = subprocess.run(
            [sys.executable, "-c", START], capture_output=True, text=True, env=env, timeout=120
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OWN 1.0 1.0" in done.stdout


EARLY_CLOSE = """
import asyncio, time
import ray
from pdserve_core.engine.legs import Whole
from pdserve_core.engine.types import TokenDelta
from router.links.ray_nodes import RayNodeClient

@ray.remote
class Node:
    def __init__(self):
        self.ended = None

    async def stream(self, leg):
        try:
            yield TokenDelta([1], "a", finish_reason="length", index=0)  # sequence 0 is done
            await asyncio.sleep(3600)  # sequence 1 still decoding
            yield TokenDelta([2], "b", finish_reason="length", index=1)
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise

    async def ended_how(self):
        return self.ended

async def main():
    node = Node.remote()
    client = RayNodeClient(node, direct=False)  # Ray streaming calls (router.token_stream: ray)
    stream = client.stream(Whole("r1", [1], None))
    first = await anext(stream)
    assert first.finish_reason == "length" and first.index == 0
    await stream.aclose()  # the caller leaves while sequence 1 runs
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if await node.ended_how.remote() == "cancelled":
            print("CANCELLED")
            return
        await asyncio.sleep(0.1)
    print("STILL RUNNING")

ray.init(num_cpus=1, include_dashboard=False)
asyncio.run(main())
ray.shutdown()
"""


def test_a_caller_leaving_after_one_of_n_sequences_ended_stops_the_rest_on_the_node():
    with tempfile.TemporaryDirectory(prefix="pdr-", dir="/tmp") as short:
        env = dict(os.environ, RAY_TMPDIR=short, RAY_AUTH_MODE="disabled")
        done = subprocess.run(
            [sys.executable, "-c", EARLY_CLOSE],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            cwd=Path(__file__).resolve().parents[2],
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CANCELLED" in done.stdout, done.stdout[-2000:]
