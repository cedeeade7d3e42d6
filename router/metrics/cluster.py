"""Node and pool series, built from the stats each node reported in its last health check."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdserve_core.engine.types import QUEUE_TIME_BUCKETS
from pdserve_core.kv.stats import FAILURE_REASONS
from router.decides.rates import Window
from router.metrics.balance import (
    balance_ratio,
    cost_pressure,
    node_load,
    pool_load,
    step_times,
)


class PoolCollector:
    """Builds the node and pool series from `Pool.nodes` each time Prometheus scrapes."""

    def __init__(self, pools: dict[str, Any], window_s: float, tpot_target_s: float) -> None:
        self.pools, self.window_s, self.tpot_target_s = pools, window_s, tpot_target_s

    def collect(self):
        families = _NodeFamilies()
        loads: dict[str, float] = {}
        busy: dict[str, float] = {}
        pressures: dict[str, float] = {}
        for pool_name, pool in self.pools.items():
            node_loads, node_busy, node_pressures = [], [], []
            for node in pool.nodes:
                window = Window.of(node.history, self.window_s)
                families.add_node(pool_name, node, window)
                if node.healthy and node.reported:
                    node_loads.append(node_load(node.stats, window))
                    node_busy.append(window.predicted_busy if window else 0.0)
                    node_pressures.append(
                        cost_pressure(pool_name, window, self.tpot_target_s, node.stats)
                    )
            families.add_pool(pool_name, pool)
            load = pool_load(node_loads)
            if load is not None:
                loads[pool_name] = load
                families.pool_load.add_metric([pool_name], load)
            mean_busy = pool_load(node_busy)
            if mean_busy is not None:
                busy[pool_name] = mean_busy
                families.pool_cost.add_metric([pool_name], mean_busy)
            pressure = pool_load(node_pressures)
            if pressure is not None:
                pressures[pool_name] = pressure
                families.pool_pressure.add_metric([pool_name], pressure)
        yield from families.all()
        if "prefill" in self.pools and "decode" in self.pools:
            balance = GaugeMetricFamily(
                "pdserve_pool_balance_ratio",
                "Prefill pool load / decode pool load: > 1 prefill is the bottleneck (add "
                "prefill nodes), < 1 decode is.",
            )
            if "decode" in loads:
                balance.add_metric([], balance_ratio(loads.get("prefill", 0.0), loads["decode"]))
            yield balance
            cost_balance = GaugeMetricFamily(
                "pdserve_pool_balance_cost_ratio",
                "Prefill pool pressure / decode pool pressure in calibrated cost (prefill: share "
                "of time its prompt steps take; decode: predicted step time / TPOT target): > 1 "
                "prefill is the bottleneck.",
            )
            if "decode" in pressures:
                cost_balance.add_metric(
                    [], balance_ratio(pressures.get("prefill", 0.0), pressures["decode"])
                )
            yield cost_balance


class _NodeFamilies:
    """The metric families of one scrape, filled node by node."""

    def __init__(self) -> None:
        labels = ["pool", "node"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*labels, *extra])

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=[*labels, *extra])

        self.up = gauge("pdserve_node_up", "1 while the node is healthy and in its pool.")
        self.outstanding = gauge(
            "pdserve_node_requests_in_flight", "Requests the router has open on the node."
        )
        self.running = gauge("pdserve_node_requests_running", "Requests in the engine's batch.")
        self.waiting = gauge("pdserve_node_requests_waiting", "Requests queued in the engine.")
        self.kv_usage = gauge("pdserve_node_kv_cache_usage_ratio", "Share of KV cache in use.")
        self.prompt_tokens = counter(
            "pdserve_node_prompt_tokens",
            "Prompt tokens by how they got into the KV cache.",
            ("source",),
        )
        self.generation_tokens = counter(
            "pdserve_node_generation_tokens", "Output tokens generated."
        )
        self.busy = counter("pdserve_node_busy_seconds", "Time spent executing engine steps.")
        self.prompt_busy = counter(
            "pdserve_node_prompt_busy_seconds", "Share of step time spent on prompt tokens."
        )
        self.flops = counter(
            "pdserve_node_estimated_flops", "FLOPs of the steps run (roofline estimate)."
        )
        self.bytes = counter(
            "pdserve_node_estimated_memory_bytes",
            "Bytes of weights and KV cache the steps moved (roofline estimate).",
        )
        self.peak_flops = gauge(
            "pdserve_node_peak_flops_per_second", "The node's peak FLOP/s.", ("source",)
        )
        self.peak_bw = gauge(
            "pdserve_node_peak_memory_bandwidth_bytes_per_second",
            "The node's peak memory bandwidth.",
            ("source",),
        )
        self.compute_util = gauge(
            "pdserve_node_compute_utilization_ratio",
            "Achieved FLOP/s / peak FLOP/s over the router's window.",
        )
        self.bw_util = gauge(
            "pdserve_node_bandwidth_utilization_ratio",
            "Achieved bytes/s / peak bytes/s over the router's window.",
        )
        self.intensity = gauge(
            "pdserve_node_arithmetic_intensity_flops_per_byte",
            "FLOPs / bytes of the steps in the router's window.",
        )
        self.load = gauge(
            "pdserve_node_load_ratio", "Demand / capacity (see router/metrics/balance.py)."
        )
        self.steps = counter("pdserve_node_engine_steps", "Engine steps that computed tokens.")
        self.stalls = counter(
            "pdserve_node_engine_stalls",
            "Times every stream on the node stopped: a step far past its model, or a pause "
            "between steps with requests running (pdserve_core/engine/stats.py, STALL_S).",
        )
        self.stall_seconds = counter(
            "pdserve_node_engine_stall_seconds", "Those stalls' time past the model's prediction."
        )
        self.predicted_busy = counter(
            "pdserve_node_predicted_busy_seconds",
            "What the node's step-time model predicts its steps cost (calibrated or roofline).",
            ("model",),
        )
        self.step_seconds = gauge(
            "pdserve_node_step_seconds",
            "Mean step time over the router's window, measured and as the step model predicts.",
            ("kind",),
        )
        self.step_ratio = gauge(
            "pdserve_node_step_time_ratio",
            "Measured / predicted step time over the router's window (1: the model is right).",
        )
        self.gpu_sm = gauge("pdserve_node_gpu_sm_utilization_ratio", "NVML utilization.gpu.")
        self.gpu_mem = gauge(
            "pdserve_node_gpu_memory_controller_utilization_ratio", "NVML utilization.memory."
        )
        self.queue_time = HistogramMetricFamily(
            "pdserve_request_queue_time_seconds",
            "Time requests waited in the engine's queue before running.",
            labels=labels,
        )
        self.kv_bytes = counter(
            "pdserve_kv_transfer_bytes", "KV cache bytes moved between nodes.", ("direction",)
        )
        self.kv_seconds = counter(
            "pdserve_kv_transfer_seconds", "Time spent in KV transfers.", ("direction",)
        )
        self.kv_transfers = counter(
            "pdserve_kv_transfers", "Finished KV transfers.", ("direction",)
        )
        self.kv_blocks = counter(
            "pdserve_kv_handover_blocks",
            "Blocks of handed-over prompts at decode nodes: received from the prefill node, or "
            "already cached there (not sent).",
            ("outcome",),
        )
        self.kv_handovers = counter(
            "pdserve_kv_handovers",
            "Decode legs that arrived with a prefill node's KV: loaded, or recomputed (the decode "
            "engine computed the prompt itself: a failed pull, or KV that never crossed).",
            ("outcome",),
        )
        self.kv_in_flight = gauge("pdserve_kv_transfers_in_flight", "KV pulls in progress.")
        self.kv_failures = counter(
            "pdserve_kv_transfer_failures", "Failed KV pulls by reason.", ("reason",)
        )
        self.kv_expired = counter(
            "pdserve_kv_leases_expired", "KV leases that ended before a pull (blocks freed)."
        )
        self.kv_held = gauge(
            "pdserve_kv_blocks_held", "KV blocks a prefill node keeps for decode nodes."
        )
        self.kv_prefetches = counter(
            "pdserve_kv_prefetches",
            "KV streamed to a decode node while its prefill ran: used by the pull, or missed.",
            ("outcome",),
        )
        self.pool_nodes = GaugeMetricFamily(
            "pdserve_pool_nodes", "Nodes of each pool by state.", labels=["pool", "state"]
        )
        self.pool_in_flight = GaugeMetricFamily(
            "pdserve_pool_requests_in_flight",
            "Requests the router has open on the pool.",
            labels=["pool"],
        )
        self.pool_load = GaugeMetricFamily(
            "pdserve_pool_load_ratio",
            "Mean demand / capacity of the pool's healthy nodes (>= 1: requests queue).",
            labels=["pool"],
        )
        self.pool_pressure = GaugeMetricFamily(
            "pdserve_pool_cost_pressure_ratio",
            "Share of its budget the pool's work uses in calibrated cost (prefill: time its "
            "prompt steps take; decode: predicted step time / TPOT target).",
            labels=["pool"],
        )
        self.pool_cost = GaugeMetricFamily(
            "pdserve_pool_calibrated_busy_ratio",
            "Mean step seconds per second of the pool's nodes, priced by their step-time models.",
            labels=["pool"],
        )

    def add_node(self, pool: str, node: Any, window: Window | None) -> None:
        key = [pool, node.name]
        self.up.add_metric(key, 1.0 if node.healthy else 0.0)
        self.outstanding.add_metric(key, node.outstanding)
        if not node.reported:
            return
        stats = node.stats
        self.running.add_metric(key, stats.running)
        self.waiting.add_metric(key, stats.waiting)
        self.kv_usage.add_metric(key, stats.kv_cache_usage)
        for source, value in (
            ("computed", stats.prompt_tokens_computed_total),
            ("transferred", stats.prompt_tokens_transferred_total),
            ("cached", stats.prompt_tokens_cached_total),
        ):
            self.prompt_tokens.add_metric([*key, source], value)
        self.generation_tokens.add_metric(key, stats.generation_tokens_total)
        self.busy.add_metric(key, stats.busy_seconds_total)
        self.prompt_busy.add_metric(key, stats.prompt_busy_seconds_total)
        self.steps.add_metric(key, stats.busy_steps_total)
        self.stalls.add_metric(key, stats.stalls_total)
        self.stall_seconds.add_metric(key, stats.stall_seconds_total)
        if stats.step_model_source:
            model = stats.step_model_source.split(":", 1)[0]
            self.predicted_busy.add_metric([*key, model], stats.predicted_busy_seconds_total)
        times = step_times(window)
        if times and times[1] > 0:
            self.step_seconds.add_metric([*key, "measured"], times[0])
            self.step_seconds.add_metric([*key, "predicted"], times[1])
            self.step_ratio.add_metric(key, times[0] / times[1])
        self.flops.add_metric(key, stats.estimated_flops_total)
        self.bytes.add_metric(key, stats.estimated_bytes_total)
        if stats.peak_flops:
            source = stats.peaks_source
            self.peak_flops.add_metric([*key, source], stats.peak_flops)
            self.peak_bw.add_metric([*key, source], stats.peak_mem_bandwidth)
            if window is not None:
                # over the steps' own time when that is longer than the window: a step that began
                # before the window, or a health check answered late, counts whole in it, and no
                # step beats the peak (pdserve_core/engine/stats.py), so the ratios stay within one
                span = max(1.0, window.busy)
                self.compute_util.add_metric(key, window.flops / stats.peak_flops / span)
                self.bw_util.add_metric(key, window.bytes / stats.peak_mem_bandwidth / span)
        if window is not None and window.bytes > 0:
            self.intensity.add_metric(key, window.flops / window.bytes)
        if node.healthy:
            self.load.add_metric(key, node_load(stats, window))
        if stats.gpu_sm_utilization is not None:
            self.gpu_sm.add_metric(key, stats.gpu_sm_utilization)
            self.gpu_mem.add_metric(key, stats.gpu_memory_utilization)
        self._add_queue_time(key, stats)
        counters, gauges = stats.kv.counters, stats.kv.gauges
        for direction, nbytes, seconds, transfers in (
            ("sent", counters.bytes_sent, counters.seconds_sent, counters.transfers_sent),
            (
                "received",
                counters.bytes_received,
                counters.seconds_received,
                counters.transfers_received,
            ),
        ):
            labels = [*key, direction]
            self.kv_bytes.add_metric(labels, nbytes)
            self.kv_seconds.add_metric(labels, seconds)
            self.kv_transfers.add_metric(labels, transfers)
        for reason in FAILURE_REASONS:
            self.kv_failures.add_metric([*key, reason], counters.failures.get(reason, 0))
        recomputed = stats.handovers_recomputed_total
        self.kv_handovers.add_metric([*key, "loaded"], stats.handovers_total - recomputed)
        self.kv_handovers.add_metric([*key, "recomputed"], recomputed)
        self.kv_blocks.add_metric([*key, "received"], counters.blocks_received)
        self.kv_blocks.add_metric([*key, "cached"], counters.blocks_cached)
        self.kv_in_flight.add_metric(key, gauges.in_flight)
        self.kv_expired.add_metric(key, counters.leases_expired)
        self.kv_held.add_metric(key, gauges.blocks_held)
        self.kv_prefetches.add_metric([*key, "used"], counters.prefetches_used)
        self.kv_prefetches.add_metric([*key, "missed"], counters.prefetches_missed)

    def _add_queue_time(self, key: list[str], stats: Any) -> None:
        cumulative, buckets = 0, []
        for bound, count in zip(QUEUE_TIME_BUCKETS, stats.queue_time_counts, strict=True):
            cumulative += count
            buckets.append((repr(float(bound)), cumulative))
        buckets.append(("+Inf", cumulative + stats.queue_time_overflow))
        self.queue_time.add_metric(key, buckets, stats.queue_time_sum)

    def add_pool(self, name: str, pool: Any) -> None:
        healthy = len(pool.healthy_nodes())
        self.pool_nodes.add_metric([name, "healthy"], healthy)
        self.pool_nodes.add_metric([name, "unhealthy"], len(pool.nodes) - healthy)
        self.pool_in_flight.add_metric([name], sum(node.outstanding for node in pool.nodes))

    def all(self):
        return [value for value in vars(self).values() if hasattr(value, "samples")]
