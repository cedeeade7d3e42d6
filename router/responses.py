"""OpenAI response bodies, shaped as vLLM's own server shapes them (the HTTP edge's half).

Built with vLLM's protocol classes from what the nodes sent (`TokenDelta`s, gathered per
sequence in `Collected`), so a client cannot tell pdserve's responses from one vLLM server's:
choices per sequence index, echo, logprobs (router/logprobs.py), prompt logprobs, token ids,
usage.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.types import TokenDelta
from router.logprobs import Tokens, chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from router.request import PreparedRequest
from router.service import Collected


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> Any:
    """Token counts; `cached` (prompt tokens found in the prefix cache) when it is reported."""
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    info = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    if cached is not None:
        info.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached)
    return info


def full_response(served: str, prepared: PreparedRequest, got: Collected, tokenizer: Any) -> dict:
    """The whole (non-streamed) response body."""
    shape, prompt = prepared.shape, prepared.prompt_token_ids
    tokens = Tokens(tokenizer, shape)
    prompt_positions = got.prompt_logprobs
    completion_total = sum(len(seq.token_ids) for seq in got.sequences.values())
    cached = got.num_cached_tokens if shape.cached_tokens_detail else None
    common = dict(
        id=prepared.request_id, model=served, usage=usage(len(prompt), completion_total, cached)
    )
    choices = []
    for index in sorted(got.sequences):
        seq = got.sequences[index]
        if prepared.kind == "completion":
            choices.append(_completion_choice(index, seq, prepared, tokens, prompt_positions))
        else:
            choices.append(_chat_choice(index, seq, prepared, tokens))
    if prepared.kind == "completion":
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse

        return CompletionResponse(choices=choices, **common).model_dump(exclude_none=True)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    body = ChatCompletionResponse(
        choices=choices,
        prompt_logprobs=vllm_prompt_logprobs(prompt_positions),
        prompt_token_ids=prompt if shape.return_token_ids else None,
        **common,
    )
    return body.model_dump(exclude_none=True)


def _completion_choice(index, seq, prepared, tokens, prompt_positions) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice

    shape, prompt = prepared.shape, prepared.prompt_token_ids
    token_ids, positions, text = seq.token_ids, seq.logprobs, "".join(seq.text)
    if shape.echo:
        echoed = "" if shape.return_token_ids else shape.prompt_text
        if shape.echo_only:
            token_ids, positions, text = prompt, prompt_positions, echoed
        else:
            token_ids, text = [*prompt, *token_ids], echoed + text
            positions = [*(prompt_positions or []), *positions]
    logprobs = None
    if shape.logprobs is not None:
        logprobs = completion_logprobs(token_ids, positions, shape, tokens)
    return CompletionResponseChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        prompt_logprobs=vllm_prompt_logprobs(prompt_positions),
        prompt_token_ids=prompt if shape.return_token_ids else None,
        token_ids=seq.token_ids if shape.return_token_ids else None,
    )


def _chat_choice(index, seq, prepared, tokens) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseChoice,
        ChatMessage,
    )

    shape = prepared.shape
    logprobs = None
    if shape.logprobs is not None:
        logprobs = chat_logprobs(seq.token_ids, seq.logprobs, shape, tokens)
    return ChatCompletionResponseChoice(
        index=index,
        message=ChatMessage(role="assistant", content="".join(seq.text)),
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        token_ids=seq.token_ids if shape.return_token_ids else None,
    )


class StreamShaper:
    """Server-sent event payloads of one streamed request, chunk by chunk."""

    def __init__(self, served: str, prepared: PreparedRequest, tokenizer: Any) -> None:
        self.served, self.prepared, self.shape = served, prepared, prepared.shape
        self.tokens = Tokens(tokenizer, self.shape)
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        self.cached: int | None = None

    def _response(self, choices: list, **extra: Any) -> Any:
        common = dict(id=self.prepared.request_id, model=self.served, choices=choices, **extra)
        if self.prepared.kind == "completion":
            from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

            return CompletionStreamResponse(**common)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

        return ChatCompletionStreamResponse(**common)

    def opening(self) -> list[str]:
        """Chat streams open with the assistant role for every sequence, as vLLM's do."""
        if self.prepared.kind != "chat":
            return []
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
        )

        chunks = []
        prompt = self.prepared.prompt_token_ids
        for index in range(self.shape.n):
            choice = ChatCompletionResponseStreamChoice(
                index=index, delta=DeltaMessage(role="assistant", content=""), finish_reason=None
            )
            extra: dict[str, Any] = {}
            if self.shape.return_token_ids:
                extra["prompt_token_ids"] = prompt
            if self.shape.continuous_usage:
                extra["usage"] = usage(len(prompt), 0)
            chunks.append(self._dump(self._response([choice], **extra)))
        return chunks

    def chunk(self, delta: TokenDelta) -> str:
        index, shape, prompt = delta.index, self.shape, self.prepared.prompt_token_ids
        if delta.num_cached_tokens is not None and self.cached is None:
            self.cached = delta.num_cached_tokens
        first = index not in self.started
        self.started.add(index)
        self.generated[index] = self.generated.get(index, 0) + len(delta.token_ids)
        token_ids, positions, text = delta.token_ids, delta.logprobs or [], delta.text
        extra: dict[str, Any] = {}
        if self.prepared.kind == "completion":
            choice_extra = {
                "prompt_token_ids": prompt
                if first and (shape.echo or shape.return_token_ids)
                else None
            }
            if first and shape.echo:
                echoed = "" if shape.return_token_ids else shape.prompt_text
                prompt_positions = delta.prompt_logprobs or []
                if shape.echo_only:
                    token_ids, positions, text = prompt, prompt_positions, echoed
                else:
                    token_ids, text = [*prompt, *token_ids], echoed + text
                    positions = [*prompt_positions, *positions]
            choice = self._completion_choice(delta, token_ids, positions, text, choice_extra)
        else:
            choice = self._chat_choice(delta)
        if shape.continuous_usage:
            extra["usage"] = usage(len(prompt), self.generated[index])
        return self._dump(self._response([choice], **extra))

    def _completion_choice(self, delta, token_ids, positions, text, extra) -> Any:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice

        logprobs = None
        if self.shape.logprobs is not None:
            offset = self.offsets.get(delta.index, 0)
            logprobs = completion_logprobs(token_ids, positions, self.shape, self.tokens, offset)
            if logprobs.tokens:
                self.offsets[delta.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return CompletionResponseStreamChoice(
            index=delta.index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if self.shape.return_token_ids else None,
            **extra,
        )

    def _chat_choice(self, delta: TokenDelta) -> Any:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
        )

        logprobs = None
        if self.shape.logprobs is not None:
            logprobs = chat_logprobs(delta.token_ids, delta.logprobs or [], self.shape, self.tokens)
        return ChatCompletionResponseStreamChoice(
            index=delta.index,
            delta=DeltaMessage(content=delta.text),
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if self.shape.return_token_ids else None,
        )

    def closing(self, prompt_tokens: int) -> list[str]:
        """The usage chunk, when the client asked for it."""
        if not self.shape.include_usage:
            return []
        cached = self.cached if self.shape.cached_tokens_detail else None
        total = usage(prompt_tokens, sum(self.generated.values()), cached)
        return [self._dump(self._response([], usage=total))]

    @staticmethod
    def _dump(chunk: Any) -> str:
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
