"""The HTTP face's own parts around vLLM's OpenAI server (router/faces/vllm_face.py): the guard in
front of it (`Guard`: bounded bodies, the pools' gate) and the routes the pools answer themselves
(`add_operations`: /health, /pdserve/v1/steps, /metrics)."""

from __future__ import annotations

import asyncio
import json
import logging
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve_core.engine.types import STEP_FIELDS
from router import clock
from router.errors import (
    NodeFailed,
    Overloaded,
    PayloadTooLarge,
    PoolUnavailable,
    RequestError,
    RequestTimeout,
    Unauthorized,
    error_body,
    for_status,
)
from router.faces.auth import authorized

logger = logging.getLogger(__name__)


def _headers(error: RequestError) -> dict[str, str] | None:
    return {"Retry-After": "1"} if isinstance(error, Overloaded) else None


def _error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.http_status, headers=_headers(error))


NODE_ANSWER_S = 10.0
"""How long an admin endpoint that asks every node waits for them (all at once): a node that
has not answered by then is named in the reply, not waited on."""

OPEN_PATHS = frozenset({"/health"})
"""Paths anyone may ask (the bare health check; its detail still needs the key)."""
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
"""The paths that run a request on the nodes: the pools' gate stands in front of them."""


_REQUEST: ContextVar[dict | None] = ContextVar("pdserve_http_request", default=None)
"""The generation request the guard is answering (its task's and its stream's)."""


def counted() -> None:
    """The router's service counts this HTTP request (it reached the pools' `generate`): the
    guard must not count it again as refused."""
    request = _REQUEST.get()
    if request is not None:
        request["counted"] = True


REFUSED_FIELDS = ("kv_transfer_params", "ec_transfer_params", "vllm_xargs")
"""Fields the router refuses from every client when they say anything (router/faces/vllm_face.py,
`prepare`: vLLM passes them to the engine only when truthy, the first two among the last's)."""


def runnable(body: bytes) -> bool:
    """Whether a generation request's body could reach the pools: a JSON object without a field
    the router refuses."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and not any(data.get(name) for name in REFUSED_FIELDS)


class Guard:
    """ASGI middleware in front of the OpenAI server:

    - with `router.api_key`, every path but /health needs the key (vLLM's own check covers
      /v1/* only: its schema, docs, /tokenize and /version would be open);
    - a request body is read whole, no further than `limit` bytes (413) and for no longer than
      `timeout_s` (408), before the server sees it;
    - a generation request meets the pools' gate (`service.gate`): 429 with
      Retry-After when the router is full, 503 when no node can serve — answered before the
      server starts a stream, so a streamed request gets its status as a whole one does; a body
      no node would run (not a JSON object, a refused field) goes on to its 400 instead. (A
      request that passes the gate and then finds the router full or the pools gone still gets
      the error, as an error event in its stream.)
    - a generation request vLLM's layer refuses before it reaches the pools (bad fields, an
      unknown model) is counted in `pdserve_requests_total` by its status, as the router's own
      refusals are.
    """

    def __init__(
        self, app: Any, service: Any, api_key: str | None, limit: int, timeout_s: float
    ) -> None:
        self.app, self.service, self.api_key = app, service, api_key
        self.limit, self.timeout_s = limit, timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        reads = scope["method"] not in ("GET", "HEAD", "OPTIONS")
        body = b""
        try:
            presented = (headers.get(b"authorization") or b"").decode("latin-1")
            if not authorized(self.api_key, presented):
                raise Unauthorized("missing or wrong API key (send `Authorization: Bearer <key>`)")
            if reads:
                body = await self._body(headers, receive)
                if scope["path"] in GENERATION_PATHS:
                    self._gate(body)
        except RequestError as error:
            self.service.rejected("http", error)
            await _error_response(error)(scope, receive, send)
            return
        if not reads:
            await self.app(scope, receive, send)
            return
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when the client leaves

        if scope["path"] not in GENERATION_PATHS:
            await self.app(scope, replay, send)
            return
        request: dict[str, Any] = {"counted": False, "status": None}

        async def watched(message: dict) -> None:
            if message["type"] == "http.response.start":
                request["status"] = message["status"]
            await send(message)

        token = _REQUEST.set(request)
        try:
            await self.app(scope, replay, watched)
        finally:
            _REQUEST.reset(token)
            status = request["status"]
            if not request["counted"] and status is not None and status >= 400:
                self.service.rejected("http", for_status(status))

    def _gate(self, body: bytes) -> None:
        """The pools' gate, for a body the pools could run. A body no node would ever run (not
        a JSON object, or carrying a field the router refuses) passes on to be refused as the
        client's mistake (400), whatever the pools' state: a bad request learns that it is bad,
        not that the service is down. The body is parsed here only when the gate refuses."""
        try:
            self.service.gate()
        except RequestError:
            if runnable(body):
                raise

    async def _body(self, headers: dict, receive: Any) -> bytes:
        declared = (headers.get(b"content-length") or b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds {self.limit}")
        raw = bytearray()
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                    raw += message.get("body", b"")
                    if len(raw) > self.limit:
                        raise PayloadTooLarge(f"request body exceeds {self.limit} bytes")
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise RequestTimeout(
                f"request body not received within {self.timeout_s:g} s (router.body_timeout_s)"
            ) from None
        return bytes(raw)


def _check_auth(api_key: str | None, request: Request) -> None:
    if not authorized(api_key, request.headers.get("authorization")):
        raise Unauthorized("missing or wrong API key (send `Authorization: Bearer <key>`)")


def _node_view(node) -> dict:
    """What /health says of one node: health, process, and its last reported load."""
    stats, asked = node.stats, node.stats_asked
    return {
        "name": node.name,
        "healthy": node.healthy,
        "pid": node.info.pid if node.info else None,
        "ray_node_id": node.info.ray_node_id if node.info else None,
        "requests_total": stats.requests_started_total,
        "outstanding": node.outstanding,
        "elsewhere": node.elsewhere,
        "prefilling_tokens": node.prefilling_tokens,
        "running": stats.running,
        "waiting": stats.waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "kv_blocks_held": stats.kv.gauges.blocks_held,
        "prefix_blocks_known": len(node.prefixes),
        "handovers": stats.handovers_total,
        "handovers_recomputed": stats.handovers_recomputed_total,
        "last_recompute": stats.last_recompute or None,
        "stats_age_s": None if asked is None else round(clock.now() - asked, 3),
    }


def add_operations(app: FastAPI, service: Any, api_key: str | None) -> None:
    """The routes the pools answer themselves: /health (the pools' health), the nodes' recent
    steps, and the router's /metrics; and the JSON body of a `RequestError` and of FastAPI's
    own refusals."""
    dispatcher = service.dispatcher

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, error: RequestError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own refusals (a body it cannot parse, an unknown path) in the same JSON
        shape as every other error, not `{"detail": …}`."""
        status = error.status_code
        body = {"error": {"message": str(error.detail), "type": HTTPStatus(status).phrase}}
        body["error"] |= {"param": None, "code": status}
        return JSONResponse(body, status_code=status, headers=error.headers)

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
