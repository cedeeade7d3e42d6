"""The HTTP face: vLLM's own OpenAI server, over the pools.

vLLM builds its OpenAI server's state from any `EngineClient` (vllm/engine/protocol.py): the
chat templates, tool and reasoning parsers, the Responses API, tokenize / detokenize, the
validation and the error bodies are all vLLM's, and each of them ends in one call,
`generate(engine_input, sampling_params, request_id)`. `PoolsEngineClient.generate` runs that
request through `RouterService` — admission, the router's limits, placement, the seam, retry
and stream resume, its deadline — and turns the nodes' `TokenDelta`s back into the
`RequestOutput`s vLLM's serving layer reads (`Outputs`).

vLLM enters the router here only, as Ray enters at router/links/ray_nodes.py only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import AsyncGenerator, Iterable, Sequence
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

import msgspec
from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from pdserve_core.engine import dtype
from pdserve_core.engine.types import CACHE_SALT_ARG, PositionLogprobs, TokenDelta
from router.decides.retry import RESTART
from router.errors import InvalidRequest, ModelNotFound, RequestError
from router.faces.openai_http import (
    GENERATION_PATHS,
    REFUSED_FIELDS,
    Guard,
    add_operations,
    counted,
)
from router.request import PreparedRequest, num_logprobs

SUPPORTED_TASKS = ("generate",)
ENGINE_INTERNAL = "is engine-internal: pdserve sets it itself and never takes it from a client"


def _position(candidates: PositionLogprobs | None) -> dict[int, Logprob] | None:
    """One position's candidates as vLLM keeps them (insertion order: the chosen token first)."""
    if candidates is None:
        return None
    return {token: Logprob(lp, rank, text) for token, lp, rank, text in candidates}


class _Sequence:
    """What one of the request's `n` sequences has produced so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None


class Outputs:
    """Turns one request's `TokenDelta`s into vLLM `RequestOutput`s: one per delta for a stream
    (`RequestOutputKind.DELTA`), or a single cumulative one at the end (`FINAL_ONLY`), as vLLM's
    own output processor does."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        prompt_text: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text = prompt_text
        self.n = getattr(params, "n", 1) or 1
        self.wants_logprobs = num_logprobs(params) is not None
        self.delta = getattr(params, "output_kind", None) != RequestOutputKind.FINAL_ONLY
        self.restart()

    def restart(self) -> None:
        """The request starts over (a non-streamed request retried from the beginning)."""
        self.sequences: dict[int, _Sequence] = {}
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.num_cached_tokens: int | None = None
        self.prompt_sent = False

    @property
    def finished(self) -> bool:
        done = [s for s in self.sequences.values() if s.finish_reason is not None]
        return len(done) >= self.n

    def add(self, delta: TokenDelta) -> RequestOutput | None:
        """Take one delta; a `RequestOutput` to yield now, or None (FINAL_ONLY until the end)."""
        seq = self.sequences.setdefault(delta.index, _Sequence())
        positions = [_position(p) or {} for p in delta.logprobs or ()]
        for token, position in zip(delta.token_ids, positions, strict=False):
            if token in position:
                seq.cumulative += position[token].logprob
        seq.text.append(delta.text)
        seq.token_ids += delta.token_ids
        seq.logprobs += positions
        seq.finish_reason = delta.finish_reason or seq.finish_reason
        if delta.stop_reason is not None:
            seq.stop_reason = delta.stop_reason
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [_position(p) for p in delta.prompt_logprobs]
        if delta.num_cached_tokens is not None and self.num_cached_tokens is None:
            self.num_cached_tokens = delta.num_cached_tokens
        if not self.delta:
            return None
        output = self._completion(delta.index, seq, delta.text, delta.token_ids, positions)
        return self._request_output([output])

    def final(self) -> RequestOutput:
        """FINAL_ONLY: every sequence, whole."""
        outputs = [
            self._completion(i, s, "".join(s.text), s.token_ids, s.logprobs)
            for i, s in sorted(self.sequences.items())
        ]
        return self._request_output(outputs)

    def _completion(
        self, index: int, seq: _Sequence, text: str, token_ids: list[int], logprobs: list
    ) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=seq.cumulative if self.wants_logprobs else None,
            logprobs=list(logprobs) if self.wants_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _request_output(self, outputs: list[CompletionOutput]) -> RequestOutput:
        prompt_logprobs = None if self.prompt_sent and self.delta else self.prompt_logprobs
        self.prompt_sent = self.prompt_sent or prompt_logprobs is not None
        return RequestOutput(
            self.request_id,
            self.prompt_text,
            self.prompt_token_ids,
            prompt_logprobs,
            outputs,
            self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )


def _http_error(error: RequestError) -> GracefulHTTPError:
    return GracefulHTTPError(error.message, HTTPStatus(error.http_status))


WIRE_INTS = (-(1 << 63), (1 << 64) - 1)
"""The integers msgpack carries (a node's vLLM sends each request to its EngineCore as msgpack):
a larger one in any sampling field would fail there, after admission, as a server error."""


def _wide_int(value: Any) -> bool:
    """Whether an integer outside `WIRE_INTS` is anywhere in `value` (a struct's or dataclass's
    fields, containers, keys)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not WIRE_INTS[0] <= value <= WIRE_INTS[1]
    if isinstance(value, dict):
        return any(_wide_int(k) or _wide_int(v) for k, v in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return any(_wide_int(item) for item in value)
    names = getattr(type(value), "__struct_fields__", None)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
    return any(_wide_int(getattr(value, name, None)) for name in names or ())


def _check_wire_ints(params: Any) -> None:
    """Refuse params the wire would: msgspec encodes them as the token plane will (in C, well
    under a microsecond), and only when that fails are they searched field by field, to name the
    field."""
    try:
        msgspec.msgpack.encode(params)
        return
    except (OverflowError, RecursionError):
        pass
    for name in getattr(type(params), "__struct_fields__", ()):
        try:
            wide = _wide_int(getattr(params, name, None))
        except RecursionError:
            raise InvalidRequest(f"{name} is nested too deeply", name) from None
        if wide:
            raise InvalidRequest(f"{name} holds an integer outside [-2**63, 2**64 - 1]", name)
    raise InvalidRequest("the sampling parameters hold what the engines' wire cannot carry")


def prepare(prompt: Any, sampling_params: Any, request_id: str) -> PreparedRequest:
    """The router's request for one prompt vLLM's serving layer rendered: token prompts only;
    every integer within what the engines' wire carries; a client's engine-internal fields
    refused; its `cache_salt` carried to every leg."""
    if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
        raise InvalidRequest("pdserve serves token prompts (no multi-modal or streaming input)")
    if sampling_params.extra_args:  # a client's kv_transfer_params, ec_transfer_params, xargs
        extra = sampling_params.extra_args
        # vLLM puts kv_ and ec_transfer_params among the client's vllm_xargs (the last field)
        field = next((name for name in REFUSED_FIELDS if name in extra), REFUSED_FIELDS[-1])
        raise InvalidRequest(f"{field} {ENGINE_INTERNAL}", field)
    _check_wire_ints(sampling_params)
    salt = prompt.get("cache_salt")
    if salt:
        sampling_params.extra_args = {CACHE_SALT_ARG: salt}
    stream = sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
    token_ids = list(prompt["prompt_token_ids"])
    return PreparedRequest(request_id, token_ids, sampling_params, stream, cache_salt=salt)


class PoolsEngineClient(EngineClient):
    """vLLM's `EngineClient` over pdserve's pools: `generate` is the router's dispatch; the
    configs, renderer and input processor are vLLM's own, built in the router's process from
    the same engine arguments the nodes use (no engine runs here)."""

    def __init__(self, service: Any, vllm_config: Any, api: str = "http") -> None:
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.service, self.api = service, api
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self._stopped = False

    @property
    def is_running(self) -> bool:
        return not self._stopped

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        return False  # a lost node is the pools' business: requests are retried or refused

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("the router is not serving")

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        if self.api == "http":
            counted()
        try:
            if lora_request is not None:
                raise InvalidRequest("pdserve serves no LoRA adapters")
            prepared = prepare(prompt, sampling_params, request_id)
            self._validate(prompt, sampling_params, request_id)
        except RequestError as error:
            self.service.rejected(self.api, error)
            raise _http_error(error) from None
        try:
            admitted = await self.service.open(prepared, self.api)
        except RequestError as error:
            raise _http_error(error) from None
        token_ids, stream = prepared.prompt_token_ids, prepared.stream
        text = prompt_text if prompt_text is not None else prompt.get("prompt")
        outputs = Outputs(request_id, token_ids, sampling_params, text)
        try:  # closing this generator (the client left) closes the request's legs at once
            async with aclosing(self.service.deltas(admitted)) as deltas:
                async for delta in deltas:
                    if delta is RESTART:
                        outputs.restart()
                        continue
                    out = outputs.add(delta)
                    if out is not None:
                        yield out
        except RequestError as error:
            raise _http_error(error) from None
        if not stream:
            yield outputs.final()

    def _validate(self, prompt: Any, sampling_params: Any, request_id: str) -> None:
        """vLLM's own checks, made where its engine client makes them, before any engine sees
        the request (token ids within the vocabulary, logprobs within `max_logprobs`, the
        prompt's length, the structured output's spec, …): refused here, a request takes no
        slot and reaches no node, with vLLM's message."""
        from vllm.exceptions import VLLMError

        try:
            processor = self.input_processor
            processor.process_inputs(request_id, prompt, sampling_params, SUPPORTED_TASKS)
        except (VLLMError, ValueError, TypeError, OverflowError) as error:
            raise InvalidRequest(str(error), getattr(error, "parameter", None)) from None

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("pdserve serves generative models only")

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Nothing to do: a request ends on its nodes when its generator is closed."""

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def check_health(self) -> None:
        self.service.dispatcher.check_available()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return SUPPORTED_TASKS

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("profile a node's engine on its node")

    async def stop_profile(self) -> None:
        raise NotImplementedError("profile a node's engine on its node")

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return False

    async def sleep(self, level: int = 1, mode: Any = "abort") -> None:
        raise NotImplementedError("pdserve nodes do not sleep")

    async def release_kv_cache_memory(self) -> None:
        raise NotImplementedError("pdserve nodes do not sleep")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return True

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request: Any) -> bool:
        return False

    async def pause_generation(self, *, mode: Any = "abort", clear_cache: bool = True) -> None:
        raise NotImplementedError("drain a pdserve node through its pool")

    async def resume_generation(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return False

    async def scale_elastic_ep(self, new_data_parallel_size: int, drain_timeout: int = 300) -> None:
        # vLLM's /scale_elastic_ep answers a ValueError with a 400 carrying its message (and
        # anything else with a bare 500)
        raise ValueError(SCALE_REFUSED)

    def shutdown(self, timeout: float | None = None) -> None:
        self._stopped = True


def vllm_args(model_dir: str, served_name: str, extra: Sequence[str] = ()) -> argparse.Namespace:
    """vLLM's own `serve` arguments for the face: the model, the name it is served under, and a
    user's front-end flags (`--tool-call-parser`, `--chat-template`, …) as `vllm serve` takes
    them."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="pdserve serve"))
    args = parser.parse_args(["--model", model_dir, "--served-model-name", served_name, *extra])
    validate_parsed_serve_args(args)
    return args


async def build_face(client_factory: Any, args: argparse.Namespace) -> Any:
    """vLLM's OpenAI app with its state built over `client_factory(vllm_config)` (vLLM's own
    /health and /metrics included: `serve_app` replaces them with the pools')."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.usage.usage_lib import UsageContext

    root = logging.getLogger()
    level = root.level  # building vLLM's server state leaves the root logger at ERROR
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
        UsageContext.OPENAI_API_SERVER
    )
    client = client_factory(vllm_config)
    app = build_app(args, SUPPORTED_TASKS, vllm_config.model_config)
    await init_app_state(client, app.state, args, SUPPORTED_TASKS)
    root.setLevel(level)
    for name in ("openai_serving_completion", "openai_serving_chat"):
        serving = getattr(app.state, name, None)
        if serving is not None:
            serving.beam_search = _no_beam_search
    return app


BEAM_SEARCH = "use_beam_search is not supported: beam search needs every beam on one engine"


async def _no_beam_search(*args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
    """vLLM's serving layer runs beam search as one single-token request per beam and step:
    over the pools each would be a prefill and a KV hand-over. Refused instead."""
    raise GracefulHTTPError(BEAM_SEARCH, HTTPStatus.BAD_REQUEST)
    yield  # pragma: no cover  (an async generator, as the serving layer iterates it)


SCALE_REFUSED = (
    "pdserve scales by nodes, not by vLLM's elastic expert parallelism: pools.autoscale moves "
    "nodes between the pools, and `pools.<name>.replicas` sets their number"
)


REPLACED_PATHS = frozenset({"/health", "/metrics"})
"""vLLM's routes the pools answer instead: health is the pools' (router/faces/openai_http.py), and
the metrics are the router's registry (vLLM's would be empty: no engine runs here)."""


def front_flags(config: Any) -> list[str]:
    """`vllm serve`'s flags for what the config already says: the engines' dtype, length and
    reasoning parser, the key, prompt-token details — then the user's own
    (`router.vllm_args`)."""
    engine, router = config.engine, config.router
    pools = config.pools
    gpu = any(pool.num_gpus for pool in (pools.colocated, pools.prefill, pools.decode))
    flags = ["--dtype", dtype.resolve(engine.dtype, gpu)]
    flags += ["--max-model-len", str(engine.max_model_len)]
    if engine.reasoning_parser:
        flags += ["--reasoning-parser", engine.reasoning_parser]
    if router.api_key:
        flags += ["--api-key", router.api_key]
    if router.enable_prompt_tokens_details:
        flags.append("--enable-prompt-tokens-details")
    return [*flags, *router.vllm_args]


def _instrumentator(cls: type) -> bool:
    return cls.__module__.startswith("prometheus_fastapi_instrumentator.")


async def serve_app(service: Any, config: Any, model_dir: str, served: str) -> Any:
    """`pdserve serve`'s HTTP app: vLLM's OpenAI server over `service`, with the engines' model
    settings and `router.vllm_args`, the pools' operations routes, and the guard in front
    (bounded bodies, the pools' gate)."""
    router = config.router
    args = vllm_args(model_dir, served, front_flags(config))
    app = await build_face(lambda vllm_config: PoolsEngineClient(service, vllm_config), args)
    routes = [r for r in app.router.routes if getattr(r, "path", None) not in REPLACED_PATHS]
    # each request walks the routes in order until one matches: the generation routes first
    # (no route before them matches their paths), not past twenty others
    first = [r for r in routes if getattr(r, "path", None) in GENERATION_PATHS]
    app.router.routes = first + [r for r in routes if r not in first]
    # vLLM's instrumentator times every request into vLLM's metrics registry, which the router
    # never exposes (its /metrics is the router's registry: docs/metrics.md)
    app.user_middleware = [m for m in app.user_middleware if not _instrumentator(m.cls)]
    add_operations(app, service, router.api_key)
    app.middleware_stack = None  # built again at the first request, with what is changed here
    app.add_middleware(
        Guard,
        service=service,
        api_key=router.api_key,
        limit=router.max_request_bytes,
        timeout_s=router.body_timeout_s,
    )
    return app


def _error(error: Any) -> RequestError:
    """A vLLM `ErrorResponse` as the router's error."""
    body = error.error
    if body.code == HTTPStatus.NOT_FOUND:
        return ModelNotFound(body.message, body.param)
    cls = InvalidRequest if 400 <= body.code < 500 else RequestError
    return cls(body.message, body.param)


def _invalid(error: Any) -> InvalidRequest:
    """A pydantic `ValidationError` as one message naming up to three problems. A field of
    several forms (`stop`: a string or a list of at most 4) fails once per form, and the form the
    value was not ("Input should be a valid string") says least: such complaints are left out
    when any other problem is found (a bound broken)."""
    problems = error.errors(include_url=False, include_input=False)
    telling = [p for p in problems if not p["type"].endswith("_type")] or problems
    said = dict.fromkeys(
        f"{'.'.join(str(part) for part in p['loc'])}: {p['msg']}" for p in telling[:3]
    )
    where = str(telling[0]["loc"][0]) if telling and telling[0]["loc"] else None
    return InvalidRequest("; ".join(said) or str(error), where)


class Renderer:
    """Renders an OpenAI-shaped body as vLLM's serving layer does for HTTP (the same
    validation, chat template, defaults and `max_tokens`): the gRPC face's requests take the
    path HTTP's take, up to `PoolsEngineClient`'s `prepare`."""

    def __init__(self, state: Any) -> None:
        self.state = state

    async def __call__(self, kind: str, body: dict[str, Any], request_id: str) -> PreparedRequest:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.exceptions import VLLMError

        chat = kind == "chat"
        try:
            if chat:
                request = ChatCompletionRequest.model_validate(body)
                serving = self.state.openai_serving_chat
                rendered = await serving.render_chat_request(request)
                limit = (
                    request.max_completion_tokens
                    if request.max_completion_tokens is not None
                    else request.max_tokens
                )
            else:
                request = CompletionRequest.model_validate(body)
                serving = self.state.openai_serving_completion
                rendered = await serving.render_completion_request(request)
                limit = request.max_tokens
            if isinstance(rendered, ErrorResponse):
                raise _error(rendered)
            inputs = rendered[1] if chat else rendered
            if len(inputs) != 1:
                raise InvalidRequest("a gRPC request carries one prompt")
            (prompt,) = inputs
            max_tokens = get_max_tokens(
                serving.model_config.max_model_len,
                limit,
                len(prompt["prompt_token_ids"]),
                serving.default_sampling_params,
                serving.override_max_tokens,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
            )
            params = request.to_sampling_params(max_tokens, serving.default_sampling_params)
        except ValidationError as error:
            raise _invalid(error) from None
        except (VLLMError, ValueError, TypeError, OverflowError) as error:
            raise InvalidRequest(str(error), getattr(error, "parameter", None)) from None
        return prepare(prompt, params, request_id)
