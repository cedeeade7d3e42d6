"""How `pdserve serve` starts (pdserve/serve.py): vLLM's front checks the front-end flags while
Ray starts, and a bad one stops the start before any engine, Ray taken down; router processes
(`router.replicas`, pdserve/routers.py) start ahead and wait for their task while the engines
start, and none outlives a start that failed before the keeper took it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pdserve.routers import started_ahead
from pdserve_core.config import PDServeConfig
from tests.conftest import REPO


def _processes_of(work: Path) -> list[psutil.Process]:
    """Every process started with `VLLM_RPC_BASE_PATH=work` (the server and what it started)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("VLLM_RPC_BASE_PATH") == str(work):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_bad_front_flag_stops_the_start_before_any_engine_and_takes_ray_down(tmp_path):
    ready = tmp_path / "ready.json"
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", "--grpc-port", "0"]
        + ["--ready-file", str(ready), "--set", 'router.vllm_args=["--no-such-flag"]'],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, VLLM_RPC_BASE_PATH=str(tmp_path)),
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "router.vllm_args" in done.stderr and "--no-such-flag" in done.stderr
    assert "started a local Ray" in done.stderr  # it started while the flags were checked
    assert " up in " not in done.stderr  # no engine started
    assert not ready.exists()
    assert _processes_of(tmp_path) == []  # Ray's processes went with it


def test_routers_started_ahead_wait_for_their_task_and_end_with_a_failed_start():
    with pytest.raises(RuntimeError, match="the engines did not start"):
        with started_ahead(2) as (runner, processes):
            pids = [process.pid for process in processes]
            assert len(pids) == 2
            children = {child.pid for child in psutil.Process().children()}
            assert set(pids) <= children  # this process's children: they die with it
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # importing, then waiting on stdin: not exiting
                assert all(process.returncode is None for process in processes)
                time.sleep(0.2)
            raise RuntimeError("the engines did not start")
    assert all(process.returncode is not None for process in processes)
    assert not any(psutil.pid_exists(pid) and _alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _router_by_hand(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("argv", [[], ["0"], ["zero", "1"]])
def test_a_router_process_started_by_hand_says_how_it_is_started(argv):
    done = _router_by_hand(*argv)
    assert done.returncode != 0
    assert "usage: python -m pdserve.serve INDEX KEEPER_PID" in done.stderr


def test_a_router_whose_keeper_is_gone_exits():
    """The keeper's pid given is not its parent's (the keeper died before it started)."""
    done = _router_by_hand("0", str(os.getpid() + 10**6))
    assert done.returncode != 0
    assert "its keeper is gone" in done.stderr


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
    token. A router started before Ray could not join (seen: `InvalidAuthToken`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    with tempfile.TemporaryDirectory(prefix="pdr-", dir="/tmp") as short:  # socket paths: short
        env |= {"HOME": str(tmp_path), "RAY_TMPDIR": short}
        done = subprocess.run(
            [sys.executable, "-c", SPAWN_AFTER_RAY],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            cwd=REPO,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MODE token" in done.stdout.splitlines()


def test_serve_starts_the_routers_after_ray(monkeypatch):
    """The order `run` keeps (the reason is above): Ray, then the routers started ahead."""
    from pdserve import serve

    order: list[str] = []

    @contextlib.contextmanager
    def routers(count):
        order.append(f"routers {count}")
        yield "loop", ["processes"]

    monkeypatch.setattr(serve.signal, "signal", lambda *args: None)
    monkeypatch.setattr(serve, "resolve_model", lambda config: Path("/models/m"))
    monkeypatch.setattr(serve, "with_planned_chunk", lambda config, model_dir: config)
    monkeypatch.setattr(serve, "_check_front_flags", lambda *args: order.append("flags"))
    monkeypatch.setattr(serve, "_init_ray", lambda config: order.append("ray") and False)
    monkeypatch.setattr("pdserve.routers.started_ahead", routers)
    monkeypatch.setattr(
        serve, "_start_and_serve", lambda *args: order.append(f"serve {args[-1]}") or 0
    )
    config = PDServeConfig.model_validate({"router": {"replicas": 2}})
    assert serve.run(config) == 0
    assert order.index("ray") < order.index("routers 2")
    assert order[-1] == "serve ('loop', ['processes'])"
