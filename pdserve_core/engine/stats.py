"""How an engine node fills `NodeStats` from vLLM's stat loggers.

vLLM calls every stat logger once per engine step with the scheduler's view (running, waiting, KV
cache usage, KV connector stats, and — with `enable_logging_iteration_details` — the step's prompt
and decode tokens and its execution time) and the step's iteration stats (tokens, finished
requests with their queue time). `StatsCollector` folds them into running totals in the actor's
own process; the router polls them every second and the metrics module turns them into series.
Utilization is estimated per step with the roofline model (`pdserve_core.roofline.live`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from typing import Any

from pdserve_core.engine.types import NodeStats
from pdserve_core.roofline.live import Peaks
from pdserve_core.roofline.specs import ModelSpec
from pdserve_core.roofline.stepmodel import StepModel, StepRecord, step_cost

logger = logging.getLogger(__name__)

RECENT_FAILURES = 1000
"""Failed KV pulls remembered per engine (the decode node looks a request's reason up)."""
STEP_RECORDS = 8192
"""Recent steps each engine keeps for `pdserve plan calibrate` (GET /pdserve/v1/steps)."""
STALL_S = 0.5
"""A stall: a step that took this much longer than its model predicts and `STALL_FACTOR` times
as long, or this long between two steps' outputs with requests running (the engine, or the
actor that relays its outputs, stopped). Every stream on the engine stops for it; a long
prompt's step that is merely long is not one (its model predicts it)."""
STALL_FACTOR = 3.0
STALL_FACTOR_ROOFLINE = 10.0
"""The factor where the step model is the roofline's guess, not a calibration: on a 2-core CPU
(1P1D, long prompts among streams) it priced the steps at a third to a quarter of their time
(measured 2.6× the prediction on decode, 3.6× on prefill; a calibration 1.2×)."""
STALL_LOG_EVERY_S = 10.0
"""At most one warning per engine this often (the ones between are counted into the next)."""


class LogEvery:
    """Counts events and lets one log line through per `period_s`, telling how many events it
    covers (a node's stalls; a decode node's hand-overs whose KV did not cross)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._logged = float("-inf")
        self._unlogged = 0

    def count(self, now: float) -> int:
        """Count one event at `now` (monotonic): the events since the last line, this one
        included, when a line is due; else 0."""
        self._unlogged += 1
        if now - self._logged < self.period_s:
            return 0
        unlogged, self._unlogged, self._logged = self._unlogged, 0, now
        return unlogged


class StatsCollector:
    """Folds vLLM's per-step stats into `NodeStats` (wrapped as a vLLM stat logger by
    `stat_logger_factory`). `model` enables the utilization estimate once the engine knows it."""

    def __init__(self, stats: NodeStats, name: str = "engine") -> None:
        self.stats = stats
        self.name = name
        """The node's name, in the stall warnings."""
        self.model: ModelSpec | None = None
        self.step_model: StepModel | None = None
        """Predicts each step's time (the live predicted/measured step-time series)."""
        self.steps: deque[StepRecord] = deque(maxlen=STEP_RECORDS)
        self.steps_seen = 0
        """Steps recorded since start (`steps` holds the last `STEP_RECORDS` of them)."""
        self.kv_failures: OrderedDict[str, tuple[str, str]] = OrderedDict()
        """vLLM request id -> (reason, message) of recent failed pulls."""
        self.clock = time.monotonic
        self._busy_end: float | None = None
        """When the last step was reported, if it left requests running (the next one follows)."""
        self._stall_log = LogEvery(STALL_LOG_EVERY_S)

    def set_peaks(self, peaks: Peaks) -> None:
        self.stats.peak_flops = peaks.flops
        self.stats.peak_mem_bandwidth = peaks.mem_bandwidth
        self.stats.peaks_source = peaks.source

    def set_step_model(self, step_model: StepModel) -> None:
        self.step_model = step_model
        self.stats.step_model_source = step_model.source

    def engine_gone(self) -> None:
        """The engine was dropped (dead or stuck) for a rebuild: the requests it had running
        ended with it, so the next engine's first step does not end a pause between steps."""
        self._busy_end = None

    def records_since(self, seen: int) -> tuple[int, list[list]]:
        """(steps recorded so far, the kept records after the first `seen` of them)."""
        kept_from = self.steps_seen - len(self.steps)
        start = max(0, seen - kept_from)
        return self.steps_seen, [r.as_list() for r in list(self.steps)[start:]]

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        stats = self.stats
        if scheduler_stats is not None:
            stats.running = scheduler_stats.num_running_reqs
            stats.waiting = scheduler_stats.num_waiting_reqs
            stats.kv_cache_usage = scheduler_stats.kv_cache_usage
            stats.engine_steps_total += 1
            failed = stats.kv.observe(scheduler_stats.kv_connector_stats)
            for request_id, reason, message in failed:
                self.kv_failures[request_id] = (reason, message)
            while len(self.kv_failures) > RECENT_FAILURES:
                self.kv_failures.popitem(last=False)
            self._step(scheduler_stats.iteration_details, scheduler_stats.num_running_reqs)
        if iteration_stats is not None:
            prompt = iteration_stats.prompt_token_stats
            stats.prompt_tokens_total += prompt.total
            stats.prompt_tokens_computed_total += prompt.computed
            stats.prompt_tokens_transferred_total += prompt.external_kv_transfer
            stats.prompt_tokens_cached_total += prompt.local_cache_hit
            stats.generation_tokens_total += iteration_stats.num_generation_tokens
            for finished in iteration_stats.finished_requests:
                stats.observe_queue_time(finished.queued_time)

    def _step(self, details: Any, running_after: int) -> None:
        if details is None or details.is_dummy:
            return
        prompt, decode = details.num_ctx_tokens, details.num_generation_tokens
        if prompt + decode == 0:
            return
        seconds = details.elapsed_ms / 1e3
        # Steps are reported here as their outputs arrive, so the time between two reports is
        # one step's period on average; less the step itself, what the engine spent between them.
        now = self.clock()
        gap = None if self._busy_end is None else now - self._busy_end - seconds
        self._busy_end = now if running_after > 0 else None
        self.stats.busy_seconds_total += seconds
        self.stats.busy_steps_total += 1
        self.stats.prompt_busy_seconds_total += seconds * prompt / (prompt + decode)
        record = StepRecord(
            prompt,
            details.num_ctx_requests,
            decode,
            details.num_generation_requests,
            max(0, self.stats.decode_context_tokens),
            seconds,
            gap,
        )
        self.steps.append(record)
        self.steps_seen += 1
        if gap is not None and gap > STALL_S:  # the outputs of the step before came this late
            self._stall(gap, "between two steps", record, None)
        if self.model is None:
            return
        cost = step_cost(
            self.model,
            record.prompt_tokens,
            record.prompt_sequences,
            record.decode_tokens,
            record.decode_sequences,
            record.context_tokens,
        )
        flops = cost.linear_flops + cost.attention_flops
        self.stats.estimated_flops_total += flops
        self.stats.estimated_bytes_total += cost.bytes
        if seconds > 0 and self.stats.peak_flops:
            # a peak is at least what a step did: utilization stays within [0, 1] whatever the
            # start-up measurement missed (another kernel, another thread count, turbo)
            self.stats.peak_flops = max(self.stats.peak_flops, flops / seconds)
            self.stats.peak_mem_bandwidth = max(self.stats.peak_mem_bandwidth, cost.bytes / seconds)
        if self.step_model is not None:
            predicted = self.step_model.cost_seconds(cost)
            self.stats.predicted_busy_seconds_total += predicted
            factor = STALL_FACTOR_ROOFLINE if self.step_model.source == "roofline" else STALL_FACTOR
            if seconds - predicted > STALL_S and seconds > factor * predicted:
                self._stall(seconds - predicted, f"in a step of {seconds:.2f} s", record, predicted)

    def _stall(self, seconds: float, where: str, record: StepRecord, predicted: float | None):
        """Count a stall of `seconds` and warn of it (at most every `STALL_LOG_EVERY_S`)."""
        self.stats.stalls_total += 1
        self.stats.stall_seconds_total += seconds
        stalls = self._stall_log.count(self.clock())
        if not stalls:
            return
        expected = "" if predicted is None else f"; its model predicts {predicted:.2f} s"
        logger.warning(
            "%s: every stream stopped %.2f s %s (prompt tokens %d of %d requests, decode tokens "
            "%d of %d%s); %d stall(s) since the last warning",
            self.name,
            seconds,
            where,
            record.prompt_tokens,
            record.prompt_sequences,
            record.decode_tokens,
            record.decode_sequences,
            expected,
            stalls,
        )


def stat_logger_factory(collector: StatsCollector):
    """A vLLM stat logger class that hands every step to `collector` (same process)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            collector.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _Logger


class GpuSampler:
    """NVML utilization of the GPU this process was given (Ray sets CUDA_VISIBLE_DEVICES)."""

    def __init__(self) -> None:
        import os

        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        if visible.startswith("GPU-"):
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0))
        self._nvml = pynvml

    def sample(self, stats: NodeStats) -> None:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        stats.gpu_sm_utilization = rates.gpu / 100.0
        stats.gpu_memory_utilization = rates.memory / 100.0

    @classmethod
    def create(cls) -> GpuSampler | None:
        """A sampler when this process has a GPU and NVML (nvidia-ml-py); None otherwise."""
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            return cls()
        except Exception as error:  # no NVML library or driver: no GPU series
            logger.info("no NVML utilization: %s", error)
            return None
