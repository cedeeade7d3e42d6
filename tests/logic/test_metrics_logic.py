"""Pure logic behind the metrics: the per-step roofline estimate, the stats collector, rate
windows, load and balance, request timing, and the series the pool collector exports."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve_core.engine.stats import StatsCollector
from pdserve_core.engine.types import QUEUE_TIME_BUCKETS, NodeStats
from pdserve_core.roofline.live import Peaks, resolve_peaks, step_work
from pdserve_core.roofline.model import kv_bytes_per_token, weight_bytes
from pdserve_core.roofline.specs import PRESETS
from router.decides.rates import Window, counters
from router.links.nodes import Node
from router.metrics import RequestTimer, RouterMetrics
from router.metrics import events as events_module
from router.metrics.balance import balance_ratio, node_load, pool_load
from router.pools import Pool
from tests.helpers.fake_nodes import new_pool

SMOL = PRESETS["smollm2-135m"]  # 576 hidden, 30 layers, 9 heads, 3 KV heads, 64 head dim, 1536


def linear_flops_per_token(m) -> int:
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    h, i = m.hidden_size, m.intermediate_size
    return 2 * m.num_layers * (h * q + 2 * h * kv + q * h + 3 * h * i)


def test_decode_step_by_hand():
    # 4 sequences with 1000 cached tokens together, one new token each
    work = step_work(SMOL, 0, 0, 4, 4, 1000)
    attention = 4 * 9 * 64 * 30 * (4 * 1000 / 4)
    head = 2 * 4 * 576 * 49152
    assert work.flops == pytest.approx(4 * linear_flops_per_token(SMOL) + head + attention)
    kv = kv_bytes_per_token(SMOL)  # 2 · 3 · 64 · 30 · 2 = 23,040
    assert kv == 23_040
    assert work.bytes == pytest.approx(weight_bytes(SMOL) + kv * 1000 + kv * 4)


def test_prefill_chunk_by_hand():
    # one 512-token prompt: causal attention sees 256 tokens on average; its K/V read once
    work = step_work(SMOL, 512, 1, 0, 0, 0)
    attention = 4 * 9 * 64 * 30 * (512 * 512 / 2)
    head = 2 * 576 * 49152
    assert work.flops == pytest.approx(512 * linear_flops_per_token(SMOL) + head + attention)
    kv = kv_bytes_per_token(SMOL)
    assert work.bytes == pytest.approx(weight_bytes(SMOL) + kv * 512 + kv * 512)


def test_prefill_intensity_is_far_above_decode():
    prefill = step_work(SMOL, 512, 1, 0, 0, 0)
    decode = step_work(SMOL, 0, 0, 1, 1, 100)
    assert prefill.flops / prefill.bytes > 50 * (decode.flops / decode.bytes)
    assert decode.flops / decode.bytes < 2  # GEMV: about one FLOP per weight byte (bf16)
    assert step_work(SMOL, 0, 0, 0, 0, 0).flops == 0


def test_peaks_from_config_and_catalog():
    assert resolve_peaks(flops=1e12, mem_bandwidth=1e11) == Peaks(1e12, 1e11, "config")
    h100 = resolve_peaks(device="h100-sxm")
    assert (h100.flops, h100.mem_bandwidth, h100.source) == (989e12, 3.35e12, "catalog:h100-sxm")
    assert resolve_peaks(device="h100-sxm", flops=5e14).flops == 5e14


def _details(prompt, prompt_seqs, decode, decode_seqs, ms):
    return SimpleNamespace(
        num_ctx_tokens=prompt,
        num_ctx_requests=prompt_seqs,
        num_generation_tokens=decode,
        num_generation_requests=decode_seqs,
        elapsed_ms=ms,
        is_dummy=False,
    )


def _scheduler(details, running=1, waiting=0, usage=0.1):
    return SimpleNamespace(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        kv_cache_usage=usage,
        kv_connector_stats=None,
        iteration_details=details,
    )


def test_collector_splits_step_time_by_token_mix_and_adds_work():
    stats = NodeStats()
    collector = StatsCollector(stats)
    collector.model = SMOL
    stats.decode_context_tokens = 300
    collector.record(_scheduler(_details(96, 1, 32, 32, 200.0)), None)
    assert stats.busy_seconds_total == pytest.approx(0.2)
    assert stats.prompt_busy_seconds_total == pytest.approx(0.2 * 96 / 128)
    # by hand, as in the two tests above: 96 prompt tokens of one prompt and 32 decoding
    # sequences holding 300 context tokens; the LM head for 33 sequences
    attention = 4 * 9 * 64 * 30 * (96 * 96 / 2 + 300)
    head = 2 * 33 * 576 * 49152
    flops = 128 * linear_flops_per_token(SMOL) + head + attention
    assert stats.estimated_flops_total == pytest.approx(flops)
    kv = kv_bytes_per_token(SMOL)  # the context read, the prompt's own K/V read, all K/V written
    assert stats.estimated_bytes_total == pytest.approx(weight_bytes(SMOL) + kv * (300 + 96 + 128))
    collector.record(_scheduler(None), None)  # no details (e.g. a stats-only update): no work
    assert stats.engine_steps_total == 2 and stats.busy_seconds_total == pytest.approx(0.2)


def test_a_step_that_beats_the_measured_peak_raises_it_so_utilization_stays_within_one():
    """A start-up measurement can miss what the engine does (another dtype's kernel, more
    threads): the peak is at least what any step achieved, so the window's rate, an average of
    step rates and idle time, never reads above it."""
    stats = NodeStats()
    collector = StatsCollector(stats)
    collector.model = SMOL
    collector.set_peaks(Peaks(1e9, 1e9, "measured"))  # far below what the steps below do
    collector.record(_scheduler(_details(96, 1, 32, 32, 200.0)), None)
    collector.record(_scheduler(_details(0, 0, 8, 8, 20.0)), None)
    first = 128 * linear_flops_per_token(SMOL) / 0.2
    assert stats.peak_flops >= first and stats.peak_mem_bandwidth > 1e9
    history = [_sample(0), _sample(0.22, stats.estimated_flops_total, stats.estimated_bytes_total)]
    window = Window.of(history, 60)
    assert window.flops / stats.peak_flops <= 1.0
    assert window.bytes / stats.peak_mem_bandwidth <= 1.0


def test_queue_time_histogram_buckets():
    stats = NodeStats()
    for seconds in (0.0005, 0.003, 0.003, 12.0, 100.0):
        stats.observe_queue_time(seconds)
    assert stats.queue_time_counts[0] == 1  # <= 1 ms
    assert stats.queue_time_counts[QUEUE_TIME_BUCKETS.index(0.005)] == 2
    assert stats.queue_time_counts[QUEUE_TIME_BUCKETS.index(30.0)] == 1
    assert stats.queue_time_overflow == 1
    assert stats.queue_time_sum == pytest.approx(112.0065)


def _sample(t, flops=0.0, nbytes=0.0, busy=0.0, prompt_busy=0.0):
    return (
        t,
        {
            "estimated_flops_total": flops,
            "estimated_bytes_total": nbytes,
            "busy_seconds_total": busy,
            "prompt_busy_seconds_total": prompt_busy,
        },
    )


def test_window_rates_use_the_oldest_sample_inside_the_window():
    history = [_sample(0), _sample(10, 100, 10, 1, 1), _sample(20, 300, 50, 6, 2)]
    window = Window.of(history, 15)
    assert window == Window(10, 20, 4, 0.5, 0.1)
    assert Window.of(history, 60).flops == 15
    assert Window.of(history[:1], 15) is None


def test_node_load_is_compute_or_memory_plus_queue():
    prefill = NodeStats(max_num_seqs=64, kv_cache_usage=0.05, running=1, waiting=0)
    assert node_load(prefill, Window(10, 0, 0, 0.7, 0.6)) == pytest.approx(0.6)
    decode = NodeStats(max_num_seqs=64, kv_cache_usage=0.3, running=32, waiting=0)
    assert node_load(decode, Window(10, 0, 0, 1.0, 0.01)) == pytest.approx(0.5)
    queued = replace(decode, waiting=64)
    assert node_load(queued, None) == pytest.approx(1.5)
    assert pool_load([0.2, 0.4]) == pytest.approx(0.3) and pool_load([]) is None
    assert balance_ratio(0.9, 0.3) == pytest.approx(3.0)
    assert balance_ratio(0.0, 0.0) == 1.0


def _node_stats(**overrides) -> NodeStats:
    stats = NodeStats(max_num_seqs=64, peak_flops=1e11, peak_mem_bandwidth=1e10)
    stats.peaks_source = "measured"
    return replace(stats, **overrides)


def _node(name: str, stats: NodeStats, healthy: bool = True) -> Node:
    return Node(name, client=None, healthy=healthy, stats=stats, stats_asked=0.0)


def _pool(name: str, nodes: list[Node]) -> Pool:
    return new_pool(name, nodes, "least_outstanding")


def _exported(metrics: RouterMetrics) -> tuple[str, dict]:
    """The registry's exposition text and its samples' values by (name, sorted labels)."""
    text = generate_latest(metrics.registry).decode()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, values


def test_pool_collector_exports_nodes_pools_and_balance():
    prefill = _node("p0", _node_stats(estimated_flops_total=2e11, prompt_busy_seconds_total=8))
    prefill.history.extend([_sample(0), (10, counters(prefill.stats))])
    decode = _node("d0", _node_stats(running=16, kv_cache_usage=0.2))
    dead = _node("d1", _node_stats(waiting=500), healthy=False)
    pools = {"prefill": _pool("prefill", [prefill]), "decode": _pool("decode", [decode, dead])}
    text, values = _exported(RouterMetrics(pools, "disaggregated", tpot_target_s=0.1))
    assert values[("pdserve_pool_load_ratio", (("pool", "prefill"),))] == pytest.approx(0.8)
    # the unhealthy node's queue does not count: decode load is 16/64 from the healthy one
    assert values[("pdserve_pool_load_ratio", (("pool", "decode"),))] == pytest.approx(0.25)
    assert values[("pdserve_pool_balance_ratio", ())] == pytest.approx(3.2)
    key = (("node", "p0"), ("pool", "prefill"))
    assert values[("pdserve_node_compute_utilization_ratio", key)] == pytest.approx(0.2)
    assert values[("pdserve_pool_nodes", (("pool", "decode"), ("state", "unhealthy")))] == 1
    assert values[("pdserve_node_up", (("node", "d1"), ("pool", "decode")))] == 0
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                             capture_output=True)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_utilization_stays_within_one_when_the_window_holds_more_step_time_than_its_length():
    """Seen on a loaded prefill node (1.01): the window's counters held steps that began before
    it (or came with a health check answered late), 1.2 s of steps in 1 s, each at the peak."""
    stats = _node_stats(estimated_flops_total=1.2e11, estimated_bytes_total=1.2e10)
    stats.busy_seconds_total = 1.2
    node = _node("p0", stats)
    node.history.extend([_sample(0), (1.0, counters(stats))])
    pools = {"prefill": _pool("prefill", [node])}
    _, values = _exported(RouterMetrics(pools, "disaggregated", tpot_target_s=0.1))
    ratios = {name: v for (name, _), v in values.items() if name.endswith("_utilization_ratio")}
    assert ratios == {
        "pdserve_node_compute_utilization_ratio": pytest.approx(1.0),
        "pdserve_node_bandwidth_utilization_ratio": pytest.approx(1.0),
    }


def test_request_timer_observes_ttft_itl_and_tpot(monkeypatch):
    metrics = RouterMetrics({}, "colocated", tpot_target_s=0.1)
    clock = iter([1.5, 1.7, 2.1, 2.1])  # first token, +1 token, +2 tokens, finish
    monkeypatch.setattr(events_module.clock, "now", lambda: next(clock))
    timer = RequestTimer(metrics, "http", arrival=1.0)
    timer.tokens(1)
    timer.tokens(1)
    timer.tokens(2)
    timer.finished("success")

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, labels or None)

    assert value("pdserve_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value("pdserve_inter_token_latency_seconds_count") == 3
    assert value("pdserve_inter_token_latency_seconds_sum") == pytest.approx(0.2 + 0.4)
    assert value("pdserve_time_per_output_token_seconds_sum") == pytest.approx(0.6 / 3)
    assert value("pdserve_e2e_request_latency_seconds_sum") == pytest.approx(1.1)
    assert value("pdserve_requests_total", api="http", outcome="success") == 1


def test_a_buffered_timer_observes_only_the_run_that_served_the_request(monkeypatch):
    """A non-streamed request retried after its node failed: the failed run's tokens are
    dropped, and the latencies of the served run are observed once, at the end."""
    metrics = RouterMetrics({}, "colocated", tpot_target_s=0.1)
    clock = iter([1.2, 1.4, 3.0, 3.5])  # failed run: 2 tokens; served run: 2 tokens
    monkeypatch.setattr(events_module.clock, "now", lambda: next(clock))
    timer = RequestTimer(metrics, "http", arrival=1.0, live=False)
    timer.tokens(1)
    timer.tokens(1)

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, labels or None)

    assert value("pdserve_time_to_first_token_seconds_count") == 0  # nothing observed yet
    timer.restart()
    timer.tokens(1)
    timer.tokens(1)
    timer.finished("success")
    assert value("pdserve_time_to_first_token_seconds_count") == 1
    assert value("pdserve_time_to_first_token_seconds_sum") == pytest.approx(2.0)
    assert value("pdserve_inter_token_latency_seconds_count") == 1
    assert value("pdserve_inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert value("pdserve_e2e_request_latency_seconds_count") == 1


def test_a_prefill_node_inside_a_step_longer_than_the_window_reads_busy_not_idle():
    from pdserve_core.engine.types import NodeStats
    from router.decides.rates import Window
    from router.metrics.balance import cost_pressure

    quiet = Window(seconds=3, flops=0, bytes=0, busy=0, prompt_busy=0, predicted_busy=0, steps=0)
    working = NodeStats(requests_started_total=5, requests_finished_total=4, max_num_seqs=64)
    idle = NodeStats(requests_started_total=5, requests_finished_total=5, max_num_seqs=64)
    assert cost_pressure("prefill", quiet, 0.1, working) == 1.0
    assert cost_pressure("prefill", quiet, 0.1, idle) == 0.0
    stepping = Window(3, 0, 0, 0.4, 0.4, predicted_busy=0.4, steps=2)
    assert cost_pressure("prefill", stepping, 0.1, working) == 0.4  # steps say how busy


def test_a_dead_engines_gauges_go_with_it():
    """A node whose engine died reports no queue, no cache use and no KV held until its new
    engine steps (an idle new engine may never step: the dead one's last gauges would stay)."""
    from pdserve_core.engine.actor import EngineActor
    from pdserve_core.kv.stats import KVGauges

    actor = EngineActor("pdserve-prefill-0", {})
    actor._engine = SimpleNamespace(shutdown=lambda: None)
    stats = actor._stats
    stats.running, stats.waiting, stats.kv_cache_usage = 2, 1, 0.3
    stats.kv.gauges = KVGauges(in_flight=1, blocks_held=4, requests_held=1)
    stats.kv.counters.releases = 5
    actor._drop_engine()
    assert actor._engine is None
    assert (stats.running, stats.waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.kv.gauges == KVGauges()
    assert stats.kv.counters.releases == 5  # totals stay: they count what happened
