"""Turn OpenAI requests into `PreparedRequest`s: validated, templated and tokenized once.

This is the boundary: vLLM's OpenAI pydantic request classes come in, a plain domain dataclass
(token ids + vLLM `SamplingParams` + limits) goes out to the pools. Every rejection here is an
`InvalidRequest` / `ModelNotFound` with a message naming the problem.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from typing import Any

from pydantic import ValidationError

from pdserve.engine.types import CACHE_SALT_ARG
from router.errors import InvalidRequest, ModelNotFound
from router.fields import refused_field
from router.request import PreparedRequest, ResponseShape

WIRE_INTS = (-(1 << 63), (1 << 64) - 1)
"""The integers msgpack carries (vLLM sends a request to its EngineCore as msgpack): a larger
one in any field would fail there, after admission, as a server error."""


def _fields(value: Any) -> dict | None:
    """A struct's or dataclass's fields by name (None for anything else)."""
    names = getattr(type(value), "__struct_fields__", None)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
    return None if names is None else {name: getattr(value, name, None) for name in names}


def _wide_int(value: Any) -> bool:
    """Whether an integer outside `WIRE_INTS` is anywhere in `value`."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not WIRE_INTS[0] <= value <= WIRE_INTS[1]
    if isinstance(value, dict):
        return any(_wide_int(k) or _wide_int(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_wide_int(item) for item in value)
    fields = _fields(value)
    return fields is not None and any(_wide_int(v) for v in fields.values())


def _check_wire_ints(params: Any) -> None:
    for name, value in (_fields(params) or {}).items():
        try:
            wide = _wide_int(value)
        except RecursionError:
            raise InvalidRequest(f"{name} is nested too deeply", name) from None
        if wide:
            raise InvalidRequest(f"{name} holds an integer outside [-2**63, 2**64 - 1]", name)


def _validation_message(error: ValidationError) -> tuple[str, str | None]:
    errors = error.errors()
    first = errors[0]
    if not first["loc"]:
        return str(first["msg"]), None
    field_name = str(first["loc"][0])
    alternatives = [item for item in errors if item["loc"] and item["loc"][0] == first["loc"][0]]
    if len(alternatives) > 1:  # a union field: no single alternative's message is the reason
        return f"{field_name}: {type(first['input']).__name__} is not an accepted type", field_name
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}", field_name


def _client_errors() -> tuple[type[Exception], ...]:
    from vllm.exceptions import VLLMClientError

    return (ValueError, VLLMClientError)


def _message_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        part = dict(part)
        if part.get("type") != "text":
            raise InvalidRequest(f"content part type {part.get('type')!r} is not supported")
        parts.append(part.get("text", ""))
    return "".join(parts)


class Frontend:
    """Validation and tokenization for one served model."""

    def __init__(
        self,
        model_path: str,
        served_name: str,
        max_model_len: int,
        prompt_tokens_details: bool = False,
    ) -> None:
        from transformers import AutoTokenizer

        self.served_name = served_name
        self.max_model_len = max_model_len
        self.prompt_tokens_details = prompt_tokens_details
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def parse(self, kind: str, body: Any) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object")
        request_cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
        try:
            return request_cls.model_validate(body)
        except ValidationError as error:
            message, param = _validation_message(error)
            raise InvalidRequest(message, param) from None
        except _client_errors() as error:  # vLLM's own request checks
            raise InvalidRequest(str(error), getattr(error, "parameter", None)) from None
        except RecursionError:
            raise InvalidRequest("request body is nested too deeply") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_name:
            raise ModelNotFound(
                f"model {model!r} does not exist; this server serves {self.served_name!r}", "model"
            )

    def prepare(self, kind: str, body: Any) -> PreparedRequest:
        request = self.parse(kind, body)
        self.check_model(request.model)
        refused = refused_field(kind, request)
        if refused:
            name, why = refused
            raise InvalidRequest(f"{name} {why}", name)
        if kind == "completion":
            token_ids = self._completion_tokens(request)
            max_tokens = request.max_tokens
        else:
            token_ids = self._chat_tokens(request)
            max_tokens = request.max_completion_tokens
            if max_tokens is None:  # 0 is a value (refused below), not "unset"
                max_tokens = request.max_tokens
        token_ids = self._truncated(request, token_ids)
        echo_only = kind == "completion" and bool(request.echo) and max_tokens == 0
        max_tokens = self._check_lengths(len(token_ids), None if echo_only else max_tokens)
        try:
            params = request.to_sampling_params(max_tokens, {})
        except _client_errors() as error:  # SamplingParams' own checks (temperature < 0, ...)
            raise InvalidRequest(str(error), getattr(error, "parameter", None)) from None
        _check_wire_ints(params)
        if echo_only:
            params.max_tokens = 1  # vLLM's "echo without generation" runs one step
        salt = request.cache_salt or None  # vLLM's own model refused an empty one
        if salt:
            params.extra_args = {**(params.extra_args or {}), CACHE_SALT_ARG: salt}
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        suffix = request.request_id if "request_id" in request.model_fields_set else None
        return PreparedRequest(
            request_id=f"{prefix}-{suffix or uuid.uuid4().hex}",
            kind=kind,
            prompt_token_ids=token_ids,
            sampling_params=params,
            stream=bool(request.stream),
            shape=self._shape(kind, request, token_ids, echo_only),
            cache_salt=salt,
        )

    def _shape(
        self, kind: str, request: Any, token_ids: list[int], echo_only: bool
    ) -> ResponseShape:
        options = request.stream_options
        stream = bool(request.stream)
        if kind == "completion":
            logprobs = request.logprobs
        else:
            logprobs = request.top_logprobs if request.logprobs else None
        echo = kind == "completion" and bool(request.echo)
        return ResponseShape(
            n=request.n or 1,
            echo=echo,
            echo_only=echo_only,
            prompt_text=self.tokenizer.decode(token_ids) if echo else "",
            logprobs=logprobs,
            all_logprobs=bool(request.logprob_token_ids),
            return_token_ids=bool(request.return_token_ids),
            tokens_as_ids=bool(request.return_tokens_as_token_ids),
            include_usage=stream and bool(options and options.include_usage),
            continuous_usage=stream and bool(options and options.continuous_usage_stats),
            cached_tokens_detail=self.prompt_tokens_details,
        )

    def _truncated(self, request: Any, token_ids: list[int]) -> list[int]:
        """`truncate_prompt_tokens`: keep k tokens (-1: max_model_len), from the end unless
        `truncation_side` is "right"."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        if len(token_ids) <= keep:
            return token_ids
        return token_ids[:keep] if request.truncation_side == "right" else token_ids[-keep:]

    def _completion_tokens(self, request: Any) -> list[int]:
        prompt = request.prompt
        if prompt is None:
            raise InvalidRequest("prompt is required", "prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=request.add_special_tokens).input_ids
        vocab = len(self.tokenizer)
        if any(token >= vocab for token in prompt):
            raise InvalidRequest(f"prompt token ids must be below the vocabulary size {vocab}")
        return list(prompt)

    def _chat_tokens(self, request: Any) -> list[int]:
        if not request.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        messages = []
        for message in request.messages:
            message = dict(message)
            if "role" not in message:
                raise InvalidRequest("each message needs a role", "messages")
            messages.append(
                {"role": message["role"], "content": _message_text(message.get("content"))}
            )
        if request.add_generation_prompt and request.continue_final_message:
            raise InvalidRequest(
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )
        explicit = {
            "add_generation_prompt": request.add_generation_prompt,
            "continue_final_message": request.continue_final_message,
        }
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            **self._template_kwargs(request.chat_template_kwargs or {}, explicit),
            **explicit,
        )
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _template_kwargs(self, asked: dict, explicit: dict) -> dict:
        """The `chat_template_kwargs` the model's template reads. A client may not replace the
        template (`chat_template`) or have it tokenized (`tokenize`): 400, as from vLLM's
        server; keys the template never reads are dropped, and the request's own fields win
        over the same names here."""
        unexpected = sorted({"chat_template", "tokenize"} & asked.keys())
        if unexpected:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {unexpected}: the model's own template is "
                "used, as given",
                "chat_template_kwargs",
            )
        known = self._template_variables
        return {
            key: value
            for key, value in asked.items()
            if (known is None or key in known) and key not in explicit
        }

    @functools.cached_property
    def _template_variables(self) -> frozenset[str] | None:
        """The names the model's chat template reads from its context (None: it cannot be
        parsed here, so every name is passed on)."""
        import jinja2
        import jinja2.meta
        import jinja2.sandbox

        templates = self.tokenizer.chat_template or ""
        if isinstance(templates, dict):  # named templates: any of them may be used
            templates = "\n".join(templates.values())
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            extensions=["jinja2.ext.loopcontrols"]
        )
        try:
            return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(templates)))
        except jinja2.TemplateError:
            return None

    def _check_lengths(self, prompt_len: int, max_tokens: int | None) -> int:
        if prompt_len == 0:
            raise InvalidRequest("prompt is empty", "prompt")
        if max_tokens is not None and max_tokens <= 0:
            raise InvalidRequest(
                f"max_tokens must be at least 1 (or 0 with echo), got {max_tokens}", "max_tokens"
            )
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise InvalidRequest(
                f"prompt has {prompt_len} tokens; this model's max_model_len is "
                f"{self.max_model_len}, which leaves no room for output",
                "prompt",
            )
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})",
                "max_tokens",
            )
        return max_tokens
