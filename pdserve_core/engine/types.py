"""What crosses Ray between the router and an engine node, as plain typed data.

This module imports neither vLLM nor Ray: the router's domain logic (pools, policies, dispatch,
metrics) depends on it alone, so it can be tested with fake nodes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pdserve_core.kv.stats import KVTotals
from pdserve_core.roofline.stepmodel import StepRecord

QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of the queue-time histogram each engine keeps."""


STEP_FIELDS = tuple(f.name for f in fields(StepRecord))
"""The columns of a per-step record (`EngineActor.step_records`, GET /pdserve/v1/steps)."""
CACHE_SALT_ARG = "pdserve_cache_salt"
"""Where a request's `cache_salt` travels to every leg: the `SamplingParams.extra_args` key the
router sets and each node moves onto the prompt it gives vLLM (clients cannot set extra_args:
`vllm_xargs` is refused)."""
OUTPUT_START_ARG = "pdserve_output_start"
"""A resumed stream's prompt is the client's prompt plus the tokens already sent: this
`SamplingParams.extra_args` key holds where the client's prompt ends, so each leg's text continues
from there as one engine's would (pdserve_core/engine/text.py). Set by the router
(router/decides/seam.py); clients cannot set extra_args."""


TopLogprob = tuple[int, float, int | None, str | None]
"""(token id, logprob, rank, decoded text) of one candidate token at one position."""
PositionLogprobs = list[TopLogprob]
"""One position's candidates in vLLM's order: the sampled (or prompt) token first, then the top
tokens by rank."""


@dataclass(frozen=True)
class TokenDelta:
    """New output of one sequence of a request since its previous delta."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    handle: dict[str, Any] | None = None
    """Prefill nodes, on the last delta: the KV handle a decode node pulls with (opaque to the
    router, which only carries it from one node to the other)."""
    index: int = 0
    """Which of the request's `n` sequences this belongs to."""
    logprobs: list[PositionLogprobs] | None = None
    """One entry per new token, when the request asked for logprobs."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """On the first delta, when the request asked for prompt logprobs (None for position 0)."""
    num_cached_tokens: int | None = None
    """Prompt tokens the engine found in its prefix cache (on the first delta)."""


def joinable(first: TokenDelta, then: TokenDelta) -> bool:
    """Whether `then`, the delta right after `first` on a stream, can be told with it as one:
    the same sequence, `first` not its last, and logprobs on both or neither (one entry per
    token either way)."""
    return (
        then.index == first.index
        and first.finish_reason is None
        and (first.logprobs is None) == (then.logprobs is None)
    )


def joined(run: Sequence[TokenDelta]) -> TokenDelta:
    """A run of deltas, each `joinable` with the one before it, as one: their tokens, text and
    logprobs in order (each copied once, however long the run); what only a first delta carries
    (prompt logprobs, cached tokens) from the first that has it, what only a last one carries
    (finish, stop reason, handle) from the last."""
    first, last = run[0], run[-1]
    if len(run) == 1:
        return first
    return TokenDelta(
        token_ids=[token for delta in run for token in delta.token_ids],
        text="".join(delta.text for delta in run),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_prompt_tokens=next(
            (d.num_prompt_tokens for d in reversed(run) if d.num_prompt_tokens), 0
        ),
        handle=next((d.handle for d in reversed(run) if d.handle is not None), None),
        index=first.index,
        logprobs=None if first.logprobs is None else [p for d in run for p in d.logprobs or ()],
        prompt_logprobs=next(
            (d.prompt_logprobs for d in run if d.prompt_logprobs is not None), None
        ),
        num_cached_tokens=next(
            (d.num_cached_tokens for d in run if d.num_cached_tokens is not None), None
        ),
    )


@dataclass(frozen=True)
class NodeInfo:
    """What a node says about itself once its engine is up."""

    name: str
    pid: int
    ray_node_id: str
    max_model_len: int
    block_size: int
    start_s: float
    kv_host: str = ""
    """Where its KV server listens (a producer; "" : none), one port per tensor-parallel rank."""
    kv_ports: tuple[int, ...] = ()
    prefetch: bool = False
    """Its consumer half stages KV from prefills still running (decode_node/staging.py)."""
    num_blocks: int = 0
    """KV blocks its engine has (0: not reported): the most its prefix cache can hold."""


class RequestRejected(ValueError):
    """The engine refused the request as invalid (vLLM's own checks, run when the request is
    added): the client's mistake, answered with a 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message,))


class EngineDown(RuntimeError):
    """The node's engine died under the request (its process is gone); the node rebuilds it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message,))


class KVLoadFailed(RuntimeError):
    """The decode engine could not load the request's KV and the policy is `fail`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"KV transfer failed ({reason}): {message}")
        self.reason, self.detail = reason, message

    def __reduce__(self):  # crosses Ray's process boundary intact
        return (type(self), (self.reason, self.detail))


@dataclass
class NodeStats:
    """A node's live load and running totals, as the router's policies and the metrics see it."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    max_num_seqs: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_computed_total: int = 0
    prompt_tokens_transferred_total: int = 0
    prompt_tokens_cached_total: int = 0
    generation_tokens_total: int = 0
    requests_started_total: int = 0
    requests_finished_total: int = 0
    engine_steps_total: int = 0
    busy_seconds_total: float = 0.0
    """Time the engine spent executing steps."""
    prompt_busy_seconds_total: float = 0.0
    """The share of that time spent on prompt tokens (each step split by its token mix)."""
    busy_steps_total: int = 0
    """Steps that computed tokens (the denominator of the mean step times)."""
    predicted_busy_seconds_total: float = 0.0
    """What the node's step-time model predicts those steps cost
    (pdserve_core.roofline.stepmodel)."""
    stalls_total: int = 0
    """Times every stream here stopped for a stall (`pdserve_core.engine.stats.STALL_S`): a
    step far longer than its model predicts, or the engine idle between steps with requests
    running."""
    stall_seconds_total: float = 0.0
    """Those stalls' time past what the model predicts (between steps: all of it)."""
    step_model_source: str = ""
    """"roofline" (no calibration for this device and model) or "calibrated:<file>"."""
    device: str = ""
    """The device key calibrations are stored under (a GPU's name, or CPU model and threads)."""
    model_key: str = ""
    """The model key calibrations are stored under (model folder and dtype)."""
    estimated_flops_total: float = 0.0
    estimated_bytes_total: float = 0.0
    peak_flops: float = 0.0
    peak_mem_bandwidth: float = 0.0
    peaks_source: str = ""
    queue_time_counts: list[int] = field(default_factory=lambda: [0] * len(QUEUE_TIME_BUCKETS))
    """Requests whose time in the engine's waiting queue was <= each bucket (not cumulative)."""
    queue_time_overflow: int = 0
    queue_time_sum: float = 0.0
    gpu_sm_utilization: float | None = None
    """NVML's utilization.gpu (share of time a kernel ran), 0..1; None without a GPU."""
    gpu_memory_utilization: float | None = None
    """NVML's utilization.memory (share of time device memory was read or written), 0..1."""
    decode_context_tokens: int = 0
    """Tokens cached by the sequences this engine is decoding (kept by the engine actor)."""
    handovers_total: int = 0
    """Decode legs that arrived with a prefill node's KV handle (decode nodes)."""
    handovers_recomputed_total: int = 0
    """... whose prompt the engine computed itself instead of loading it: a failed pull under
    the recompute policy, or KV that never crossed."""
    last_recompute: str = ""
    """The last such hand-over: the request, the tokens computed, the transport and the peer."""
    kv: KVTotals = field(default_factory=KVTotals)

    def observe_queue_time(self, seconds: float) -> None:
        index = bisect.bisect_left(QUEUE_TIME_BUCKETS, seconds)
        if index < len(QUEUE_TIME_BUCKETS):
            self.queue_time_counts[index] += 1
        else:
            self.queue_time_overflow += 1
        self.queue_time_sum += seconds


Checkup = tuple[bool, NodeStats, tuple[int, list[list[int]]] | None]
"""A router's health check answered in one call (the engine actor's `checkup`): whether the
engine is up, the node's stats, and its block log's new entries (None when not asked)."""
