"""Ray's token stays its owner's: `pdserve serve` starts Ray under umask 0077 (pdserve/serve.py,
`ray_token_private`), so the token Ray writes, ~/.ray/auth_token, is 0600 in a 0700 folder. A
real Ray with token authentication, in a subprocess with a home folder of its own."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import REPO

SCRIPT = r"""
import stat
from pathlib import Path
import ray
from pdserve_core.config import PDServeConfig
from pdserve.serve import _init_ray

_init_ray(PDServeConfig.model_validate({"ray": {"num_cpus": 1}}))
token = Path.home() / ".ray" / "auth_token"
modes = [oct(stat.S_IMODE(path.stat().st_mode)) for path in (token, token.parent)]
print("MODES", *modes)
ray.shutdown()
"""


def test_the_token_ray_writes_is_readable_by_its_owner_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN_PATH"}
    with tempfile.TemporaryDirectory(prefix="pdr-", dir="/tmp") as short:  # socket paths: short
        env |= {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_TMPDIR": short}
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            cwd=REPO,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("MODES")]
    assert line.split()[1:] == ["0o600", "0o700"]


def test_a_token_found_readable_is_made_private(tmp_path, monkeypatch):
    from pdserve.serve import ray_token_private

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir(mode=0o755)
    token.write_text("t")
    token.chmod(0o644)
    with ray_token_private():
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    elsewhere = tmp_path / "cluster-token"  # RAY_AUTH_TOKEN_PATH: that file, its folder as it is
    elsewhere.write_text("t")
    elsewhere.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(elsewhere))
    with ray_token_private():
        pass
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o600


pytestmark = pytest.mark.sockets
