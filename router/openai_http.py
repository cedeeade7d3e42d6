"""OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health,
/metrics — the HTTP edge of `RouterService` (router/service.py).

Life of a request: the body is read and parsed as JSON, `RouterService.open` admits it (429 when
full), validates it (400/404 on bad input) and checks the pools (503); then it is streamed as
server-sent events ending in `data: [DONE]`, or collected into one JSON response. A client that
disconnects from a stream cancels the engine-side request. vLLM's own OpenAI protocol classes
shape the responses, so the official `openai` client works unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.engine.types import STEP_FIELDS
from router import clock
from router.auth import authorized
from router.errors import (
    InvalidRequest,
    NodeFailed,
    Overloaded,
    PayloadTooLarge,
    PoolUnavailable,
    RequestError,
    RequestTimeout,
    Unauthorized,
    error_body,
)
from router.responses import StreamShaper, full_response
from router.service import Admitted, RouterService

logger = logging.getLogger(__name__)


def _error_response(error: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if isinstance(error, Overloaded) else None
    return JSONResponse(error_body(error), status_code=error.http_status, headers=headers)


DISCONNECT_POLL_S = 0.5
"""How often a request checks that its client is still there while it waits for a token."""
BODY_TIMEOUT_S = 30.0
"""Default for `router.body_timeout_s`."""
NODE_ANSWER_S = 10.0
"""How long an admin endpoint that asks every node waits for them (all at once): a node that
has not answered by then is named in the reply, not waited on."""


async def _json_body(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> Any:
    """The body as JSON, read no further than `limit` bytes and for no longer than
    `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds {limit}")
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    except TimeoutError:
        raise RequestTimeout(
            f"request body not received within {timeout_s:g} s (router.body_timeout_s)"
        ) from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None


class ClientGone(Exception):
    """The client closed its connection while its answer was being made."""


async def _unless_gone(request: Request, awaitable: Any) -> Any:
    """`awaitable`'s result, or `ClientGone` (it cancelled) once the client has disconnected:
    polled every `DISCONNECT_POLL_S`, so a client that leaves during a long prefill stops it."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise ClientGone
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _check_auth(api_key: str | None, request: Request) -> None:
    if not authorized(api_key, request.headers.get("authorization")):
        raise Unauthorized("missing or wrong API key (send `Authorization: Bearer <key>`)")


async def _sse(
    service: RouterService, request: Admitted, deltas: AsyncIterator, first: Any
) -> AsyncIterator[str]:
    """The events of a stream whose first delta (`first`, None when there was none) already
    came: the response's status was decided by it."""
    prepared = request.prepared
    shaper = StreamShaper(service.frontend.served_name, prepared, service.frontend.tokenizer)
    try:
        for chunk in shaper.opening():
            yield chunk
        async with aclosing(deltas):
            if first is not None:
                yield shaper.chunk(first)
            async for delta in deltas:
                yield shaper.chunk(delta)
        for chunk in shaper.closing(len(prepared.prompt_token_ids)):
            yield chunk
    except RequestError as error:
        logger.warning("stream %s ended with %s: %s", prepared.request_id, error.kind, error)
        yield f"data: {json.dumps(error_body(error))}\n\n"
    yield "data: [DONE]\n\n"


def _node_view(node) -> dict:
    """What /health says of one node: health, process, and its last reported load."""
    stats = node.stats
    return {
        "name": node.name,
        "healthy": node.healthy,
        "pid": node.info.pid if node.info else None,
        "ray_node_id": node.info.ray_node_id if node.info else None,
        "requests_total": stats.requests_started_total,
        "outstanding": node.outstanding,
        "prefilling_tokens": node.prefilling_tokens,
        "running": stats.running,
        "waiting": stats.waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "kv_blocks_held": stats.kv.gauges.blocks_held,
    }


def add_operations(app: FastAPI, service: RouterService, api_key: str | None) -> None:
    """The routes both HTTP faces serve the same way: /health (the pools' health), the nodes'
    recent steps, and the router's /metrics; and the JSON body of a `RequestError`."""
    dispatcher = service.dispatcher

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, error: RequestError) -> JSONResponse:
        return _error_response(error)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Liveness for anyone; the detail (pools, nodes, load) only with the key."""
        if not authorized(api_key, request.headers.get("authorization")):
            try:
                dispatcher.check_available()
            except PoolUnavailable:
                return JSONResponse({"status": "unavailable"}, status_code=503)
            return JSONResponse({"status": "ok"})
        pools = {
            name: {
                "healthy": len(pool.healthy_nodes()),
                "nodes": [_node_view(n) for n in pool.nodes],
            }
            for name, pool in dispatcher.pools.items()
        }
        try:
            dispatcher.check_available()
        except PoolUnavailable as error:
            body = {"status": "unavailable", "reason": error.message, "pools": pools}
            return JSONResponse(body, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "mode": dispatcher.mode,
                "outstanding": service.admission.outstanding,
                "pools": pools,
            }
        )

    @app.get("/pdserve/v1/steps")
    async def steps(request: Request) -> JSONResponse:
        """Every healthy node's recent engine steps (`pdserve plan calibrate`), behind the key."""
        _check_auth(api_key, request)
        pools = dispatcher.pools.items()
        asked = [(name, node) for name, pool in pools for node in pool.healthy_nodes()]

        async def records(node: Any) -> dict[str, Any] | None:
            try:
                async with asyncio.timeout(NODE_ANSWER_S):
                    return await node.client.step_records(0)
            except (NodeFailed, TimeoutError):
                return None

        answers = await asyncio.gather(*(records(node) for _, node in asked))
        nodes, unanswered = [], []
        for (pool_name, node), found in zip(asked, answers, strict=True):
            if found is None:
                unanswered.append(node.name)
                continue
            nodes.append({"pool": pool_name, "node": node.name, "fields": STEP_FIELDS, **found})
        return JSONResponse({"nodes": nodes, "unanswered": unanswered})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        _check_auth(api_key, request)
        registry = service.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def create_app(
    service: RouterService,
    api_key: str | None = None,
    max_request_bytes: int = 4 << 20,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> FastAPI:
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        """The API's schema, behind the key like every path but the bare health check."""
        _check_auth(api_key, request)
        return JSONResponse(app.openapi())

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        """A fault nothing else caught (a bug): logged with its traceback, answered as a JSON
        500 like every other error."""
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return _error_response(RequestError(f"internal error: {type(error).__name__}"))

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        _check_auth(api_key, request)
        card = ModelCard(
            id=service.frontend.served_name,
            owned_by="pdserve",
            max_model_len=service.frontend.max_model_len,
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    add_operations(app, service, api_key)

    async def generate(kind: str, request: Request):
        started = clock.now()
        try:
            _check_auth(api_key, request)
            body = await _json_body(request, max_request_bytes, body_timeout_s)
        except RequestError as error:
            service.rejected("http", error)
            raise
        admitted = await service.open(kind, body, "http")
        prepared = admitted.prepared
        logger.info(
            "%s: %d prompt tokens, max_tokens=%s, stream=%s (prepared in %.1f ms)",
            prepared.request_id,
            len(prepared.prompt_token_ids),
            prepared.sampling_params.max_tokens,
            prepared.stream,
            (clock.now() - started) * 1e3,
        )
        if prepared.stream:
            # wait for the first token before answering: a request the engine refuses (or that
            # no node can serve) gets its status code, as from vLLM's own server, not an event
            deltas = service.stream(admitted)
            try:
                first = await _unless_gone(request, anext(deltas))
            except StopAsyncIteration:
                first = None
            except ClientGone:
                await deltas.aclose()  # aborts the prefill, or gives its KV back
                logger.info("%s: client left before its first token", prepared.request_id)
                return Response(status_code=499)
            except BaseException:
                await deltas.aclose()
                raise
            stream = _sse(service, admitted, deltas, first)
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            got = await _unless_gone(request, service.collect(admitted))
        except ClientGone:
            logger.info("%s: client left; cancelled", prepared.request_id)
            return Response(status_code=499)
        frontend = service.frontend
        return JSONResponse(full_response(frontend.served_name, prepared, got, frontend.tokenizer))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate("chat", request)

    return app
