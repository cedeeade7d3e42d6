"""The router's service, shared by both edges (OpenAI HTTP and gRPC).

Life of a request here:
1. A face validates and tokenizes the request (vLLM's serving layer, router/faces/vllm_face.py).
2. `open(prepared, api)`: admission gives it a slot, the router's own limits are checked
   (`RequestLimits`), and the dispatcher says whether any node can take it — or it is refused
   with a `RequestError` (counted, its slot given back).
3. `deltas(request)`: the request runs under the retry policy (router/decides/retry.py) with its
   deadline (`router.request_timeout_s` from arrival); its latencies are observed once, its
   outcome counted, and its slot released however it ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pdserve_core.engine.types import TokenDelta
from router.decides.admission import Admission, Slot
from router.decides.retry import RESTART, RetryPolicy, runs
from router.errors import InvalidRequest, NodeFailed, RequestError
from router.metrics import RequestTimer, RouterMetrics
from router.request import PreparedRequest, num_logprobs


@dataclass
class Admitted:
    """A request that holds an admission slot (release it by running it to its end)."""

    prepared: PreparedRequest
    slot: Slot
    timer: RequestTimer


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the router and the nodes (`router.*` in the config); beyond
    any of them it is refused with 400 before it is run."""

    max_n: int
    """Sequences one request may ask for (`n`): each is a decode leg reading one prefill's
    lease."""
    max_schema_bytes: int
    """The largest structured-output spec (JSON schema, regex, grammar, choices, structural
    tag), compiled on the engine before the request runs."""
    max_response_tokens: int
    """Token entries a non-streamed response may hold in the router's memory at most (see
    `held_response_tokens`); a streamed one is sent as it comes and holds none."""

    def check(self, prepared: PreparedRequest) -> None:
        params = prepared.sampling_params
        n = getattr(params, "n", 1) or 1
        if n > self.max_n:
            raise InvalidRequest(f"n must be at most {self.max_n} (router.max_n), got {n}", "n")
        spec = structured_spec_bytes(params)
        if spec > self.max_schema_bytes:
            raise InvalidRequest(
                f"the structured output spec exceeds {self.max_schema_bytes} bytes "
                "(router.max_schema_bytes)"
            )
        held = 0 if prepared.stream else held_response_tokens(prepared)
        if held > self.max_response_tokens:
            raise InvalidRequest(
                f"a non-streamed response of up to {held} token entries (n × max_tokens × "
                f"(1 + logprobs), plus prompt logprobs) exceeds {self.max_response_tokens} "
                "(router.max_response_tokens): stream it, or ask for fewer tokens, sequences "
                "or logprobs"
            )


def _per_token(logprobs: int | None) -> int:
    """Entries one token holds: itself and its top logprobs (-1, "the whole vocabulary", counts
    as more than any bound)."""
    if logprobs is None:
        return 1
    return 1 + logprobs if logprobs >= 0 else 1 << 40


def held_response_tokens(prepared: PreparedRequest) -> int:
    """The most token entries a whole response can gather: every sequence's tokens to
    max_tokens, each with its top logprobs, and the prompt's logprobs when asked for."""
    params = prepared.sampling_params
    n = getattr(params, "n", 1) or 1
    tokens = getattr(params, "max_tokens", None) or 0
    held = n * tokens * _per_token(num_logprobs(params))
    prompt_logprobs = getattr(params, "prompt_logprobs", None)
    if prompt_logprobs is not None:
        held += len(prepared.prompt_token_ids) * _per_token(prompt_logprobs)
    return held


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
        dispatcher: Any,
        metrics: RouterMetrics,
        admission: Admission,
        retry: RetryPolicy,
        request_timeout_s: float,
        limits: RequestLimits,
    ) -> None:
        self.dispatcher, self.metrics = dispatcher, metrics
        self.admission, self.retry = admission, retry
        self.request_timeout_s = request_timeout_s
        self.limits = limits

    def gate(self) -> None:
        """Whether a request would be admitted now (`Overloaded`, `PoolUnavailable` if not),
        without taking a slot: a face asks before it starts answering."""
        self.admission.check()
        self.dispatcher.check_available()

    async def open(self, prepared: PreparedRequest, api: str) -> Admitted:
        """Admit a request a face validated and tokenized, check the router's limits, then the
        pools: bad input is a 400 whether or not a node is up. A refusal is counted and raised,
        and gives its slot back."""
        slot = None
        try:
            slot = self.admission.admit()
            self.limits.check(prepared)
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
        self.metrics.child(self.metrics.requests, api, error.kind).inc()

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

    async def deltas(self, request: Admitted) -> AsyncIterator[TokenDelta | object]:
        """The request's deltas as they come; a non-streamed request that starts over yields
        `RESTART` (drop what was gathered). Its latencies are observed, its outcome counted, and
        its slot released however it ends."""
        outcome = "cancelled"  # until it ends another way
        try:
            async with aclosing(self._runs(request)) as deltas:
                async for delta in deltas:
                    if delta is RESTART:
                        request.timer.restart()
                    else:
                        request.timer.tokens(len(delta.token_ids))
                    yield delta
            outcome = "success"
        except RequestError as error:
            outcome = error.kind
            raise
        finally:
            request.slot.release()
            request.timer.finished(outcome)
