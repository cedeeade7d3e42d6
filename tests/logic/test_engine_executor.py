"""The executor of a CPU engine whose worker runs in the EngineCore's process
(pdserve_core/engine/executor.py): the step's forward pass runs when its result is asked for,
inside the span vLLM times as the step, once, and its failure is the result's. The engines that
run it are tests/engines/test_equivalence.py's (against a reference laid out as vLLM lays out a
CPU engine) and every e2e server's."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from pdserve_core.config import EngineConfig
from pdserve_core.engine.actor import IN_CORE_EXECUTOR, engine_kwargs, omp_binding, spawned_with


def test_the_forward_pass_runs_at_the_result_once():
    from pdserve_core.engine.executor import _AtResult

    calls = []
    future = _AtResult(lambda: calls.append("ran") or len(calls))
    assert calls == [] and not future.done()  # handed over: nothing has run
    assert future.result() == 1 and calls == ["ran"]
    assert future.result() == 1 and calls == ["ran"]  # asked again: not run again


def test_a_failed_forward_pass_raises_from_the_result():
    from pdserve_core.engine.executor import _AtResult

    def fail():
        raise RuntimeError("the step failed")

    future = _AtResult(fail)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the step failed"):
            future.result()
    assert isinstance(future.exception(), RuntimeError)


def test_cpu_engines_ask_for_the_in_core_worker_unless_told_otherwise():
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    kwargs = engine_kwargs("model", EngineConfig(), "served")
    assert kwargs["distributed_executor_backend"] == "uni"  # the actor names the class on CPU
    module, name = IN_CORE_EXECUTOR.rsplit(".", 1)
    assert issubclass(getattr(importlib.import_module(module), name), UniProcExecutor)
    vllms = engine_kwargs("model", EngineConfig(cpu_worker_process=True), "served")
    assert "distributed_executor_backend" not in vllms  # vLLM's own choice: a worker process


IOMP = "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so"


@pytest.mark.parametrize(
    ("bind", "preload", "expected"),
    [
        ("1", IOMP, {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[1]"}),
        ("0-1", IOMP, {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1]"}),
        ("3,0-1", IOMP, {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1,3]"}),
        ("0-1", "/torch/lib/libgomp.so.1", {"GOMP_CPU_AFFINITY": "0 1"}),
        ("2", "", {"OMP_PLACES": "{2}", "OMP_PROC_BIND": "true"}),
    ],
)
def test_a_bound_pool_pins_its_engines_threads_for_its_openmp_runtime(bind, preload, expected):
    """What vLLM's multiprocessing executor gives each worker process it spawns, given here to
    an engine whose worker runs in its EngineCore (the default on CPU)."""
    env = omp_binding(bind, preload)
    assert {name: env[name] for name in expected} == expected
    if "KMP_AFFINITY" in env:
        assert env["KMP_BLOCKTIME"] == "5" and env["KMP_TPAUSE"] == "0"


@pytest.mark.parametrize("bind", ["nobind", "", "auto"])
def test_an_unbound_pool_pins_nothing(bind):
    assert omp_binding(bind, IOMP) == {}


def test_a_process_spawned_in_the_block_inherits_the_binding_and_the_caller_keeps_its_own(
    monkeypatch,
):
    monkeypatch.setenv("KMP_BLOCKTIME", "200")
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    env = omp_binding("1", IOMP)
    with spawned_with(env):
        seen = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ['KMP_AFFINITY'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    assert seen == env["KMP_AFFINITY"]
    assert os.environ["KMP_BLOCKTIME"] == "200" and "KMP_AFFINITY" not in os.environ
