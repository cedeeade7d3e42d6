"""A decode node: a Ray actor hosting vLLM with pdserve's KV connector as consumer.

Life of a request here: the router sends the prompt plus the prefill node's first token, with the
prefill node's handle in `kv_transfer_params`; the connector pulls the prompt's KV blocks into
this engine's paged cache (the request waits in WAITING_FOR_REMOTE_KVS meanwhile), and decoding
continues from the first token. If the pull fails, `kv_transfer.failure_policy` decides:
`recompute` computes the prefill here, `fail` ends the request with KVLoadFailed. Without a handle
(the router's fallback when no prefill node is healthy) the node serves the whole request itself.
"""

from __future__ import annotations

from pdserve.config import PDServeConfig
from pdserve.engine import create_engine_actor
from pdserve.kv import vllm_kv_transfer_config


def create_decode_node(
    config: PDServeConfig, model_dir: str, served: str, replica: int, secret: str
):
    kv = config.kv_transfer
    return create_engine_actor(
        f"pdserve-decode-{replica}",
        model_dir,
        served,
        config.engine,
        config.pools.decode,
        replica,
        max_restarts=config.pools.decode.max_restarts,
        kv_transfer=vllm_kv_transfer_config(
            "kv_consumer",
            secret,
            kv.transport,
            kv.failure_policy,
            kv.host,
            0,
            kv.lease_s,
            kv.timeout_s,
        ),
    )
