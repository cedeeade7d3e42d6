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
from pdserve.engine import create_pool_node


def create_decode_node(
    config: PDServeConfig, model_dir: str, served: str, replica: int, secret: str
):
    return create_pool_node(config, "decode", "kv_consumer", model_dir, served, replica, secret)
