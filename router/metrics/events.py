"""The router's own instruments: request outcomes and the latencies clients see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from router import clock
from router.decides.placement import DECISIONS
from router.metrics.cluster import PoolCollector

LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Seconds; fine around CPU decode steps (20–100 ms) and GPU TTFTs, wide enough for CPU prefills."""
HANDOVER_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
    2.0, 5.0,
)  # fmt: skip
"""Seconds; fine around one decode step, where a hand-over should end."""

disable_created_metrics()  # no `_created` series: nothing here reads them


class RouterMetrics:
    """The router's own instruments, registered in a private registry with the pool collector."""

    def __init__(
        self,
        pools: dict[str, Any],
        mode: str,
        *,
        tpot_target_s: float,
        window_s: float = 15.0,
        nodes: bool = True,
    ) -> None:
        """`tpot_target_s`: `router.tpot_target_s`, the decode side of the balance. `nodes`:
        export the node and pool series too (one router of several does, so that a sum over
        the routers counts each node once)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._placement_mode = "remote"  # the watched dispatcher's (`watch`)
        self.requests = Counter(
            "pdserve_requests", "Requests by API and outcome.", ["api", "outcome"], registry=r
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Arrival at the router to the first token sent to the client.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive output tokens as the client sees them.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Per request: (end-to-end latency - time to first token) / (output tokens - 1).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Arrival at the router to the last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.routed_legs = Counter(
            "pdserve_routing_decisions",
            "Requests (or request legs) sent to each node.",
            ["pool", "node"],
            registry=r,
        )
        self.fallbacks = Counter(
            "pdserve_prefill_fallbacks",
            "Requests prefilled on a decode node because no prefill node was healthy.",
            registry=r,
        )
        self.decode_fallbacks = Counter(
            "pdserve_decode_fallbacks",
            "Requests served whole by a prefill node because no decode node was healthy.",
            registry=r,
        )
        self.placements = Counter(
            "pdserve_prefill_placements",
            "Where disaggregated requests' prompts were computed (router/decides/placement.py): "
            "remote (a prefill node, then the KV hand-over) or local (their decode node).",
            ["where", "reason"],
            registry=r,
        )
        self.expected_cached = Counter(
            "pdserve_prefix_expected_cached_tokens",
            "Prompt tokens the router expected the node computing each prompt to hold in its "
            "prefix cache (router/decides/prefixes.py); against pdserve_node_prompt_tokens_total"
            "{source=\"cached\"}, the engines' own count, it shows the record's error.",
            ["pool"],
            registry=r,
        )
        self.handover_gap = Histogram(
            "pdserve_handover_gap_seconds",
            "Remote prefills: the prefill's end (its token) to the decode node's first token.",
            buckets=HANDOVER_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "pdserve_request_retries",
            "Requests run again because a node of this pool failed under them "
            "(router/decides/retry.py).",
            ["pool"],
            registry=r,
        )
        self.resumes = Counter(
            "pdserve_stream_resumes",
            "Streams continued on another node after a node of this pool failed mid-stream.",
            ["pool"],
            registry=r,
        )
        self.autoscale = Counter(
            "pdserve_autoscale_decisions",
            "Autoscale checks by outcome: to_prefill / to_decode (a node moved), add_* / "
            "remove_* (a node started / stopped), or hold, with the reason "
            "(router/decides/autoscale.py).",
            ["action", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight", "Requests admitted and not finished.", registry=r
        )
        info = Gauge("pdserve_router_info", "The router's serving mode.", ["mode"], registry=r)
        info.labels(mode=mode).set(1)
        for pool in pools:
            self.retries.labels(pool=pool)
            self.resumes.labels(pool=pool)
            self.expected_cached.labels(pool=pool)
        if nodes:
            r.register(PoolCollector(pools, window_s, tpot_target_s))

    def watch_autoscale(self, scaler: Any) -> None:
        """Count every check of this router's autoscaler."""
        count = self.count_autoscale()
        scaler.on_decision = lambda d: count(d.action, d.reason)

    def count_autoscale(self) -> Callable[[str, str], None]:
        """Make the autoscale series (each outcome exists from zero); returns what counts one
        check, `count(action, reason)` (the keeper's checks, where several routers follow it)."""
        from router.decides.autoscale import OUTCOMES, REASONS

        for reason in REASONS:
            for action in OUTCOMES.get(reason, ("hold",)):
                self.autoscale.labels(action=action, reason=reason)
        return lambda action, reason: self.autoscale.labels(action=action, reason=reason).inc()

    def watch(self, dispatcher: Any) -> None:
        """Observe the dispatcher's routes and hand-overs; each placement reason of its mode
        exists from zero."""
        dispatcher.observer = self
        if dispatcher.mode == "disaggregated":
            self._placement_mode = dispatcher.placement.mode
            for reason, where in DECISIONS[self._placement_mode].items():
                self.placements.labels(where=where, reason=reason)

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, kept: each request takes the same few series again."""
        key = (metric, values)
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = metric.labels(*values)
        return series

    def routed(self, route: Any) -> None:
        """One request's route (router/decides/routing.py `Route`), counted per leg and by
        reason."""
        legs = route.legs()
        for pool, node in legs:
            self.child(self.routed_legs, pool, node).inc()
        computing = legs[0][0]  # the prefill leg's pool, or the whole request's
        self.child(self.expected_cached, computing).inc(route.cached_tokens)
        if route.reason == "no_prefill_node":
            self.fallbacks.inc()
        elif route.reason == "no_decode_node":
            self.decode_fallbacks.inc()
        elif route.placed(self._placement_mode):
            self.placements.labels(where=route.where, reason=route.reason).inc()

    def handed_over(self, seconds: float) -> None:
        self.handover_gap.observe(seconds)


class RequestTimer:
    """Latencies of one request, observed once for the run that served it.

    `tokens(count)` records tokens as they reach the router. Live (streamed requests) each is
    observed at once; buffered (non-streamed, which a retry may start over) they are kept and
    observed when the request finishes, and `restart()` drops a failed run's tokens."""

    def __init__(
        self, metrics: RouterMetrics, api: str, arrival: float | None = None, live: bool = True
    ) -> None:
        self.metrics, self.api, self.live = metrics, api, live
        self.arrival = arrival if arrival is not None else clock.now()
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0
        self._gaps: list[tuple[float, int]] = []
        """(seconds since the previous token arrival, tokens) kept while buffered."""

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = clock.now()
        if self.first is None:
            self.first = now
            if self.live:
                self.metrics.ttft.observe(now - self.arrival)
        elif self.live:
            self._observe_gap(now - self.last, count)
        else:
            self._gaps.append((now - self.last, count))
        self.last = now
        self.count += count

    def restart(self) -> None:
        self.first = self.last = None
        self.count = 0
        self._gaps.clear()

    def _observe_gap(self, seconds: float, count: int) -> None:
        for _ in range(count):
            self.metrics.itl.observe(seconds / count)

    def finished(self, outcome: str) -> None:
        self.metrics.child(self.metrics.requests, self.api, outcome).inc()
        if self.first is None:
            return
        if not self.live:
            self.metrics.ttft.observe(self.first - self.arrival)
            for seconds, count in self._gaps:
                self._observe_gap(seconds, count)
        if outcome != "success":
            return
        self.metrics.e2e.observe(self.last - self.arrival)
        if self.count > 1:
            self.metrics.tpot.observe((self.last - self.first) / (self.count - 1))
