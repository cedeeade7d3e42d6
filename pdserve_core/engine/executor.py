"""The executor of a CPU engine whose model worker runs inside vLLM's EngineCore process
(`engine.cpu_worker_process` false, the default): vLLM's one-process executor, with each step's
forward pass run when the EngineCore asks for its result rather than when it hands the step over.

vLLM times a step's execution (the `elapsed_ms` of its iteration details, which pdserve's stats
turn into step times, prefill rates, utilization and calibrations) from after the hand-over to
the result. With the worker in another process the forward pass runs in that span; vLLM's
one-process executor runs it during the hand-over, before the span opens, so the span would hold
the sampling alone (a placement that then takes the decode node for a fast prefiller, a
utilization near zero). Run at the result, it is timed as with a worker process. The step is the
same work in the same order: only the scheduler's structured-output bitmask, which in the other
layout is computed while the worker runs, is now computed before it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from vllm.v1.executor.uniproc_executor import UniProcExecutor


class _AtResult(Future):
    """A call run by the first `result()`, in the caller's thread."""

    def __init__(self, call) -> None:
        super().__init__()
        self._call = call

    def result(self, timeout: float | None = None) -> Any:
        call, self._call = self._call, None
        if call is not None:
            try:
                self.set_result(call())
            except Exception as error:  # raised by result(), as vLLM's own futures do
                self.set_exception(error)
        return super().result(timeout)


class InCoreExecutor(UniProcExecutor):
    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if not non_block:
            return super().execute_model(scheduler_output)
        run = super().execute_model
        return _AtResult(lambda: run(scheduler_output))
