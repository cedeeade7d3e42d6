"""How `pdserve serve` starts, without a server (pdserve/serve.py): the order `run` keeps (Ray,
then the router processes started ahead), and a router process started by hand or after its
keeper died. The starts themselves (a bad front-end flag, routers waiting for their task) run
real processes: tests/e2e/test_serve_start.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_core.config import PDServeConfig


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


def test_serve_starts_the_routers_after_ray(monkeypatch):
    """The order `run` keeps: Ray, then the routers started ahead, which so inherit Ray's token
    authentication (tests/sockets/test_ray_token.py)."""
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
