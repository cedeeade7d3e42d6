"""Which request fields pdserve refuses, and why — the one list (docs/api.md quotes
it). Every other field vLLM 0.32 accepts on /v1/completions and /v1/chat/completions behaves as
on one vLLM engine; these get a 400 naming the field instead of being silently ignored.

A field counts as sent when the client set it to something other than its default.
"""

from __future__ import annotations

from typing import Any

ENGINE_INTERNAL = "is engine-internal: pdserve sets it itself and never takes it from a client"

REFUSED: dict[str, str] = {
    "kv_transfer_params": ENGINE_INTERNAL,
    "ec_transfer_params": ENGINE_INTERNAL,
    "vllm_xargs": ENGINE_INTERNAL,
    "tools": "is not supported: pdserve serves no tool parser",
    "tool_choice": "is not supported: pdserve serves no tool parser",
    "use_beam_search": "is not supported: beam search needs every beam on one engine",
    "suffix": "is not supported: the served model has no fill-in-the-middle template",
    "prompt_embeds": "is not supported: pdserve serves token prompts",
    "mm_payload": "is not supported: pdserve serves text models",
    "media_io_kwargs": "is not supported: pdserve serves text models",
    "mm_processor_kwargs": "is not supported: pdserve serves text models",
    "return_mm_kwargs": "is not supported: pdserve serves text models",
    "documents": "is not supported: the chat template takes no documents here",
    "chat_template": "is not accepted from requests: the model's own template is used",
    "session_id": "is not supported: streaming-input sessions run on one engine",
    "priority": "is not supported: the engines schedule first come, first served",
    "watermarking": "is not supported",
    "routed_experts_prompt_start": "is not supported: the served model has no experts",
    "reasoning_effort": "is not supported: pdserve serves no reasoning parser",
    "thinking_token_budget": "is not supported: pdserve serves no reasoning parser",
    "repetition_detection": "is not supported",
    "return_token_offsets": "is not supported",
    "return_prompt_text": "is not supported",
}
"""Field -> why pdserve refuses it."""

CHAT_REFUSED = {"echo": "is not supported on chat completions"}


def refused_field(kind: str, request: Any) -> tuple[str, str] | None:
    """The first refused field this request sets, and why; None when there is none."""
    defaults = type(request).model_fields
    reasons = {**REFUSED, **(CHAT_REFUSED if kind == "chat" else {})}
    for name in sorted(request.model_fields_set & set(reasons)):
        value = getattr(request, name)
        if name == "tool_choice" and value in ("none", None):
            continue
        if value is None or value == defaults[name].default or value in ([], {}, ""):
            continue
        return name, reasons[name]
    return None
