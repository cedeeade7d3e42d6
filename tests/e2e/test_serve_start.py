"""How `pdserve serve` starts, on real processes (pdserve/serve.py): vLLM's front checks the
front-end flags while Ray starts, and a bad one stops the start before any engine, Ray taken
down; router processes (`router.replicas`, pdserve/routers.py) start ahead, import vLLM's front
and wait for their task while the engines start, and none outlives a start that failed before
the keeper took it. What needs no server (the order `run` keeps, a router process started by
hand) is in tests/sockets/test_serve_start.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pdserve.routers import started_ahead


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


WAITING_DEADLINE_S = 120
"""Two routers importing vLLM's front at once on a 2-core host: 10-15 s."""


def test_routers_started_ahead_wait_for_their_task_and_end_with_a_failed_start(capfd):
    said = ""
    with pytest.raises(RuntimeError, match="the engines did not start"):
        with started_ahead(2) as (runner, processes):
            pids = [process.pid for process in processes]
            children = {child.pid for child in psutil.Process().children()}
            assert len(pids) == 2 and set(pids) <= children  # they die with this process
            deadline = time.monotonic() + WAITING_DEADLINE_S
            while said.count("waiting for the nodes") < 2 and time.monotonic() < deadline:
                said += capfd.readouterr().err  # their log: this process's stderr
                time.sleep(0.1)
            assert "router 0: " in said and "router 1: " in said, said[-2000:]
            assert said.count("waiting for the nodes") == 2, said[-2000:]
            assert all(_alive(pid) for pid in pids)  # imported, and waiting for their task
            raise RuntimeError("the engines did not start")
    assert all(process.returncode is not None for process in processes)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
