"""The router's service, shared by both edges (OpenAI HTTP and gRPC).

Life of a request here:
1. `open(kind, body, api)`: the dispatcher says whether any node can take it, admission gives
   it a slot, and the frontend validates and tokenizes the body off the event loop — or it is
   refused with a `RequestError` (counted, its slot given back).
2. `stream(request)` or `collect(request)`: the request runs under the retry policy
   (router/retry.py) with its deadline (`router.request_timeout_s` from arrival); its latencies
   are observed once, its outcome counted, and its slot released however it ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.types import TokenDelta
from router.admission import Admission, Slot
from router.errors import InvalidRequest, NodeFailed, RequestError
from router.metrics import RequestTimer, RouterMetrics
from router.request import PreparedRequest
from router.retry import RESTART, RetryPolicy, runs


@dataclass
class Output:
    """One sequence of a response (a request asks for `n`)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Collected:
    """A whole response, gathered from its deltas."""

    sequences: dict[int, Output] = field(default_factory=dict)
    prompt_tokens: int = 0
    prompt_logprobs: list | None = None
    num_cached_tokens: int | None = None

    def add(self, delta: TokenDelta) -> None:
        seq = self.sequences.setdefault(delta.index, Output())
        seq.text.append(delta.text)
        seq.token_ids.extend(delta.token_ids)
        seq.logprobs.extend(delta.logprobs or [])
        seq.finish_reason = delta.finish_reason or seq.finish_reason
        if delta.stop_reason is not None:
            seq.stop_reason = delta.stop_reason
        self.prompt_tokens = delta.num_prompt_tokens or self.prompt_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens is not None and self.num_cached_tokens is None:
            self.num_cached_tokens = delta.num_cached_tokens


@dataclass
class Admitted:
    """A request that holds an admission slot (release it by running it to its end)."""

    prepared: PreparedRequest
    slot: Slot
    timer: RequestTimer


MAX_N = 128
"""Default for `router.max_n`: sequences one request may ask for (`n`)."""
MAX_SCHEMA_BYTES = 64 << 10
"""Default for `router.max_schema_bytes`: the largest structured-output spec (JSON schema,
regex, grammar, choices, structural tag), compiled on the engine before the request runs."""


def structured_spec_bytes(params: Any) -> int:
    """How large the request's structured-output spec is (0 without one); a JSON schema nested
    too deeply to measure counts as too large."""
    spec = getattr(params, "structured_outputs", None)
    if spec is None:
        return 0
    size = 0
    for name in ("json", "regex", "grammar", "structural_tag", "whitespace_pattern"):
        value = getattr(spec, name, None)
        if isinstance(value, dict | list):
            try:
                value = json.dumps(value)
            except (RecursionError, ValueError):
                return 1 << 62
        if isinstance(value, str):
            size += len(value.encode())
    size += sum(len(str(choice).encode()) for choice in getattr(spec, "choice", None) or ())
    return size


class RouterService:
    def __init__(
        self,
        frontend: Any,
        dispatcher: Any,
        metrics: RouterMetrics,
        admission: Admission,
        retry: RetryPolicy,
        request_timeout_s: float,
        max_n: int = MAX_N,
        max_schema_bytes: int = MAX_SCHEMA_BYTES,
    ) -> None:
        self.frontend, self.dispatcher, self.metrics = frontend, dispatcher, metrics
        self.admission, self.retry = admission, retry
        self.request_timeout_s = request_timeout_s
        self.max_n = max_n
        self.max_schema_bytes = max_schema_bytes

    async def open(self, kind: str, body: Any, api: str) -> Admitted:
        """Admit, validate and tokenize (on a thread: a long prompt must not stall the event loop
        the health checks and streams run on), then check the pools: bad input is a 400 whether
        or not a node is up. A refusal is counted and raised, and gives its slot back."""
        slot = None
        try:
            slot = self.admission.admit()
            prepared = await asyncio.to_thread(self.frontend.prepare, kind, body)
            n = getattr(prepared.sampling_params, "n", 1) or 1
            if n > self.max_n:  # every sequence is a decode leg reading one prefill's lease
                raise InvalidRequest(f"n must be at most {self.max_n} (router.max_n), got {n}", "n")
            spec = structured_spec_bytes(prepared.sampling_params)
            if spec > self.max_schema_bytes:
                raise InvalidRequest(
                    f"the structured output spec exceeds {self.max_schema_bytes} bytes "
                    "(router.max_schema_bytes)"
                )
            self.dispatcher.check_available()
        except BaseException as error:
            if slot is not None:
                slot.release()
            if isinstance(error, RequestError):
                self.rejected(api, error)
            raise
        timer = RequestTimer(self.metrics, api, prepared.arrival, live=prepared.stream)
        return Admitted(prepared, slot, timer)

    def rejected(self, api: str, error: RequestError) -> None:
        """Count a request refused before it was admitted (bad input, auth, full, no pool)."""
        self.metrics.requests.labels(api=api, outcome=error.kind).inc()

    def _on_retry(self, error: NodeFailed) -> None:
        self.metrics.retries.labels(pool=error.pool or "unknown").inc()

    def _on_resume(self, error: NodeFailed) -> None:
        self.metrics.resumes.labels(pool=error.pool or "unknown").inc()

    def _runs(self, request: Admitted) -> AsyncIterator[TokenDelta | object]:
        prepared = request.prepared
        deadline = prepared.arrival + self.request_timeout_s
        return runs(
            self.dispatcher, prepared, deadline, self.retry, self._on_retry, self._on_resume
        )

    async def stream(self, request: Admitted) -> AsyncIterator[TokenDelta]:
        """The deltas of a streamed request, as they come."""
        outcome = "cancelled"  # until it ends another way
        try:
            async with aclosing(self._runs(request)) as deltas:
                async for delta in deltas:
                    request.timer.tokens(len(delta.token_ids))
                    yield delta
            outcome = "success"
        except RequestError as error:
            outcome = error.kind
            raise
        finally:
            request.slot.release()
            request.timer.finished(outcome)

    async def collect(self, request: Admitted) -> Collected:
        """A non-streamed request's whole response."""
        outcome, got = "cancelled", Collected()
        try:
            async with aclosing(self._runs(request)) as deltas:
                async for delta in deltas:
                    if delta is RESTART:
                        got = Collected()
                        request.timer.restart()
                        continue
                    request.timer.tokens(len(delta.token_ids))
                    got.add(delta)
            outcome = "success"
            return got
        except RequestError as error:
            outcome = error.kind
            raise
        finally:
            request.slot.release()
            request.timer.finished(outcome)
