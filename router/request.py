"""A request as the inside of the router sees it, once the edge has validated and tokenized it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from router import clock


@dataclass(frozen=True)
class ResponseShape:
    """What the client asked its response to look like (read only by the edges)."""

    n: int = 1
    echo: bool = False
    """Completions: the prompt text (and with logprobs, its logprobs) comes first."""
    echo_only: bool = False
    """Completions with echo and max_tokens 0: the response is the prompt alone."""
    prompt_text: str = ""
    logprobs: int | None = None
    """Completions: top logprobs per token; chat: `top_logprobs` when `logprobs` is true."""
    all_logprobs: bool = False
    """`logprob_token_ids` was given: every returned candidate is shown."""
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    """`return_tokens_as_token_ids`: logprob tokens as "token_id:<id>"."""
    include_usage: bool = False
    continuous_usage: bool = False
    cached_tokens_detail: bool = False
    """Report `usage.prompt_tokens_details.cached_tokens` (router.enable_prompt_tokens_details)."""


@dataclass
class PreparedRequest:
    request_id: str
    """The response's id (`cmpl-…` / `chatcmpl-…`; a client's `request_id` field goes here) and
    what the router's logs name the request by. Never sent to a node."""
    kind: str
    """"completion" or "chat": which response shape the edge builds."""
    prompt_token_ids: list[int]
    sampling_params: Any
    """vLLM `SamplingParams`, as the client's fields make them. The router reads them (the seam
    policy, the dispatcher, the limits, the response shapes) but changes only copies: a resumed
    stream's continuation (`seam.continued`); each node derives its leg's own."""
    stream: bool
    shape: ResponseShape = field(default_factory=ResponseShape)
    arrival: float = field(default_factory=clock.now)
    cache_salt: str | None = None
    """The client's `cache_salt`: its prompt shares cached blocks only with prompts of the same
    salt (on every node that computes or loads it)."""
    internal_id: str = field(default_factory=lambda: f"pds-{uuid.uuid4().hex}")
    """pdserve's own id for the request on the nodes: its legs' vLLM request ids, so the KV
    handle's and the lease's. Made here, never from a client's field: a client's id may be long,
    repeated by another client or crafted."""
