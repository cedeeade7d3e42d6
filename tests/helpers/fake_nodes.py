"""Fake engine nodes for the router's tests: scripted `NodeClient`s with no Ray and no vLLM.

A fake node "generates" deterministic tokens: the token at absolute position p (prompt included)
has id 96 + p and text " t{p}" — so after the default 4-token prompt, ids 100, 101, ... — on
whichever node computes it, so a continuation elsewhere goes on with the same tokens. It records
every call and whether the router cancelled it. A KV-only prefill (the seam policy's first token
on the decode node) returns token 999, which must never reach a client. Faults are scripted per
node: `die_after` (the node dies after that many deltas of its next call), `silent_after` (its
link is cut after that many deltas: the stream and health checks hang until `speak()`),
`kv_failure` (its decode reports a failed KV pull), `delay_s` (between deltas), `first_finishes`
(its prefill's token ends the request). Like vLLM, it refuses more than `MAX_LOGPROBS` logprobs
(-1, "all", included) and otherwise returns as many candidates as asked, for each new token and,
with `prompt_logprobs`, for the prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from pdserve_core.config import RouterConfig
from pdserve_core.engine.blocks import BlockLog, block_hashes
from pdserve_core.engine.legs import Decode, Leg, Prefill
from pdserve_core.engine.types import (
    CACHE_SALT_ARG,
    KVLoadFailed,
    NodeInfo,
    NodeStats,
    RequestRejected,
    TokenDelta,
)
from router.decides.placement import Placement
from router.decides.policies import make_policy
from router.decides.retry import RetryPolicy
from router.dispatch import Dispatcher
from router.errors import NodeFailed
from router.links.nodes import Node, NodeClient
from router.membership import Membership
from router.pools import Hearing, Pool
from router.request import PreparedRequest
from router.service import RequestLimits

BLOCK_SIZE = 128
"""The fake engines' KV block size."""
MAX_LOGPROBS = 20
"""vLLM's default `max_logprobs`."""


def _asked(params: Any, name: str) -> int | None:
    value = getattr(params, name, None)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise RequestRejected(
            f"Requested {name} of {value}, which is greater than max allowed: {MAX_LOGPROBS}"
        )
    return value


def _candidates(token_id: int, count: int) -> list:
    """The token itself, then `count` made-up top candidates."""
    return [(token_id, -0.5, 1, f" t{token_id}")] + [
        (5000 + rank, -1.0 - rank, rank + 1, f" c{rank}") for rank in range(count)
    ]


def _with_logprobs(plan: list[TokenDelta], prompt: list[int], params: Any) -> list[TokenDelta]:
    # num_logprobs: `logprobs`, or as many as `logprob_token_ids` names (vLLM's reading)
    sample, ranked = _asked(params, "num_logprobs"), _asked(params, "prompt_logprobs")
    if sample is not None:
        plan = [replace(d, logprobs=[_candidates(d.token_ids[0], sample)]) for d in plan]
    if ranked is not None and plan:
        positions = [None] + [_candidates(t, ranked) for t in prompt[1:]]
        plan[0] = replace(plan[0], prompt_logprobs=positions)
    return plan


@dataclass
class Call:
    leg: Leg
    deltas: int = 0
    cancelled: bool = False
    finished: bool = False

    @property
    def method(self) -> str:
        """The leg's kind: "generate", "prefill" or "decode"."""
        return self.leg.KIND

    @property
    def request_id(self) -> str:
        return self.leg.request_id

    @property
    def prompt(self) -> list[int]:
        return list(self.leg.prompt_token_ids)

    @property
    def params(self) -> Any:
        return self.leg.params


@dataclass
class FakeNode(NodeClient):
    name: str
    die_after: int | None = None
    silent_after: int | None = None
    unreachable_after: int | None = None
    """After this many deltas the actor cannot be reached (Ray's ActorUnavailableError)."""
    kv_failure: bool = False
    delay_s: float = 0.0
    first_finishes: bool = False
    ends_in_error: bool = False
    """True: its legs that decode end with vLLM's finish reason "error" (the engine's own, as a
    grammar that rejects its sampled token: no pull failed)."""
    calls: list[Call] = field(default_factory=list)
    healthy: bool = True
    """False: the actor is dead (calls fail with NodeFailed)."""
    engine: bool = True
    """False: the actor lives without an engine (its health check says so; `start` builds one)."""
    starts: int = 0
    dropped: int = 0
    """Engines the router ended as stuck."""
    given_back: list = field(default_factory=list)
    """Handles the router gave back unread."""
    prefetches: list = field(default_factory=list)
    """(key, host, ports, prompt tokens, block size) of the prefills it was asked to follow."""
    silent: bool = False
    """True: nothing the node says reaches the router (a cut link); calls hang."""
    ended_follows: list = field(default_factory=list)
    """Prefetch keys the router said will not run here."""
    cached_tokens: int | None = None
    """What its first delta says its prefix cache held of the prompt."""
    blocks: BlockLog = field(default_factory=BlockLog)
    """The blocks its finished requests left, logged as the engine actor logs them (block size
    `BLOCK_SIZE`, its `NodeInfo`'s)."""
    _heard: asyncio.Event = field(default_factory=asyncio.Event)

    async def _hang_while_silent(self) -> None:
        while self.silent:
            self._heard.clear()
            await self._heard.wait()

    def speak(self) -> None:
        """The link is back."""
        self.silent = False
        self._heard.set()

    def token(self, position: int) -> TokenDelta:
        return TokenDelta([96 + position], f" t{position}")

    async def stream(self, leg: Leg) -> AsyncIterator[TokenDelta]:
        request_id, prompt, params = leg.request_id, leg.prompt_token_ids, leg.params
        call = Call(leg)
        self.calls.append(call)
        start = len(prompt)
        prefill = isinstance(leg, Prefill)
        if prefill:
            plan = [self.token(start) if leg.sample_first else TokenDelta([999], " kv-only")]
        elif isinstance(leg, Decode):
            first = len(leg.first_token_ids)
            plan = [self.token(start + i) for i in range(first, params.max_tokens)]
        else:
            plan = [self.token(start + i) for i in range(params.max_tokens)]
        if plan:
            finish = "stop" if prefill and self.first_finishes else "length"
            if self.ends_in_error and not prefill:
                finish = "error"
            handle = {"node": self.name, "request": request_id} if prefill else None
            plan[-1] = TokenDelta(plan[-1].token_ids, plan[-1].text, finish, None, 0, handle)
        plan = [replace(delta, num_prompt_tokens=len(prompt)) for delta in plan]
        if plan and self.cached_tokens is not None:
            plan[0] = replace(plan[0], num_cached_tokens=self.cached_tokens)
        plan = _with_logprobs(plan, prompt, params)
        try:
            for index, delta in enumerate(plan):
                if self.die_after is not None and index >= self.die_after:
                    self.die_after, self.healthy = None, False
                    raise NodeFailed("ActorDiedError", died=True)
                if self.unreachable_after is not None and index >= self.unreachable_after:
                    self.unreachable_after, self.healthy = None, False
                    raise NodeFailed("ActorUnavailableError")
                if self.silent_after is not None and index >= self.silent_after:
                    self.silent_after, self.silent = None, True
                await self._hang_while_silent()
                if isinstance(leg, Decode) and self.kv_failure:
                    raise KVLoadFailed("connect", "cannot reach KV server")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                call.deltas += 1
                yield delta
            call.finished = True
            produced = [t for delta in plan for t in delta.token_ids] if params.n == 1 else []
            salt = (params.extra_args or {}).get(CACHE_SALT_ARG)
            self.blocks.add(block_hashes(list(prompt) + produced[:-1], BLOCK_SIZE, salt))
        finally:
            call.cancelled = not call.finished

    async def start(self) -> NodeInfo:
        self.healthy = self.engine = True
        self.starts += 1
        return NodeInfo(self.name, 1 + self.starts, "ray-node", 2048, BLOCK_SIZE, 0.1)

    async def check_health(self) -> bool:
        await self._hang_while_silent()
        if not self.healthy:
            raise NodeFailed("ActorDiedError")
        return self.engine

    async def prefix_blocks(self, seen: int) -> tuple[int, list[list[int]]]:
        return self.blocks.since(seen)

    async def give_back(self, handle: dict) -> bool:
        self.given_back.append(handle)
        return True

    async def end_follow(self, key: str) -> bool:
        self.ended_follows.append(key)
        return True

    async def prefetch(self, *ask: Any) -> bool:
        self.prefetches.append(ask)
        return True

    async def drop_engine(self) -> None:
        self.engine = False
        self.dropped += 1

    async def stats(self) -> NodeStats:
        return NodeStats(max_num_seqs=64)


ROUTER = RouterConfig()
"""The router's settings as the config's defaults set them."""


def retry_policy(max_attempts: int = ROUTER.max_attempts, **settings) -> RetryPolicy:
    """The retry policy with the config's settings but for those given."""
    return RetryPolicy(
        max_attempts,
        settings.get("resume", ROUTER.stream_resume),
        settings.get("max_engine_deaths", ROUTER.max_engine_deaths),
    )


def request_limits() -> RequestLimits:
    """What one request may ask, as the config's defaults say."""
    return RequestLimits(ROUTER.max_n, ROUTER.max_schema_bytes, ROUTER.max_response_tokens)


def new_pool(
    name: str,
    nodes,
    policy: str = "least_outstanding",
    silence_s: float = ROUTER.node_silence_s,
    hearing=None,
) -> Pool:
    """A pool of `nodes` with the config's settings but for `policy` and `silence_s`."""
    return Pool(
        name,
        list(nodes),
        make_policy(policy, name),
        silence_s=silence_s,
        hearing=hearing,
    )


def membership(
    pool: Pool, stall_s: float = ROUTER.engine_stall_s, prefix_aware: bool = ROUTER.prefix_aware
) -> Membership:
    """The health checks of `pool`, with the config's settings unless told."""
    return Membership(pool, stall_s=stall_s, prefix_aware=prefix_aware)


def pool(
    name: str, *fakes: FakeNode, silence_s: float = ROUTER.node_silence_s, hearing=None
) -> Pool:
    nodes = [Node(f.name, f, NodeInfo(f.name, 1, "ray-node", 2048, BLOCK_SIZE, 0.1)) for f in fakes]
    return new_pool(name, nodes, "round_robin", silence_s, hearing)


def disaggregated(
    prefill: list[FakeNode],
    decode: list[FakeNode],
    fallback: bool = True,
    silence_s: float = ROUTER.node_silence_s,
    placement=None,
):
    hearing = Hearing()  # the pools share it, as in `pdserve serve`
    return Dispatcher.disaggregated(
        pool("prefill", *prefill, silence_s=silence_s, hearing=hearing),
        pool("decode", *decode, silence_s=silence_s, hearing=hearing),
        fallback,
        placement or placement_rule("remote"),
        prefix_aware=ROUTER.prefix_aware,
    )


def placement_rule(
    mode: str, step_cap_tokens: int = 0, initial_handover_s: float = 0.1, **settings
):
    """`Placement` in `mode` with `router.placement` settings (the config's defaults otherwise)."""
    from pdserve_core.config import PlacementConfig

    return Placement(PlacementConfig(mode=mode, **settings), step_cap_tokens, initial_handover_s)


def colocated(*fakes: FakeNode) -> Dispatcher:
    return Dispatcher.colocated(pool("colocated", *fakes), prefix_aware=ROUTER.prefix_aware)


class FakeSampling(SimpleNamespace):
    def clone(self) -> FakeSampling:
        return FakeSampling(**vars(self))

    @property
    def num_logprobs(self) -> int | None:
        """As vLLM reads it: `logprobs`, else as many as `logprob_token_ids` names."""
        if self.logprobs is not None:
            return self.logprobs
        ids = getattr(self, "logprob_token_ids", None)
        return len(ids) if ids else None


def sampling(**overrides: Any) -> FakeSampling:
    """A stand-in for vLLM's SamplingParams with the fields the router reads."""
    fields = dict(
        n=1,
        max_tokens=5,
        min_tokens=0,
        temperature=0.0,
        seed=None,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        bad_words=None,
        stop=None,
        structured_outputs=None,
        logprobs=None,
        prompt_logprobs=None,
        extra_args=None,
    )
    return FakeSampling(**{**fields, **overrides})


def prepared(
    max_tokens: int = 5, stream: bool = True, prompt_len: int = 4, **params: Any
) -> PreparedRequest:
    return PreparedRequest(
        request_id="cmpl-test",
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=sampling(max_tokens=max_tokens, **params),
        stream=stream,
    )


class Routes:
    """An observer that keeps each route the dispatcher carries out."""

    def __init__(self) -> None:
        self.seen, self.gaps = [], []

    def routed(self, route) -> None:
        self.seen.append(route)

    def handed_over(self, seconds: float) -> None:
        self.gaps.append(seconds)
