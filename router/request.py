"""A request as the inside of the router sees it, once the edge has validated and tokenized it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PreparedRequest:
    request_id: str
    kind: str
    """"completion" or "chat": which response shape the edge builds."""
    prompt_token_ids: list[int]
    sampling_params: Any
    """vLLM `SamplingParams` (opaque here: only the nodes read them, but `max_tokens`)."""
    stream: bool
    include_usage: bool
    arrival: float = field(default_factory=time.monotonic)
