"""gRPC API (proto/pdserve/v1/generate.proto): server-streaming `Generate`, standard health
(grpc.health.v1) and server reflection — the gRPC edge of `RouterService` (router/service.py).

A `GenerateRequest` is converted at this edge into the OpenAI-shaped body the HTTP API takes,
and rendered by the same serving layer (vLLM's, `render`: router/faces/vllm_face.py `Renderer`), so
both APIs accept and reject the same requests; protobuf types go no further than this module.
Errors carry their gRPC status (router/errors.py). A cancelled call cancels the engine request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve_core.config import RouterConfig
from pdserve_core.engine.types import TokenDelta
from pdserve_core.tls import ServerFiles, read_bytes
from pdserve_proto.v1 import generate_pb2 as pb
from pdserve_proto.v1 import generate_pb2_grpc as pb_grpc
from router.errors import (
    EngineFailed,
    InvalidRequest,
    PoolUnavailable,
    RequestError,
    Unauthorized,
)
from router.faces.auth import authorized
from router.faces.connections import PerClient, grpc_options
from router.request import PreparedRequest
from router.service import RouterService

logger = logging.getLogger(__name__)

SERVICE = "pdserve.v1.Generation"

Render = Callable[[str, dict[str, Any], str], Awaitable[PreparedRequest]]
"""(kind, OpenAI-shaped body, request id) -> the request, validated and tokenized."""


def _status(error: RequestError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.grpc_status)


ENGINE_ERROR = "the engine ended the request with an error (the node's log says why)"


_OPTIONAL = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "n",
)  # fmt: skip
_REPEATED = ("stop", "stop_token_ids", "allowed_token_ids", "bad_words", "logprob_token_ids")


def _structured(output: pb.StructuredOutput) -> dict[str, Any] | None:
    kind = output.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        try:
            return {"json": json.loads(output.json_schema)}
        except json.JSONDecodeError as error:
            raise InvalidRequest(f"structured_output.json_schema is not JSON: {error}") from None
        except RecursionError:
            raise InvalidRequest("structured_output.json_schema is nested too deeply") from None
    if kind == "json_object":
        return {"json_object": True} if output.json_object else None
    if kind == "choice":
        return {"choice": list(output.choice.choices)}
    return {kind: getattr(output, kind)}


def _body(request: pb.GenerateRequest) -> tuple[str, dict[str, Any]]:
    """The OpenAI-shaped body (and endpoint kind) equivalent to a GenerateRequest: the same
    validation and the same behaviour as the HTTP API's completions."""
    options = request.sampling
    body: dict[str, Any] = {"stream": True}
    if request.model:
        body["model"] = request.model
    for name in _OPTIONAL:
        if options.HasField(name):
            body[name] = getattr(options, name)
    for name in _REPEATED:
        if getattr(options, name):
            body[name] = list(getattr(options, name))
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.include_stop_str_in_output:
        body["include_stop_str_in_output"] = True
    if options.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in options.logit_bias.items()}
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    if options.HasField("structured_output"):
        body["structured_outputs"] = _structured(options.structured_output)
    which = request.WhichOneof("input")
    if which == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if "logprobs" in body:  # the chat API spells it logprobs: true + top_logprobs: k
            body["top_logprobs"], body["logprobs"] = body["logprobs"], True
        return "chat", body
    if which == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    elif which == "text":
        body["prompt"] = request.text
    return "completion", body


def _logprobs(delta: TokenDelta) -> list[pb.TokenLogprobs]:
    out = []
    for token_id, position in zip(delta.token_ids, delta.logprobs or (), strict=False):
        top = [pb.Candidate(token_id=t, token=d or "", logprob=lp) for t, lp, _, d in position]
        chosen = next((c for c in top if c.token_id == token_id), pb.Candidate(token_id=token_id))
        out.append(pb.TokenLogprobs(chosen=chosen, top=top))
    return out


def _peer_host(peer: str) -> str:
    """The address in gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000")."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        rest = rest.rsplit(":", 1)[0]
    return rest.strip("[]")


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self,
        service: RouterService,
        render: Render,
        api_key: str | None,
        per_client: PerClient | None = None,
        cached_tokens: bool = False,
    ) -> None:
        self.service, self.render = service, render
        self.api_key = api_key
        self.per_client = per_client or PerClient(1 << 30)
        self.cached_tokens = cached_tokens
        """Report cached prompt tokens in usage (`router.enable_prompt_tokens_details`, as HTTP
        does): off, a client cannot probe what others' prompts left in the cache."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        client = _peer_host(context.peer() or "")
        if not self.per_client.take(client):
            error = self.per_client.refusal(client, "calls")
            self.service.rejected("grpc", error)
            await context.abort(_status(error), error.message)
        try:
            async for reply in self._generate(request, context):
                yield reply
        finally:
            self.per_client.give(client)

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            self._check_auth(context)
            kind, body = _body(request)
            prepared = await self.render(kind, body, f"grpc-{uuid.uuid4().hex}")
        except RequestError as error:
            self.service.rejected("grpc", error)
            await context.abort(_status(error), error.message)
        try:
            admitted = await self.service.open(prepared, "grpc")
        except RequestError as error:
            await context.abort(_status(error), error.message)
        completion: dict[int, int] = {}
        cached: int | None = None
        prompt_tokens = len(admitted.prepared.prompt_token_ids)
        try:
            async with aclosing(self.service.deltas(admitted)) as deltas:
                async for delta in deltas:
                    if delta.finish_reason == "error":  # HTTP's 500, as vLLM answers it
                        raise EngineFailed(ENGINE_ERROR)
                    count = completion.get(delta.index, 0) + len(delta.token_ids)
                    completion[delta.index] = count
                    if cached is None and delta.num_cached_tokens is not None:
                        cached = delta.num_cached_tokens
                    reply = pb.GenerateResponse(
                        token_ids=delta.token_ids,
                        text=delta.text,
                        index=delta.index,
                        logprobs=_logprobs(delta),
                    )
                    if delta.finish_reason:
                        reply.finish_reason = delta.finish_reason
                        reply.usage.prompt_tokens = prompt_tokens
                        reply.usage.completion_tokens = count
                        if self.cached_tokens:
                            reply.usage.cached_tokens = cached or 0
                    yield reply
        except RequestError as error:
            await context.abort(_status(error), error.message)

    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        if not authorized(self.api_key, metadata.get("authorization")):
            raise Unauthorized("missing or wrong API key (metadata `authorization: Bearer <key>`)")


HEALTH_INTERVAL_S = 1.0


async def follow_pools(health_servicer: Any, dispatcher: Any) -> None:
    """Keep grpc.health.v1 in step with the pools: SERVING while some node can take a request,
    NOT_SERVING while none can (runs until cancelled)."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    last = None
    while True:
        try:
            dispatcher.check_available()
            status = serving
        except PoolUnavailable:
            status = not_serving
        if status != last:
            for name in ("", SERVICE):
                await health_servicer.set(name, status)
            last = status
        await asyncio.sleep(HEALTH_INTERVAL_S)


def _credentials(tls: ServerFiles) -> grpc.ServerCredentials:
    """The gRPC face's certificate; with `client_ca_file`, clients must present one that CA
    signed."""
    client_ca = read_bytes(tls.client_ca_file, "client CA") if tls.client_ca_file else None
    pair = (read_bytes(tls.key_file, "key"), read_bytes(tls.cert_file, "certificate"))
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


async def create_server(
    service: RouterService,
    render: Render,
    address: str,
    router: RouterConfig,
    tls: ServerFiles | None = None,
) -> tuple[grpc.aio.Server, int, Any]:
    """Build and start the gRPC server with the `router` section's key, bounds and usage
    reporting; returns (server, bound port, health servicer)."""
    max_calls = router.max_connections
    server = grpc.aio.server(
        options=grpc_options(router.max_request_bytes), maximum_concurrent_rpcs=max_calls
    )
    generation = GenerationService(
        service,
        render,
        router.api_key,
        PerClient(router.max_connections_per_client),
        router.enable_prompt_tokens_details,
    )
    pb_grpc.add_GenerationServicer_to_server(generation, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["Generation"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, _credentials(tls))
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", SERVICE):
        await health_servicer.set(name, serving)
    logger.info("gRPC server listening on %s (port %d%s)", address, port, ", TLS" if tls else "")
    return server, port, health_servicer
