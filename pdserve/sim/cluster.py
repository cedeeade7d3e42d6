"""A discrete-event simulator of a pdserve cluster, driven by the calibrated step-time model.

What is simulated, and how closely it follows what runs:
- **Engines** step like vLLM's scheduler: each step first gives every running request its next
  tokens (one per decoding sequence, the next chunk of a prompt being computed), then admits
  waiting requests in arrival order while there are batch slots (`max_num_seqs`) and token
  budget (`max_num_batched_tokens`). A step costs what the node's `StepModel` says for its token
  mix; a step that admits handed-over requests also pays their KV pull (sync load: the pull holds
  the step). At the step's end each sequence that finished its prompt or decoded samples a token.
- **The router's routing is the router's own code**: each request's route comes from
  `router.routing.Routing` over `router.pools.Pool`s of the simulated engines' `Node`s — the same
  policies, load functions and placement rule, reading the same live state: the router's own
  counts, updated at once, and engine stats refreshed once per second, as the router's health
  checks do. The hand-over gap the router measures feeds the placement's average as it does in
  the router.
- **The seam**: the prefill node samples the first token (sent to the client), the decode node
  continues from prompt + that token (one token to compute, the rest loaded); a request's KV
  crosses the link in `kv_bytes / link_bandwidth + link_latency`.
- **What the client sees**: the first token arrives `request_overhead_s` after the step that
  sampled it, and every decode step costs `token_overhead_s` more than the step model says (both
  measured by `pdserve plan calibrate`: what the router adds on top of the engines' steps).
Not simulated: prefix caching, preemption (the KV cache is assumed large enough), the engines'
async output processing, network contention between hand-overs.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.bench.stats import RequestRecord
from pdserve.config import AutoscaleConfig, PlacementConfig, RouterConfig
from pdserve.engine.types import NodeStats
from pdserve.roofline.model import kv_bytes_per_token
from pdserve.roofline.specs import ModelSpec
from pdserve.roofline.stepmodel import StepModel
from router.autoscale import Autoscaler
from router.metrics.balance import Window, cost_pressure
from router.nodes import Node, NodeClient
from router.placement import Placement
from router.policies import make_policy
from router.pools import Pool
from router.routing import Route, Routing

STATS_PERIOD_S = 1.0
"""How often simulated engines report stats to the simulated router (its health-check period)."""


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
    token_overhead_s: float = 0.0
    """Added to every decode step (what the router costs the engines per token, measured)."""
    handover_latency_s: float = 0.0
    """Router → decode node: the relay of a prefilled request, beyond the KV pull."""
    placement: PlacementConfig = PlacementConfig()
    """`router.placement`, as a served cluster's config sets it."""
    policy: str = "least_outstanding"
    autoscale: AutoscaleConfig | None = None
    """`pools.autoscale`: move engines between the prefill and decode pools at run time
    (router/autoscale.py)."""
    tpot_target_s: float = RouterConfig.model_fields["tpot_target_s"].default
    """`router.tpot_target_s`: the decode side of the balance the autoscaler reads."""

    def __post_init__(self) -> None:
        if not self.colocated and not self.decode:
            raise ValueError("a topology needs decode nodes (or colocated ones)")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("colocated nodes do not mix with prefill/decode pools")


class _Client(NodeClient):
    """Simulated nodes are driven by the simulator; the router-side `Node` never calls them."""

    def stream(self, method, *args):  # pragma: no cover - never called
        raise NotImplementedError

    async def start(self):  # pragma: no cover
        raise NotImplementedError

    async def check_health(self):  # pragma: no cover
        return True

    async def stats(self):  # pragma: no cover
        raise NotImplementedError


@dataclass(eq=False)
class _Seq:
    """A request on one engine."""

    request: SimRequest
    to_compute: int
    """Prompt tokens left to compute on this engine."""
    to_generate: int
    """Tokens this engine still samples (1 on a prefill node)."""
    context: int
    """Tokens in this sequence's KV cache."""
    pull_s: float = 0.0
    """KV pull the step admitting it pays (a handed-over request)."""
    on_token: Callable[[float], None] | None = None
    on_done: Callable[[float], None] | None = None


class SimEngine:
    """One engine's continuous batching."""

    def __init__(self, name: str, spec: NodeSpec, model: ModelSpec, sim: Simulator) -> None:
        self.name, self.spec, self.model, self.sim = name, spec, model, sim
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy = False
        self.node = Node(name, _Client())
        self.node.stats = NodeStats(max_num_seqs=spec.max_num_seqs)
        self.node.reported = True
        self.totals = NodeStats(max_num_seqs=spec.max_num_seqs)

    def add(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self.totals.requests_started_total += 1
        if not self.busy:
            self._start_step()

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
        seconds = self.spec.step.seconds(
            self.model, prompt, prompt_seqs, decode, decode_seqs, context
        )
        if decode:
            seconds += self.sim.topology.token_overhead_s
        seconds += pulls
        totals = self.totals
        totals.busy_seconds_total += seconds
        totals.prompt_busy_seconds_total += seconds * prompt / (prompt + decode)
        totals.prompt_tokens_computed_total += prompt
        totals.engine_steps_total += 1
        self.busy = True
        self.sim.at(self.sim.now + seconds, lambda: self._end_step(scheduled))

    def _end_step(self, scheduled: list[tuple[_Seq, int]]) -> None:
        now = self.sim.now
        for seq, take in scheduled:
            if seq.to_compute:
                seq.to_compute -= take
                seq.context += take
                if seq.to_compute:
                    continue  # the prompt's next chunk comes in a later step
            else:
                seq.context += 1
            seq.to_generate -= 1
            if seq.on_token:
                seq.on_token(now)
            if seq.to_generate <= 0:
                self.running.remove(seq)
                self.totals.requests_finished_total += 1
                if seq.on_done:
                    seq.on_done(now)
        self._start_step()

    def report(self) -> None:
        """What the router's health check would read now."""
        stats = self.node.stats
        for name in (
            "busy_seconds_total",
            "prompt_busy_seconds_total",
            "prompt_tokens_computed_total",
            "requests_started_total",
            "requests_finished_total",
            "engine_steps_total",
        ):
            setattr(stats, name, getattr(self.totals, name))
        stats.running = len(self.running)
        stats.waiting = len(self.waiting)


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
    def __init__(self, topology: Topology, keep_tokens: bool = True) -> None:
        self.topology = topology
        self.keep_tokens = keep_tokens
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        m = topology.model

        def pool(role: str, specs: Sequence[NodeSpec]) -> list[SimEngine]:
            return [SimEngine(f"{role}-{i}", spec, m, self) for i, spec in enumerate(specs)]

        self.prefill = pool("prefill", topology.prefill)
        self.decode = pool("decode", topology.decode)
        self.colocated = pool("colocated", topology.colocated)
        self.placement = Placement(topology.placement)
        self._engine = {e.name: e for e in self._engines()}
        if self.colocated:
            self.routing = Routing(self._pool("colocated", self.colocated))
        else:
            self.routing = Routing(
                self._pool("decode", self.decode),
                self._pool("prefill", self.prefill),
                self.placement,
            )
        self.placements: dict[str, int] = {}
        self.gaps: list[float] = []
        self.autoscaler = Autoscaler(topology.autoscale) if topology.autoscale else None
        self.moves: list[dict] = []
        self._seen: dict[str, tuple[float, int]] = {}

    def _pool(self, role: str, engines: list[SimEngine]) -> Pool:
        return Pool(role, [e.node for e in engines], make_policy(self.topology.policy, role))

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def _engines(self) -> list[SimEngine]:
        return [*self.prefill, *self.decode, *self.colocated]

    def _report(self) -> None:
        for engine in self._engines():
            engine.report()
        if self._pending:
            self.at(self.now + STATS_PERIOD_S, self._report)

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        records = [RequestRecord(r.index, r.kind, r.prompt_tokens, r.at_s) for r in requests]
        self._pending = len(requests)
        for request, record in zip(requests, records, strict=True):
            self.at(request.at_s, lambda r=request, rec=record: self._arrive(r, rec))
        self.at(0.0, self._report)
        if self.autoscaler is not None:
            self.at(self.topology.autoscale.interval_s, self._autoscale)
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        busy = {e.name: e.totals.busy_seconds_total / self.now for e in self._engines()}
        return SimResult(records, self.now, dict(self.placements), self.gaps, busy, self.moves)

    # -- pools that follow the balance ------------------------------------------------------------

    def _pressure(self, engines: list[SimEngine], role: str, interval: float) -> float | None:
        """Mean pressure of a pool over the last interval, as router/metrics/balance.py's
        `cost_pressure` reads it from a node's stats."""
        values = []
        for engine in engines:
            busy, steps = engine.totals.busy_seconds_total, engine.totals.engine_steps_total
            last_busy, last_steps = self._seen.get(engine.name, (0.0, 0))
            rate = (busy - last_busy) / interval  # simulated steps take what the model says
            window = Window(
                seconds=interval,
                flops=0.0,
                bytes=0.0,
                busy=rate,
                prompt_busy=0.0,
                predicted_busy=rate,
                steps=(steps - last_steps) / interval,
            )
            stats = NodeStats(
                running=len(engine.running),
                waiting=len(engine.waiting),
                max_num_seqs=engine.spec.max_num_seqs,
            )
            values.append(cost_pressure(role, window, self.topology.tpot_target_s, stats))
        return sum(values) / len(values) if values else None

    def _autoscale(self) -> None:
        policy = self.topology.autoscale
        prefill = self._pressure(self.prefill, "prefill", policy.interval_s)
        decode = self._pressure(self.decode, "decode", policy.interval_s)
        for engine in self._engines():
            self._seen[engine.name] = (
                engine.totals.busy_seconds_total,
                engine.totals.engine_steps_total,
            )
        decision = self.autoscaler.decide(
            self.now, prefill, decode, len(self.prefill), len(self.decode)
        )
        if decision.action != "hold":
            source, target = (
                (self.decode, self.prefill)
                if decision.action == "to_prefill"
                else (self.prefill, self.decode)
            )
            # the least busy engine changes role; what it runs, it finishes
            engine = min(source, key=lambda e: (e.node.outstanding, len(e.running)))
            source.remove(engine)
            target.append(engine)
            self.routing.prefill.nodes = [e.node for e in self.prefill]
            self.routing.decode.nodes = [e.node for e in self.decode]
            self.moves.append(
                {
                    "at_s": self.now,
                    "action": decision.action,
                    "engine": engine.name,
                    "ratio": decision.ratio,
                    "prefill": len(self.prefill),
                    "decode": len(self.decode),
                }
            )
        if self._pending:
            self.at(self.now + policy.interval_s, self._autoscale)

    # -- the router --------------------------------------------------------------------------

    def _token(self, record: RequestRecord, when: float) -> None:
        """A token reaches the client (the first one after the router's measured overhead).
        Without `keep_tokens` only the first token's time is kept (TTFT and TPOT, no ITL)."""
        if not record.token_times_s:
            when += self.topology.request_overhead_s
        else:
            when = max(when, record.token_times_s[-1])  # a stream delivers in order
        if self.keep_tokens or not record.token_times_s:
            record.token_times_s.append(when)
            record.token_counts.append(1)
        record.output_tokens += 1
        record.end_s = when

    def _finish(self, record: RequestRecord, when: float) -> None:
        record.end_s = max(when, record.end_s or when)
        self._pending -= 1

    def _arrive(self, request: SimRequest, record: RequestRecord) -> None:
        route = self.routing.route(request.prompt_tokens, _Sampling(request.output_tokens))
        self._count(route)
        if route.split:
            self._remote(
                self._engine[route.node.name], self._engine[route.prefill.name], request, record
            )
        else:
            self._whole(self._engine[route.node.name], request, record)

    def _count(self, route: Route) -> None:
        """Placements as the router's metric labels them (where/reason); other routes by
        reason."""
        if route.placed(self.placement.mode):
            key = f"{route.where}/{route.reason}"
        else:
            key = route.reason
        self.placements[key] = self.placements.get(key, 0) + 1

    def _whole(self, engine: SimEngine, request: SimRequest, record) -> None:
        node = engine.node
        node.outstanding += 1
        node.outstanding_prompt_tokens += request.prompt_tokens
        node.prefilling_tokens += request.prompt_tokens
        first = [True]

        def on_token(when: float) -> None:
            if first[0]:
                first[0] = False
                node.prefilling_tokens -= request.prompt_tokens
            self._token(record, when)

        def on_done(when: float) -> None:
            node.outstanding -= 1
            node.outstanding_prompt_tokens -= request.prompt_tokens
            self._finish(record, when)

        engine.add(
            _Seq(request, request.prompt_tokens, request.output_tokens, 0, 0.0, on_token, on_done)
        )

    def _remote(self, decode: SimEngine, prefill: SimEngine, request: SimRequest, record) -> None:
        p_node, d_node = prefill.node, decode.node
        d_node.outstanding += 1
        d_node.outstanding_prompt_tokens += request.prompt_tokens
        p_node.outstanding += 1
        p_node.outstanding_prompt_tokens += request.prompt_tokens
        p_node.prefilling_tokens += request.prompt_tokens
        topology = self.topology
        kv_bytes = request.prompt_tokens * kv_bytes_per_token(topology.model)
        pull_s = kv_bytes / topology.link_bytes_per_s + topology.link_latency_s
        first_at: list[float] = []

        def decode_token(when: float) -> None:
            if len(first_at) == 1:
                gap = when - first_at[0]
                first_at.append(when)
                self.gaps.append(gap)
                self.placement.observe_handover(gap)
            self._token(record, when)

        def decode_done(when: float) -> None:
            d_node.outstanding -= 1
            d_node.outstanding_prompt_tokens -= request.prompt_tokens
            self._finish(record, when)

        def prefilled(when: float) -> None:
            p_node.prefilling_tokens -= request.prompt_tokens
            self._token(record, when)
            first_at.append(when)

        def handed_over(when: float) -> None:
            p_node.outstanding -= 1
            p_node.outstanding_prompt_tokens -= request.prompt_tokens
            if request.output_tokens <= 1:
                d_node.outstanding -= 1
                d_node.outstanding_prompt_tokens -= request.prompt_tokens
                self._finish(record, when)
                return
            seq = _Seq(
                request,
                1,
                request.output_tokens - 1,
                request.prompt_tokens,
                pull_s,
                decode_token,
                decode_done,
            )
            self.at(when + topology.handover_latency_s, lambda: decode.add(seq))

        prefill.add(_Seq(request, request.prompt_tokens, 1, 0, 0.0, prefilled, handed_over))


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
