"""The seam policy: which engine samples a request's first token. One decision, one place.

A disaggregated request crosses from a prefill engine to a decode engine, and the client must not
be able to tell (docs/design.md, "A request's life across the seam"). Token ids and KV bytes cross
the seam; the state an engine keeps *while sampling* does not: a structured-output grammar's
position, the seeded random generator, the output-token counts that presence and frequency
penalties read, the prefix of a multi-token bad word, the stop-string buffer, the thinking budget.
So each request is placed one of three ways:

- `FIRST_ON_PREFILL` — the prefill node samples the first token with the client's parameters and
  it goes to the client at once; the decode node continues from prompt + that token. Fastest time
  to first token, and exact even in bf16 (the decode engine recomputes nothing). Only for
  requests whose sampling keeps no state beyond the token ids: logprobs are assembled from the
  two legs, `min_tokens` is carried as a count.
- `FIRST_ON_DECODE` — the prefill node only computes the prompt's KV (its own token is
  discarded); the decode node runs the whole request from the bare prompt, recomputing the last
  prompt token and sampling every token with all of the request's state, exactly as one engine
  does. Costs the hand-over in the time to first token, and in bf16 the recomputed position may
  round differently from a prefill's (float32 is exact). Also serves `n > 1`: one prefill, `n`
  sequences decoded from its KV.
- `ONE_ENGINE` — prompt logprobs need the logits of every prompt position, which only the engine
  that computes the prompt has: one node serves the whole request.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pdserve_core.engine import budget
from pdserve_core.engine.types import OUTPUT_START_ARG

Placement = Literal["first_on_prefill", "first_on_decode", "one_engine"]
FIRST_ON_PREFILL: Placement = "first_on_prefill"
FIRST_ON_DECODE: Placement = "first_on_decode"
ONE_ENGINE: Placement = "one_engine"


def stateful_fields(params: Any) -> list[str]:
    """The sampling parameters of a request that keep state from one token to the next."""
    found = []
    if params.structured_outputs is not None:
        found.append("structured outputs")  # the grammar advances with every token
    if params.seed is not None and params.temperature > 0:
        found.append("seed")  # the generator advances with every sampled token
    if params.presence_penalty or params.frequency_penalty:
        found.append("presence/frequency penalty")  # they count output tokens only
    if params.bad_words:
        found.append("bad_words")  # a multi-token word is banned after its output prefix
    if params.stop:
        found.append("stop")  # a stop string may span the first token and the next ones
    if params.n > 1:
        found.append("n")  # each sequence samples its own first token
    for name in ("logits_processors", "thinking_token_budget", "repetition_detection"):
        if getattr(params, name, None):
            found.append(name)
    if getattr(params, "watermarking", None):
        found.append("watermarking")
    return found


def placement(params: Any) -> Placement:
    if params.prompt_logprobs is not None:
        return ONE_ENGINE
    if stateful_fields(params):
        return FIRST_ON_DECODE
    return FIRST_ON_PREFILL


def resumable(params: Any) -> bool:
    """Whether a stream cut mid-way can continue on another node from the tokens already sent:
    only when those tokens are all the state sampling needs (the same test as sampling the first
    token on the prefill node)."""
    return placement(params) == FIRST_ON_PREFILL


def continued(prepared: Any, sent: list[int]) -> Any:
    """The request that continues `prepared` after `sent` tokens: their ids appended to the
    prompt, the budget reduced by as many (what one engine would compute next)."""
    params = budget.after(prepared.sampling_params, len(sent))
    # where the client's prompt ends (the first resume's prompt, kept by later ones): each leg's
    # text continues from there, whatever byte the sent tokens end on
    extra = dict(params.extra_args or {})
    extra.setdefault(OUTPUT_START_ARG, len(prepared.prompt_token_ids))
    params.extra_args = extra
    return replace(
        prepared, prompt_token_ids=prepared.prompt_token_ids + sent, sampling_params=params
    )
