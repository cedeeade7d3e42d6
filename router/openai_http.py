"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health.

Life of a request: the body is parsed and checked by `Frontend.prepare` (400/404 on bad input),
admitted against `max_outstanding_requests` (429 when full), then streamed from a node of the pool
with the request's deadline. Streams are server-sent events ending in `data: [DONE]`; a client
that disconnects cancels the engine-side request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.config import RouterConfig
from pdserve.engine import TokenDelta
from router.dispatch import Colocated, Disaggregated
from router.errors import (
    InvalidRequest,
    Overloaded,
    PoolUnavailable,
    RequestError,
    Unauthorized,
    error_body,
)
from router.frontend import Frontend, PreparedRequest
from router.metrics import RequestTimer, RouterMetrics
from router.pools import NodeFailed

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


@dataclass
class RouterState:
    frontend: Frontend
    dispatcher: Colocated | Disaggregated
    config: RouterConfig
    metrics: RouterMetrics
    outstanding: int = 0


def _error_response(error: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if isinstance(error, Overloaded) else None
    return JSONResponse(error_body(error), status_code=error.http_status, headers=headers)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}") from None


def _check_auth(state: RouterState, request: Request) -> None:
    key = state.config.api_key
    if key and request.headers.get("authorization") != f"Bearer {key}":
        raise Unauthorized("missing or wrong API key (send `Authorization: Bearer <key>`)")


class _Collected:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt_tokens = 0

    def add(self, delta: TokenDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason
        self.prompt_tokens = delta.num_prompt_tokens or self.prompt_tokens

    def usage(self) -> Any:
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        completion = len(self.token_ids)
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
        )


def _full_response(state: RouterState, prepared: PreparedRequest, got: _Collected) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponse,
        CompletionResponseChoice,
    )

    common = dict(id=prepared.request_id, model=state.frontend.served_name, usage=got.usage())
    text = "".join(got.text)
    if prepared.kind == "completion":
        choice = CompletionResponseChoice(
            index=0, text=text, finish_reason=got.finish_reason, stop_reason=got.stop_reason
        )
        return CompletionResponse(choices=[choice], **common).model_dump(exclude_none=True)
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role="assistant", content=text),
        finish_reason=got.finish_reason,
        stop_reason=got.stop_reason,
    )
    return ChatCompletionResponse(choices=[choice], **common).model_dump(exclude_none=True)


def _chunk(state: RouterState, prepared: PreparedRequest, delta: TokenDelta | None, first: bool):
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponseStreamChoice,
        CompletionStreamResponse,
    )

    text = delta.text if delta else ""
    finish = delta.finish_reason if delta else None
    common = dict(id=prepared.request_id, model=state.frontend.served_name)
    if prepared.kind == "completion":
        choice = CompletionResponseStreamChoice(index=0, text=text, finish_reason=finish)
        return CompletionStreamResponse(choices=[choice], **common)
    message = DeltaMessage(role="assistant", content=text) if first else DeltaMessage(content=text)
    choice = ChatCompletionResponseStreamChoice(index=0, delta=message, finish_reason=finish)
    return ChatCompletionStreamResponse(choices=[choice], **common)


def _usage_chunk(state: RouterState, prepared: PreparedRequest, got: _Collected):
    chunk = _chunk(state, prepared, None, False)
    chunk.choices = []
    chunk.usage = got.usage()
    return chunk


class Handler:
    """Admission, deadline and the pool call shared by both generate endpoints."""

    def __init__(self, state: RouterState) -> None:
        self.state = state

    def admit(self) -> None:
        self.state.dispatcher.check_available()
        if self.state.outstanding >= self.state.config.max_outstanding_requests:
            raise Overloaded(
                f"{self.state.outstanding} requests in flight (limit "
                f"{self.state.config.max_outstanding_requests}); retry later"
            )
        self.state.outstanding += 1

    def timer(self, prepared: PreparedRequest, api: str) -> RequestTimer:
        return RequestTimer(self.state.metrics, api, prepared.arrival)

    def rejected(self, api: str, error: RequestError) -> None:
        """Count a request refused before it was admitted (bad input, auth, full, no pool)."""
        self.state.metrics.requests.labels(api=api, outcome=error.kind).inc()

    async def deltas(
        self, prepared: PreparedRequest, timer: RequestTimer | None = None
    ) -> AsyncIterator[TokenDelta]:
        """The request's deltas; if a node dies before anything was yielded, the whole request
        runs again (the dispatcher already retried its own leg; this covers a decode node that
        died after the prefill, before the client saw a token)."""
        deadline = prepared.arrival + self.state.config.request_timeout_s
        for attempt in range(1, MAX_ATTEMPTS + 1):
            yielded = False
            try:
                async for delta in self.state.dispatcher.deltas(prepared, deadline):
                    yielded = True
                    if timer is not None:
                        timer.tokens_sent(len(delta.token_ids))
                    yield delta
                return
            except NodeFailed:
                if yielded or attempt == MAX_ATTEMPTS:
                    raise
                self.state.metrics.reruns.inc()
                logger.warning(
                    "%s: node failed before any output; attempt %d",
                    prepared.request_id,
                    attempt + 1,
                )

    async def complete(self, prepared: PreparedRequest) -> JSONResponse:
        """Non-streamed: the client sees nothing until the end, so a node failure at any point
        is retried (up to MAX_ATTEMPTS) before it becomes an error."""
        outcome = "cancelled"
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                got = _Collected()
                timer = self.timer(prepared, "http")
                try:
                    async for delta in self.deltas(prepared, timer):
                        got.add(delta)
                    outcome = "success"
                    return JSONResponse(_full_response(self.state, prepared, got))
                except NodeFailed:
                    if attempt == MAX_ATTEMPTS:
                        raise
                    self.state.metrics.reruns.inc()
                    logger.warning("%s: node failed; running it again", prepared.request_id)
        except RequestError as error:
            outcome = error.kind
            raise
        finally:
            self.state.outstanding -= 1
            timer.finished(outcome)

    async def sse(self, prepared: PreparedRequest) -> AsyncIterator[str]:
        got = _Collected()
        first = True
        timer, outcome = self.timer(prepared, "http"), "cancelled"  # until it ends another way
        try:
            async for delta in self.deltas(prepared, timer):
                got.add(delta)
                chunk = _chunk(self.state, prepared, delta, first)
                first = False
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
            if prepared.include_usage:
                chunk = _usage_chunk(self.state, prepared, got)
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
            outcome = "success"
        except RequestError as error:
            outcome = error.kind
            logger.warning("stream %s ended with %s: %s", prepared.request_id, error.kind, error)
            yield f"data: {json.dumps(error_body(error))}\n\n"
        finally:
            self.state.outstanding -= 1
            timer.finished(outcome)
        yield "data: [DONE]\n\n"


def _node_view(node) -> dict:
    """What /health says of one node: health, process, and its last reported load."""
    stats = node.stats or {}
    return {
        "name": node.name,
        "healthy": node.healthy,
        "pid": node.info.get("pid"),
        "ray_node_id": node.info.get("ray_node_id"),
        "requests_total": stats.get("requests_started_total", 0),
        "outstanding": node.outstanding,
        "running": stats.get("running", 0),
        "waiting": stats.get("waiting", 0),
        "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
        "kv_blocks_held": stats.get("kv", {}).get("gauges", {}).get("blocks_held", 0),
    }


def create_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None)
    handler = Handler(state)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, error: RequestError) -> JSONResponse:
        return _error_response(error)

    @app.get("/health")
    async def health() -> JSONResponse:
        pools = {
            name: {
                "healthy": len(pool.healthy_nodes()),
                "nodes": [_node_view(n) for n in pool.nodes],
            }
            for name, pool in state.dispatcher.pools.items()
        }
        try:
            state.dispatcher.check_available()
        except PoolUnavailable as error:
            body = {"status": "unavailable", "reason": error.message, "pools": pools}
            return JSONResponse(body, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "mode": state.dispatcher.mode,
                "outstanding": state.outstanding,
                "pools": pools,
            }
        )

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        _check_auth(state, request)
        card = ModelCard(
            id=state.frontend.served_name,
            owned_by="pdserve",
            max_model_len=state.frontend.max_model_len,
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def generate(kind: str, request: Request):
        started = time.monotonic()
        try:
            _check_auth(state, request)
            prepared = state.frontend.prepare(kind, await _json_body(request))
            handler.admit()
        except RequestError as error:
            handler.rejected("http", error)
            raise
        logger.info(
            "%s: %d prompt tokens, max_tokens=%s, stream=%s (prepared in %.1f ms)",
            prepared.request_id,
            len(prepared.prompt_token_ids),
            prepared.sampling_params.max_tokens,
            prepared.stream,
            (time.monotonic() - started) * 1e3,
        )
        if prepared.stream:
            return StreamingResponse(handler.sse(prepared), media_type="text/event-stream")
        return await handler.complete(prepared)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate("chat", request)

    return app
