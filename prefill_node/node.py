"""A prefill node: a Ray actor hosting vLLM with pdserve's KV connector as producer.

Life of a request here: the router sends the tokenized prompt with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": True}`; the engine computes the prompt's KV cache and
the first token; the connector keeps the request's blocks under a lease and returns the handle
(address, ports, request id, block ids, lease) with the final delta; the decode node then pulls
the blocks, and the producer frees them on its confirmation or when the lease ends.
"""

from __future__ import annotations

from pdserve.config import PDServeConfig
from pdserve.engine import create_engine_actor
from pdserve.kv import vllm_kv_transfer_config


def create_prefill_node(
    config: PDServeConfig, model_dir: str, served: str, replica: int, secret: str
):
    kv = config.kv_transfer
    port = kv.port + replica if kv.port else 0
    return create_engine_actor(
        f"pdserve-prefill-{replica}",
        model_dir,
        served,
        config.engine,
        config.pools.prefill,
        replica,
        max_restarts=config.pools.prefill.max_restarts,
        kv_transfer=vllm_kv_transfer_config(
            "kv_producer",
            secret,
            kv.transport,
            kv.failure_policy,
            kv.host,
            port,
            kv.lease_s,
            kv.timeout_s,
        ),
    )
