"""The executor of a CPU engine whose worker runs in the EngineCore's process
(pdserve_core/engine/executor.py): the step's forward pass runs when its result is asked for,
inside the span vLLM times as the step, once, and its failure is the result's. The engines that
run it are tests/engines/test_equivalence.py's (against a reference laid out as vLLM lays out a
CPU engine) and every e2e server's."""

from __future__ import annotations

import importlib

import pytest

from pdserve_core.config import EngineConfig
from pdserve_core.engine.actor import IN_CORE_EXECUTOR, engine_kwargs


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
