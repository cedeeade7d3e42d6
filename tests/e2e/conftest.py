"""One real `pdserve serve` (real Ray, real vLLM CPU engine, real HTTP) shared by the session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

START_DEADLINE_S = 300
STOP_DEADLINE_S = 60


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    model: str


def _wait_ready(process: subprocess.Popen, ready: Path, log: Path) -> str:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"pdserve serve exited with {process.returncode}:\n{log.read_text()[-5000:]}"
            )
        if ready.exists() and ready.read_text():
            return json.loads(ready.read_text())["http"]
        time.sleep(0.2)
    raise TimeoutError(
        f"pdserve serve not ready in {START_DEADLINE_S} s:\n{log.read_text()[-5000:]}"
    )


def stop_and_check_nothing_left(process: subprocess.Popen) -> list[str]:
    """SIGTERM the server; return the descendants (Ray, vLLM) still alive after the deadline."""
    tree = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=STOP_DEADLINE_S)
    _, alive = psutil.wait_procs(tree, timeout=STOP_DEADLINE_S)
    leftovers = [f"{p.pid} {p.name()}" for p in alive if p.is_running()]
    for p in alive:
        p.kill()
    return leftovers


@pytest.fixture(scope="session")
def server(default_model_dir, tmp_path_factory) -> Server:
    work = tmp_path_factory.mktemp("serve")
    ready, log = work / "ready.json", work / "serve.log"
    env = dict(os.environ, VLLM_RPC_BASE_PATH=str(work), PYTHONUNBUFFERED="1")
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "serve",
                "--port",
                "0",
                "--ready-file",
                str(ready),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        url = _wait_ready(process, ready, log)
    except BaseException:
        stop_and_check_nothing_left(process)
        raise
    models = httpx.get(f"{url}/v1/models", timeout=10).json()
    yield Server(url=url, process=process, log=log, model=models["data"][0]["id"])
    if process.poll() is None:
        leftovers = stop_and_check_nothing_left(process)
        assert process.returncode == 0, log.read_text()[-3000:]
        assert leftovers == [], f"processes left after SIGTERM: {leftovers}"
