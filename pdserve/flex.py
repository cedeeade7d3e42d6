"""Nodes that play either role, for pools that follow the balance (`pools.autoscale`).

A `FlexNode` hosts a `kv_both` engine: its connector holds the producer half (a KV server that
hands prefilled blocks out) and the consumer half (pulls from other nodes' servers), and the
actor has both roles' methods (`prefill` and `decode`, and `generate` for whole requests). Which
pool it is in is the router's choice alone, so moving it (router/autoscale.py) changes where new
requests go and nothing on the node: what it runs, it finishes. Each node keeps the Ray resources
and the name of the pool it was started in.
"""

from __future__ import annotations

from decode_node.node import DecodeNode, cluster_hosts
from pdserve.config import PDServeConfig
from pdserve.engine.actor import create_engine_actor
from pdserve.kv import vllm_kv_transfer_config
from prefill_node.node import PrefillNode


class FlexNode(PrefillNode, DecodeNode):
    ROLE = "flex"
    """Calibrations have no per-role model for it: the shared fit prices its steps."""


def create_flex_node(
    config: PDServeConfig,
    model_dir: str,
    served: str,
    pool: str,
    replica: int,
    secret: str,
    index: int,
):
    """Place a node that can serve either role with pool `pool`'s resources (its first role);
    its KV server listens on `kv_transfer.port` + `index` (unique among the run's nodes), or a
    free port when that is 0."""
    kv = config.kv_transfer
    pools = config.pools
    port = kv.port + index if kv.port else 0
    return create_engine_actor(
        FlexNode,
        f"pdserve-{pool}-{replica}",
        model_dir,
        served,
        config.engine,
        getattr(pools, pool),
        replica,
        kv_transfer=vllm_kv_transfer_config(
            "kv_both",
            kv.connector_settings(secret, port, cluster_hosts(kv.host)),
            kv.failure_policy,
        ),
    )
