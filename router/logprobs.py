"""Logprobs in OpenAI's formats, as vLLM's server writes them: the completions API's parallel
lists, the chat API's per-token entries with UTF-8 bytes, and prompt logprobs as vLLM's own
`Logprob` objects. The sampled token is named by its decoded text (or "token_id:<id>" when
asked), -inf is clamped at -9999, and the top candidates are counted as vLLM counts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.engine.types import PositionLogprobs
from router.request import ResponseShape

FLOOR = -9999.0
"""vLLM reports -inf logprobs as this (JSON has no infinity)."""


class Tokens:
    """How logprob candidates are named: decoded text, or "token_id:<id>" when asked."""

    def __init__(self, tokenizer: Any, shape: ResponseShape) -> None:
        self.tokenizer, self.as_ids = tokenizer, shape.tokens_as_ids

    def name(self, token_id: int, decoded: str | None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self.tokenizer.decode([token_id])


def _find(position: PositionLogprobs | None, token_id: int):
    for candidate in position or ():
        if candidate[0] == token_id:
            return candidate
    return None


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    shape: ResponseShape,
    tokens: Tokens,
    offset: int = 0,
) -> Any:
    """The completions API's logprobs: tokens, their logprobs, the top candidates (the sampled
    token and `logprobs` more), and each token's text offset starting at `offset`."""
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

    names, values, tops, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = _find(position, token_id) if position is not None else None
        if position is None or chosen is None:
            names.append(tokens.name(token_id, None))
            values.append(None)
            tops.append(None)
        else:
            names.append(tokens.name(token_id, chosen[3]))
            values.append(max(chosen[1], FLOOR))
            tops.append(
                {
                    tokens.name(tid, decoded): max(logprob, FLOOR)
                    for i, (tid, logprob, _, decoded) in enumerate(position)
                    if shape.all_logprobs or shape.logprobs == -1 or shape.logprobs >= i
                }
            )
        offsets.append(offset if not offsets else offsets[-1] + len(names[-2]))
    return CompletionLogProbs(
        text_offset=offsets, token_logprobs=values, tokens=names, top_logprobs=tops
    )


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    shape: ResponseShape,
    tokens: Tokens,
) -> Any:
    """The chat API's logprobs: per token its text, logprob, UTF-8 bytes and `top_logprobs`."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProb,
        ChatCompletionLogProbs,
        ChatCompletionLogProbsContent,
    )

    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = _find(position, token_id)
        if chosen is None:
            name = tokens.name(token_id, None)
            content.append(ChatCompletionLogProbsContent(token=name, bytes=_utf8(name)))
            continue
        top = []
        for i, (tid, logprob, _, decoded) in enumerate(position):
            if (
                shape.all_logprobs
                or shape.logprobs == -1
                or (shape.logprobs is not None and i < shape.logprobs)
            ):
                name = tokens.name(tid, decoded)
                top.append(
                    ChatCompletionLogProb(
                        token=name, logprob=max(logprob, FLOOR), bytes=_utf8(name)
                    )
                )
        content.append(
            ChatCompletionLogProbsContent(
                token=tokens.name(token_id, chosen[3]),
                logprob=max(chosen[1], FLOOR),
                bytes=None if chosen[3] is None else _utf8(chosen[3]),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogProbs(content=content)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def vllm_prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> Any:
    """Prompt logprobs as vLLM returns them: {token id: Logprob} per position, -inf clamped."""
    if positions is None:
        return None
    from vllm.logprobs import Logprob

    return [
        None
        if position is None
        else {
            tid: Logprob(max(logprob, FLOOR), rank, decoded)
            for tid, logprob, rank, decoded in position
        }
        for position in positions
    ]
