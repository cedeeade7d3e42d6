"""A request's token budget after some of its tokens were sampled elsewhere: the one rule the router
(a stream resumed on another node, router/decides/seam.py) and the decode node (the tokens the
prefill node sampled, decode_node/node.py) both apply. No vLLM import: it works on any
`SamplingParams`-like object with `clone()`."""

from __future__ import annotations

from typing import Any


def after(params: Any, produced: int) -> Any:
    """A copy of `params` for what follows `produced` tokens already sent: `max_tokens` and
    `min_tokens` reduced by as many (what one engine would still generate)."""
    rest = params.clone()
    rest.max_tokens = params.max_tokens - produced
    rest.min_tokens = max(0, params.min_tokens - produced)
    return rest
