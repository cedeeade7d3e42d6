"""`pdserve serve` without an address starts a Ray of its own, even where `ray start` left a
cluster's address behind (Ray's `ray_current_cluster` file, which a bare `ray.init()` joins).
(A caller leaving a Ray streaming call early: tests/sockets/test_token_stream.py, EARLY_CLOSE.)"""

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
