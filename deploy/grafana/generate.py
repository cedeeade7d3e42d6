"""Writes the "pdserve — pool balance" Grafana dashboard (dashboards/pdserve-pool-balance.json).

The dashboard is code: edit the panels here and run `python deploy/grafana/generate.py`; a test
checks that the committed JSON is what this script writes and that every panel's query returns
data from a real Prometheus scraping a running pdserve. Panels whose legend names `{{pool}}` are
per pool and show prefill and decode side by side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).parent / "dashboards" / "pdserve-pool-balance.json"
UID = "pdserve-pool-balance"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]
    """(PromQL, legend) pairs."""
    unit: str = "none"
    description: str = ""
    kind: str = "timeseries"
    width: int = 8
    thresholds: list[tuple[float, str]] = field(default_factory=list)


def quantile(q: float, metric: str, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket[{RATE}])))"


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Pool balance",
        [
            Panel(
                "Balance: prefill load ÷ decode load",
                [
                    ("pdserve_pool_balance_ratio", "balance"),
                    ("pdserve:pool_balance:ratio_avg1m", "balance (1m avg)"),
                ],
                description="Above 1 the prefill pool is the bottleneck: move the P:D ratio "
                "toward prefill. Below 1 the decode pool is.",
                width=8,
                thresholds=[(0, "blue"), (0.5, "green"), (2, "orange")],
            ),
            Panel(
                "Pool load (demand ÷ capacity)",
                [("pdserve_pool_load_ratio", "{{pool}}")],
                unit="percentunit",
                description="max(compute, memory) pressure + queue pressure per node, averaged "
                "over the pool's healthy nodes; ≥ 100% means requests queue (router/metrics).",
                thresholds=[(0, "green"), (0.8, "orange"), (1, "red")],
            ),
            Panel(
                "Healthy nodes",
                [('pdserve_pool_nodes{state="healthy"}', "{{pool}}")],
                kind="stat",
            ),
        ],
    ),
    (
        "Utilization (roofline estimate): compute against bandwidth",
        [
            Panel(
                "Compute utilization (achieved FLOP/s ÷ peak)",
                [("pool:pdserve_compute_utilization:ratio_rate1m", "{{pool}}")],
                unit="percentunit",
                description="Prefill should sit high here: it is compute-bound.",
            ),
            Panel(
                "Bandwidth utilization (achieved bytes/s ÷ peak)",
                [("pool:pdserve_bandwidth_utilization:ratio_rate1m", "{{pool}}")],
                unit="percentunit",
                description="Decode should sit high here: it is bandwidth-bound.",
            ),
            Panel(
                "Arithmetic intensity (FLOP/byte)",
                [("pool:pdserve_arithmetic_intensity:flops_per_byte_rate1m", "{{pool}}")],
                description="Compare with the device's ridge point (`pdserve plan`): prefill "
                "above it, decode far below.",
            ),
            Panel(
                "Engine busy time",
                [("pool:pdserve_busy:ratio_rate1m", "{{pool}}")],
                unit="percentunit",
            ),
            Panel(
                "GPU SM / memory-controller utilization (NVML)",
                [
                    ("avg by (pool) (pdserve_node_gpu_sm_utilization_ratio)", "{{pool}} SM"),
                    (
                        "avg by (pool) (pdserve_node_gpu_memory_controller_utilization_ratio)",
                        "{{pool}} memory",
                    ),
                ],
                unit="percentunit",
                description="GPU only: NVML's utilization.gpu and utilization.memory per node. "
                "DCGM's SM active (1002) and DRAM active (1005) are finer; see docs/metrics.md.",
            ),
        ],
    ),
    (
        "Queues",
        [
            Panel(
                "Requests running / waiting in the engines",
                [
                    ("sum by (pool) (pdserve_node_requests_running)", "{{pool}} running"),
                    ("sum by (pool) (pdserve_node_requests_waiting)", "{{pool}} waiting"),
                ],
            ),
            Panel(
                "Requests in flight (router)",
                [("pdserve_pool_requests_in_flight", "{{pool}}")],
            ),
            Panel(
                "KV cache usage",
                [("avg by (pool) (pdserve_node_kv_cache_usage_ratio)", "{{pool}}")],
                unit="percentunit",
            ),
            Panel(
                "Engine queue time p99",
                [(quantile(0.99, "pdserve_request_queue_time_seconds", "pool, le"), "{{pool}}")],
                unit="s",
            ),
        ],
    ),
    (
        "KV transfer",
        [
            Panel(
                "KV transfer rate",
                [("pdserve:kv_transfer_bytes:rate1m", "received")],
                unit="Bps",
            ),
            Panel(
                "KV transfer latency (mean)",
                [("pdserve:kv_transfer_seconds:mean_rate1m", "mean")],
                unit="s",
            ),
            Panel(
                "KV transfer failures by reason",
                [
                    (
                        f"sum by (reason) (rate(pdserve_kv_transfer_failures_total[{RATE}]))",
                        "{{reason}}",
                    )
                ],
                unit="reqps",
            ),
        ],
    ),
    (
        "Prefix cache: hits per pool and KV not sent",
        [
            Panel(
                "Prefix cache hits (share of prompt tokens)",
                [
                    (
                        'sum by (pool) (rate(pdserve_node_prompt_tokens_total{source="cached"}'
                        f"[{RATE}])) / sum by (pool) (rate(pdserve_node_prompt_tokens_total"
                        f'{{source=~"cached|computed"}}[{RATE}]))',
                        "{{pool}}",
                    )
                ],
                unit="percentunit",
                description="Of the prompt tokens each pool's engines ran, the share found in "
                "their own prefix cache (tokens loaded by a hand-over are not counted).",
            ),
            Panel(
                "Cached prompt tokens: the router's record against the engines'",
                [
                    (
                        "sum by (pool) "
                        f"(rate(pdserve_prefix_expected_cached_tokens_total[{RATE}]))",
                        "{{pool}} expected by the router",
                    ),
                    (
                        'sum by (pool) (rate(pdserve_node_prompt_tokens_total{source="cached"}'
                        f"[{RATE}]))",
                        "{{pool}} found by the engines",
                    ),
                ],
                unit="short",
                description="Tokens/s. The router routes by its record of what each node holds "
                "(router/decides/prefixes.py); the gap between the lines is that record's error.",
            ),
            Panel(
                "KV not sent: hand-over blocks already cached at the decode node",
                [
                    (
                        'sum(rate(pdserve_kv_handover_blocks_total{outcome="cached"}'
                        f"[{RATE}])) * sum(rate(pdserve_kv_transfer_bytes_total"
                        f'{{direction="received"}}[{RATE}])) / sum(rate('
                        f'pdserve_kv_handover_blocks_total{{outcome="received"}}[{RATE}]))',
                        "bytes saved",
                    ),
                    ("pdserve:kv_transfer_bytes:rate1m", "bytes sent"),
                ],
                unit="Bps",
                description="Blocks of handed-over prompts the decode node held already, at "
                "the bytes per block the transfers measured: what did not cross the link.",
            ),
        ],
    ),
    (
        "Latency and outcomes",
        [
            Panel(
                "Time to first token",
                [
                    ("pdserve:time_to_first_token_seconds:p50_rate1m", "p50"),
                    ("pdserve:time_to_first_token_seconds:p99_rate1m", "p99"),
                ],
                unit="s",
            ),
            Panel(
                "Inter-token latency",
                [
                    ("pdserve:inter_token_latency_seconds:p50_rate1m", "p50"),
                    ("pdserve:inter_token_latency_seconds:p99_rate1m", "p99"),
                ],
                unit="s",
            ),
            Panel(
                "Time per output token p50",
                [(quantile(0.5, "pdserve_time_per_output_token_seconds"), "p50")],
                unit="s",
            ),
            Panel(
                "Request outcomes",
                [(f"sum by (outcome) (rate(pdserve_requests_total[{RATE}]))", "{{outcome}}")],
                unit="reqps",
            ),
            Panel(
                "Routing decisions per node",
                [
                    (
                        f"sum by (pool, node) (rate(pdserve_routing_decisions_total[{RATE}]))",
                        "{{pool}} {{node}}",
                    )
                ],
                unit="reqps",
            ),
            Panel(
                "Fallbacks and retries",
                [
                    (f"sum(rate(pdserve_prefill_fallbacks_total[{RATE}]))", "prefill fallbacks"),
                    (
                        f"sum by (pool) (rate(pdserve_request_retries_total[{RATE}]))",
                        "{{pool}} retries",
                    ),
                ],
                unit="reqps",
            ),
        ],
    ),
    (
        "Prefill placement and the hand-over",
        [
            Panel(
                "Where prompts are computed",
                [
                    (
                        f"sum by (where, reason) (rate(pdserve_prefill_placements_total[{RATE}]))",
                        "{{where}} ({{reason}})",
                    )
                ],
                unit="reqps",
                description="Disaggregated: each request's prompt computed on its decode node "
                "(local) or on a prefill node (remote), by the reason the router gave "
                "(router/decides/placement.py).",
                width=12,
            ),
            Panel(
                "Hand-over gap",
                [
                    (quantile(0.5, "pdserve_handover_gap_seconds"), "p50"),
                    (quantile(0.99, "pdserve_handover_gap_seconds"), "p99"),
                ],
                unit="s",
                description="Remote prefills: the prefill's token to the decode node's first "
                "token. Within one inter-token latency, a reader cannot tell.",
                width=12,
            ),
        ],
    ),
    (
        "Step-time model: predicted against measured",
        [
            Panel(
                "Mean step time per node",
                [("pdserve_node_step_seconds", "{{node}} {{kind}}")],
                unit="s",
                description="Measured mean engine step over the router's window, and what the "
                "node's step-time model predicts for the same steps (calibrated with `pdserve "
                "plan calibrate`, else the roofline at peak).",
            ),
            Panel(
                "Measured ÷ predicted step time",
                [("pdserve_node_step_time_ratio", "{{node}}")],
                description="1 when the model is right. A calibrated node far from 1 has "
                "drifted (other load on its cores, a new engine setting): calibrate again. The "
                "uncalibrated roofline reads 2-5x on a CPU.",
                thresholds=[(0, "orange"), (0.8, "green"), (1.25, "orange")],
            ),
            Panel(
                "Balance in calibrated cost",
                [
                    ("pdserve_pool_balance_cost_ratio", "prefill ÷ decode"),
                    ("pdserve_pool_cost_pressure_ratio", "{{pool}} pressure"),
                ],
                description="The share of its budget each pool's work uses, priced by the "
                "step-time model (prefill: step time per second; decode: predicted step ÷ TPOT "
                "target, or its slots if fuller; plus queued requests), and their ratio: above 1 "
                "the prefill pool is the bottleneck (router/metrics/balance.py). What the "
                "autoscaler reads (router/decides/autoscale.py).",
            ),
            Panel(
                "Engine stalls: time every stream stood still",
                [
                    (
                        f"rate(pdserve_node_engine_stall_seconds_total[{RATE}])",
                        "{{pool}} {{node}}",
                    )
                ],
                unit="percentunit",
                description="Steps far past the step-time model, or pauses between steps with "
                "requests running, half a second or more each (pdserve_core/engine/stats.py); "
                "each is in the node's log, 'every stream stopped'. Alert: "
                "PdserveEngineStalls above 2%.",
                width=24,
                thresholds=[(0, "green"), (0.02, "orange")],
            ),
        ],
    ),
]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    steps = [
        {"color": color, "value": None if i == 0 else value}
        for i, (value, color) in enumerate(panel.thresholds or [(0, "green")])
    ]
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def dashboard() -> dict:
    panels, panel_id, y = [], 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += 8
    return {
        "uid": UID,
        "title": "pdserve — pool balance",
        "description": "Prefill against decode: utilization, queues, balance, KV, latency.",
        "tags": ["pdserve", "llm-serving"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
