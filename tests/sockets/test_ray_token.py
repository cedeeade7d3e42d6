"""Ray's token stays its owner's: `pdserve serve` starts Ray under umask 0077 (pdserve/serve.py,
`ray_token_private`), so the token Ray writes, ~/.ray/auth_token, is 0600 in a 0700 folder; and
its router processes have Ray's token authentication. A real Ray with token authentication, in a
subprocess with a home folder of its own."""

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


def _in_a_home_of_its_own(script: str, home, **env: str) -> list[str]:
    """Run `script` with Ray's auth settings only as `env` gives them and a home folder of its
    own (Ray's token file is ~/.ray/auth_token); its stdout's lines."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    with tempfile.TemporaryDirectory(prefix="pdr-", dir="/tmp") as short:  # socket paths: short
        base |= {"HOME": str(home), "RAY_TMPDIR": short, **env}
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=base,
            timeout=180,
            cwd=REPO,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_the_token_ray_writes_is_readable_by_its_owner_only(tmp_path):
    said = _in_a_home_of_its_own(SCRIPT, tmp_path, RAY_AUTH_MODE="token")
    (line,) = [line for line in said if line.startswith("MODES")]
    assert line.split()[1:] == ["0o600", "0o700"]


SPAWN_AFTER_RAY = r"""
import psutil, ray
from pdserve_core.config import PDServeConfig
from pdserve.routers import started_ahead
from pdserve.serve import _init_ray

_init_ray(PDServeConfig.model_validate({"ray": {"num_cpus": 1}}))
with started_ahead(1) as (runner, (router,)):
    print("MODE", psutil.Process(router.pid).environ().get("RAY_AUTH_MODE"))
ray.shutdown()
"""


def test_a_router_started_after_ray_has_its_token_authentication(tmp_path):
    """With RAY_AUTH_MODE unset (Ray's default: token authentication for a new local cluster),
    Ray turns token mode on in the environment of the process that starts it; a router joins
    with a Ray address (no auto-detection), so only that environment tells it to send the
    token. `pdserve serve` starts its router processes after Ray for this
    (tests/sockets/test_serve_start.py checks the order): one started before Ray could not join
    (seen: `InvalidAuthToken`)."""
    assert "MODE token" in _in_a_home_of_its_own(SPAWN_AFTER_RAY, tmp_path)


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
