"""Prometheus metrics of a pdserve deployment, all in this package, served at /metrics.

Two kinds of series:
- request events the router sees (`RouterMetrics`): outcomes, time to first token, inter-token
  latency, time per output token, end-to-end latency, routing decisions, fallbacks and retries;
- the state of every node and pool (`PoolCollector`), built at scrape time from the stats each
  node reported in its last health check (the router polls every node every second): running
  and waiting requests, KV cache usage, tokens, queue time, KV transfers, the roofline
  utilization estimate, and the pool-balance signal.
So one Prometheus scrape of the router sees the whole cluster; node series carry `pool` and
`node` labels. `balance.py` defines the pool-balance signal.
"""

from router.metrics.events import LATENCY_BUCKETS, RequestTimer, RouterMetrics

__all__ = ["LATENCY_BUCKETS", "RequestTimer", "RouterMetrics"]
