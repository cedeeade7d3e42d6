"""A request's legs, as typed values, and each leg's sampling parameters, derived from the
request's by one rule for every leg.

A request crosses the nodes in legs (a prefill, a decode, a whole request on one node). Each
leg's parameters are the request's, changed where the leg differs (its budget, what it asks the
KV connector), and they keep everything the router put in the request's `extra_args` — the
client's `cache_salt` (`CACHE_SALT_ARG`) above all: a leg that lost it would cache the prompt
where any tenant finds it. No vLLM import: it works on any `SamplingParams`-like object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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


# -- the legs themselves: what the router asks a node to run -------------------------------------
#
# The dispatcher builds one of these per leg, the pools carry it, the node client sends it (over
# Ray), and the engine actor runs it by its type (`EngineActor.handler`); the simulator and the
# test fakes read it by field. A new kind of node call is one new value here and its handler.


@dataclass(frozen=True)
class Whole:
    """A whole request on one node: its prompt computed and every token sampled there."""

    KIND: ClassVar[str] = "generate"
    request_id: str
    """The leg's vLLM request id (the router's internal id, never a client's)."""
    prompt_token_ids: list[int]
    params: Any
    """vLLM `SamplingParams`, as the request's (the node derives its engine's own)."""


@dataclass(frozen=True)
class Prefill:
    """The prompt's KV, kept for `readers` decode legs, and one token: the request's first when
    `sample_first` (router/decides/seam.py), else one only the KV's computation needed."""

    KIND: ClassVar[str] = "prefill"
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    sample_first: bool = True
    readers: int = 1
    """Completed pulls the KV's lease allows (the request's `n`)."""
    prefetch: str = ""
    """The key a decode node follows this prefill under ("": none)."""


@dataclass(frozen=True)
class Decode:
    """The request's tokens after `first_token_ids` (all of them when that is empty), decoded
    from the prefill's KV, which the node pulls through `handle`."""

    KIND: ClassVar[str] = "decode"
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    first_token_ids: list[int]
    handle: dict[str, Any]


Leg = Whole | Prefill | Decode


def computes_prompt(leg: Leg) -> bool:
    """Whether the leg computes its prompt (a decode leg loads it)."""
    return not isinstance(leg, Decode)
