"""A simulator of a pdserve cluster: the router's own code over engines driven by the calibrated
step-time model, in virtual time.

What runs, and how closely it follows what is served:
- **The router is the router's code**: `router.pools.Pool`s (their calls, counts, deadlines,
  silences and one-per-second health checks), `router.dispatch.Dispatcher` (the one routing
  decision, `router.decides.routing.Routing`, and the legs it runs: prefill, hand-over, decode) and,
  with `autoscale`, `router.decides.autoscale.PoolScaler` — on an asyncio loop whose clock jumps to
  its next timer (pdserve/sim/loop.py). What the router's metrics would count (routes, hand-over
  gaps, moves) is kept as they are told it.
- **Engines** (`SimNode`, reached as the router reaches a node) step like vLLM's scheduler: each
  step first gives every running request its next tokens (one per decoding sequence, the next
  chunk of a prompt being computed), then admits waiting requests in arrival order while there
  are batch slots (`max_num_seqs`) and token budget (`max_num_batched_tokens`). A step costs what
  the node's `StepModel` says for its token mix, then the gap before the next one (`gap_s`:
  outputs handed on, the next step scheduled); a step that admits handed-over requests also
  pays their KV pull (sync load: the pull holds the step). At the step's end each sequence that
  finished its prompt or decoded samples a token. A leg the router leaves is dropped.
- **The seam**: the prefill node samples the first token (sent to the client), the decode node
  continues from prompt + that token (one token to compute, the rest loaded); a request's KV
  crosses the link in `kv_bytes / link_bandwidth + link_latency`, after the router's relay
  (`handover_latency_s`).
- **What the client sees**: the first token arrives `request_overhead_s` after the step that
  sampled it (measured by `pdserve plan calibrate`: what the router adds on top of the engines'
  steps); later tokens at the engine's cadence, step and gap (the router relays one while the
  next is computed).
Not simulated: prefix caching, preemption (the KV cache is assumed large enough), the engines'
async output processing, network contention between hand-overs, failures.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pdserve.bench.stats import RequestRecord
from pdserve.sim import loop
from pdserve_core.config import PDServeConfig
from pdserve_core.engine.legs import Leg, Prefill, Whole
from pdserve_core.engine.types import NodeStats, TokenDelta
from pdserve_core.roofline.model import kv_bytes_per_token
from pdserve_core.roofline.specs import ModelSpec
from pdserve_core.roofline.stepmodel import StepModel, step_cost
from router import build, clock
from router.decides.autoscale import Decision
from router.decides.routing import Route
from router.links.nodes import Node, NodeClient
from router.request import PreparedRequest

DEADLINE_S = 1e9
"""A simulated request has no deadline."""


@dataclass(frozen=True)
class SimRequest:
    index: int
    at_s: float
    prompt_tokens: int
    output_tokens: int
    kind: str = "steady"


@dataclass(frozen=True)
class _Sampling:
    """What routing reads of a request's sampling parameters. A simulated request is plain
    (no state kept from one token to the next), so a split route samples its first token on the
    prefill node, as the router does for such a request."""

    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    prompt_logprobs: int | None = None
    structured_outputs: None = None
    seed: None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    bad_words: None = None
    stop: None = None
    logprobs: None = None


@dataclass(frozen=True)
class NodeSpec:
    """One simulated engine."""

    step: StepModel
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class Topology:
    model: ModelSpec
    prefill: Sequence[NodeSpec] = ()
    decode: Sequence[NodeSpec] = ()
    colocated: Sequence[NodeSpec] = ()
    link_bytes_per_s: float = 1e9
    link_latency_s: float = 0.0
    request_overhead_s: float = 0.0
    """Added to every first token (the router's path, measured)."""
    handover_latency_s: float = 0.0
    """Router → decode node: the relay of a prefilled request, beyond the KV pull."""
    config: PDServeConfig = PDServeConfig()
    """The served cluster's config: its `router` section and `pools.autoscale` build the
    simulated router exactly as they build the served one (router/build.py)."""

    def __post_init__(self) -> None:
        if not self.colocated and not self.decode:
            raise ValueError("a topology needs decode nodes (or colocated ones)")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("colocated nodes do not mix with prefill/decode pools")


class _Mailbox:
    """A leg's tokens on their way to its stream (a lighter asyncio.Queue: one reader)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[TokenDelta] = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, delta: TokenDelta) -> None:
        self.items.append(delta)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> TokenDelta:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.items.popleft()


@dataclass(eq=False)
class _Seq:
    """A request (one leg of it) on one engine."""

    to_compute: int
    """Prompt tokens left to compute on this engine."""
    to_generate: int
    """Tokens this engine still samples (1 on a prefill leg)."""
    context: int
    """Tokens in this sequence's KV cache."""
    deltas: _Mailbox
    """Where its tokens go, as `TokenDelta`s (the leg's stream reads them)."""
    pull_s: float = 0.0
    """KV pull the step admitting it pays (a handed-over request)."""
    handle: dict | None = None
    """A prefill leg's last delta carries it: what the decode leg pulls."""
    done: bool = False


class SimNode(NodeClient):
    """One simulated engine, reached the way the router reaches a node: `stream` runs a leg
    (pdserve_core/engine/legs.py: `Whole`, `Prefill`, `Decode`) and yields its tokens as the
    engine's steps sample them; `check_health` and `stats` answer the pool's health checks. It
    serves either role, so the autoscaler may move it."""

    def __init__(self, name: str, spec: NodeSpec, topology: Topology) -> None:
        self.spec, self.topology = spec, topology
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy = False
        self.totals = NodeStats(max_num_seqs=spec.max_num_seqs)
        self.node = Node(name, self)

    # -- the node as the router calls it ---------------------------------------------------------

    async def stream(self, leg: Leg):
        deltas = _Mailbox()
        prompt, params = len(leg.prompt_token_ids), leg.params
        if isinstance(leg, Whole):
            seq = _Seq(prompt, params.max_tokens, 0, deltas)
        elif isinstance(leg, Prefill):
            seq = _Seq(prompt, 1, 0, deltas, handle={"num_tokens": prompt})
        else:  # decode: the prompt's KV is pulled, the first token (when given) computed here
            topology = self.topology
            kv_bytes = leg.handle["num_tokens"] * kv_bytes_per_token(topology.model)
            pull_s = kv_bytes / topology.link_bytes_per_s + topology.link_latency_s
            seq = _Seq(1, params.max_tokens - len(leg.first_token_ids), prompt, deltas, pull_s)
            await asyncio.sleep(topology.handover_latency_s)
        self._add(seq)
        try:
            while True:
                delta = await deltas.get()
                yield delta
                if delta.finish_reason:
                    return
        finally:
            if not seq.done:  # the caller left: the engine drops the request
                self._drop(seq)

    async def check_health(self) -> bool:
        return True

    async def stats(self) -> NodeStats:
        totals = self.totals
        return replace(
            totals,
            running=len(self.running),
            waiting=len(self.waiting),
            predicted_busy_seconds_total=totals.busy_seconds_total,  # steps take what the
            busy_steps_total=totals.engine_steps_total,  # model says
        )

    async def start(self):  # pragma: no cover - a simulated node never restarts
        raise NotImplementedError

    # -- the engine ------------------------------------------------------------------------------

    def _add(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self.totals.requests_started_total += 1
        if not self.busy:
            self._start_step()

    def _drop(self, seq: _Seq) -> None:
        seq.done = True
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self.totals.requests_finished_total += 1

    def _start_step(self) -> None:
        budget = self.spec.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        for seq in self.running:
            take = min(seq.to_compute, budget) if seq.to_compute else (1 if budget else 0)
            if take:
                scheduled.append((seq, take))
                budget -= take
        pulls = 0.0
        while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
            seq = self.waiting.popleft()
            take = min(seq.to_compute, budget) if seq.to_compute else 1
            pulls += seq.pull_s
            self.running.append(seq)
            scheduled.append((seq, take))
            budget -= take
        if not scheduled:
            self.busy = False
            return
        prompt = prompt_seqs = decode = decode_seqs = context = 0
        for seq, take in scheduled:
            if seq.to_compute:
                prompt += take
                prompt_seqs += 1
            else:
                decode += take
                decode_seqs += 1
                context += seq.context
        cost = step_cost(self.topology.model, prompt, prompt_seqs, decode, decode_seqs, context)
        busy = self.spec.step.cost_seconds(cost) + pulls  # what vLLM reports as the step's time
        seconds = busy + self.spec.step.gap_s
        totals = self.totals
        totals.busy_seconds_total += busy
        totals.prompt_busy_seconds_total += busy * prompt / (prompt + decode)
        totals.prompt_tokens_computed_total += prompt
        totals.engine_steps_total += 1
        self.busy = True
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + seconds, self._end_step, scheduled)

    def _end_step(self, scheduled: list[tuple[_Seq, int]]) -> None:
        for seq, take in scheduled:
            if seq.done:
                continue  # dropped during the step
            seq.context += take
            if seq.to_compute:
                seq.to_compute -= take
                if seq.to_compute:
                    continue  # the prompt's next chunk comes in a later step
            seq.to_generate -= 1
            last = seq.to_generate <= 0
            seq.deltas.put(
                TokenDelta([0], "", "length" if last else None, handle=seq.handle if last else None)
            )
            if last:
                seq.done = True
                self.running.remove(seq)
                self.totals.requests_finished_total += 1
        self._start_step()


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    placements: dict[str, int] = field(default_factory=dict)
    handover_gaps_s: list[float] = field(default_factory=list)
    busy_share: dict[str, float] = field(default_factory=dict)
    moves: list[dict] = field(default_factory=list)
    """Autoscale decisions that moved an engine: time, action, ratio, pool sizes after."""


class Simulator:
    """The router's own pools, routing, dispatch, health checks and autoscaler over `SimNode`s,
    in virtual time (pdserve/sim/loop.py)."""

    def __init__(self, topology: Topology, keep_tokens: bool = True) -> None:
        self.topology = topology
        self.keep_tokens = keep_tokens
        self.placements: dict[str, int] = {}
        self.gaps: list[float] = []
        self.moves: list[dict] = []

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        return loop.run(self._run(requests))

    async def _run(self, requests: Sequence[SimRequest]) -> SimResult:
        topology = self.topology

        def nodes(role: str, specs: Sequence[NodeSpec]) -> list[SimNode]:
            return [SimNode(f"{role}-{i}", spec, topology) for i, spec in enumerate(specs)]

        self.engines = [
            *nodes("prefill", topology.prefill),
            *nodes("decode", topology.decode),
            *nodes("colocated", topology.colocated),
        ]
        self.mode = topology.config.router.placement.mode
        roles = ("colocated",) if topology.colocated else ("prefill", "decode")
        members = {
            role: [e.node for e in self.engines if e.node.name.startswith(role)] for role in roles
        }
        self.dispatcher = build.dispatcher(topology.config, members, self)
        watches = build.memberships(topology.config, self.dispatcher.pools.values())
        for watch in watches:
            watch.start()
        scaler = build.scaler(topology.config, self.dispatcher, self._moved)
        if scaler is not None:
            scaler.start()
        records = [RequestRecord(r.index, r.kind, r.prompt_tokens, r.at_s) for r in requests]
        served = [self._serve(r, rec) for r, rec in zip(requests, records, strict=True)]
        await asyncio.gather(*served)
        end = clock.now()
        if scaler is not None:
            await scaler.stop()
        for watch in watches:
            await watch.stop()
        busy = {e.node.name: e.totals.busy_seconds_total / end for e in self.engines}
        return SimResult(records, end, dict(self.placements), self.gaps, busy, self.moves)

    async def _serve(self, request: SimRequest, record: RequestRecord) -> None:
        """One client: sends at its time, reads every token the router streams back."""
        await asyncio.sleep(request.at_s - clock.now())
        prepared = PreparedRequest(
            f"sim-{request.index}",
            # prompts of their own: the simulated engines keep no prefix cache, so no prompt
            # shares blocks with another one (router/decides/prefixes.py would count them)
            [request.index + 1] + [0] * (request.prompt_tokens - 1),
            _Sampling(request.output_tokens),
            stream=True,
        )
        async for delta in self.dispatcher.deltas(prepared, clock.now() + DEADLINE_S):
            self._token(record, clock.now(), len(delta.token_ids))
        record.end_s = max(clock.now(), record.end_s or 0.0)

    def _token(self, record: RequestRecord, when: float, count: int) -> None:
        """Tokens reach the client (the first one after the router's measured overhead).
        Without `keep_tokens` only the first token's time is kept (TTFT and TPOT, no ITL)."""
        if not record.token_times_s:
            when += self.topology.request_overhead_s
        else:
            when = max(when, record.token_times_s[-1])  # a stream delivers in order
        if self.keep_tokens or not record.token_times_s:
            record.token_times_s.append(when)
            record.token_counts.append(count)
        record.output_tokens += count
        record.end_s = when

    # -- what the router tells its metrics, kept ------------------------------------------------

    def routed(self, route: Route) -> None:
        """Placements as the router's metric labels them (where/reason); other routes by
        reason."""
        key = f"{route.where}/{route.reason}" if route.placed(self.mode) else route.reason
        self.placements[key] = self.placements.get(key, 0) + 1

    def handed_over(self, seconds: float) -> None:
        self.gaps.append(seconds)

    def _moved(self, decision: Decision) -> None:
        if decision.reason != "moved":
            return
        prefill, decode = self.dispatcher.prefill, self.dispatcher.decode
        target = prefill if decision.action == "to_prefill" else decode
        self.moves.append(
            {
                "at_s": clock.now(),
                "action": decision.action,
                "engine": target.nodes[-1].name,
                "ratio": decision.ratio,
                "prefill": len(prefill.nodes),
                "decode": len(decode.nodes),
            }
        )


def simulate(
    topology: Topology, requests: Sequence[SimRequest], keep_tokens: bool = True
) -> SimResult:
    return Simulator(topology, keep_tokens).run(requests)


def requests_from_records(records: Sequence[RequestRecord]) -> list[SimRequest]:
    """The traffic of a bench run: send times, prompt lengths, output lengths (what was asked:
    the bench sends `ignore_eos`, so a finished request's output is its `max_tokens`)."""
    out = []
    for r in records:
        if not r.ok:
            continue
        out.append(SimRequest(r.index, r.sent_s, r.prompt_tokens, max(1, r.output_tokens), r.kind))
    return sorted(out, key=lambda r: r.at_s)


def cells(total: int, prefill: int, decode: int) -> int:
    """How many whole xPyD cells of (prefill + decode) engines fit in `total` engines."""
    return total // (prefill + decode) if prefill + decode else 0
