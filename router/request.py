"""A request as the inside of the router sees it, once the edge has validated and tokenized it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from router import clock


@dataclass
class PreparedRequest:
    request_id: str
    """The id vLLM's serving layer gave it (`cmpl-…` / `chatcmpl-…`; a client's `request_id`
    field goes here) and what the router's logs name the request by. Never sent to a node."""
    prompt_token_ids: list[int]
    sampling_params: Any
    """vLLM `SamplingParams`, as the client's fields make them. The router reads them (the seam
    policy, the dispatcher, the limits, the response shapes) but changes only copies: a resumed
    stream's continuation (`seam.continued`); each node derives its leg's own."""
    stream: bool
    arrival: float = field(default_factory=clock.now)
    cache_salt: str | None = None
    """The client's `cache_salt`: its prompt shares cached blocks only with prompts of the same
    salt (on every node that computes or loads it)."""
    internal_id: str = field(default_factory=lambda: f"pds-{uuid.uuid4().hex}")
    """pdserve's own id for the request on the nodes: its legs' vLLM request ids, so the KV
    handle's and the lease's. Made here, never from a client's field: a client's id may be long,
    repeated by another client or crafted."""

    @property
    def log_id(self) -> str:
        """`request_id` as the router's logs write it: quoted, escaped and cut to 128
        characters — a client's id may carry newlines or terminal controls (log injection)."""
        return ascii(self.request_id[:128])


def num_logprobs(params: Any) -> int | None:
    """Candidates per sampled token the request asks for, or None: vLLM's own reading
    (`SamplingParams.num_logprobs`: `logprobs`, else as many as `logprob_token_ids` names — that
    field leaves `logprobs` None)."""
    return getattr(params, "num_logprobs", getattr(params, "logprobs", None))
