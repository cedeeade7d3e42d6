"""A leg's sampling parameters, derived from its request's by one rule for every leg.

A request crosses the nodes in legs (a prefill, a decode, a whole request on one node). Each
leg's parameters are the request's, changed where the leg differs (its budget, what it asks the
KV connector), and they keep everything the router put in the request's `extra_args` — the
client's `cache_salt` (`CACHE_SALT_ARG`) above all: a leg that lost it would cache the prompt
where any tenant finds it. No vLLM import: it works on any `SamplingParams`-like object.
"""

from __future__ import annotations

from typing import Any

KV_TRANSFER_PARAMS = "kv_transfer_params"


def leg_params(request: Any, leg: Any | None = None, kv_transfer_params: Any = None) -> Any:
    """`leg` (default: a copy of `request`) carrying the request's extra args, with the leg's
    `kv_transfer_params` added: merged, never replaced."""
    leg = request.clone() if leg is None else leg
    extra = dict(request.extra_args or {})
    if kv_transfer_params is not None:
        extra[KV_TRANSFER_PARAMS] = kv_transfer_params
    leg.extra_args = extra or None
    return leg
