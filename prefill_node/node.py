"""A prefill node: a Ray actor hosting vLLM with pdserve's KV connector as producer.

Life of a request here: the router sends the tokenized prompt with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": True}`; the engine computes the prompt's KV cache and
the first token; the connector keeps the request's blocks under a lease and returns the handle
(address, ports, request id, block ids, lease) with the final delta; the decode node then pulls
the blocks, and the producer frees them on its confirmation or when the lease ends.
"""

from __future__ import annotations

from pdserve.config import PDServeConfig
from pdserve.engine import create_pool_node


def create_prefill_node(
    config: PDServeConfig, model_dir: str, served: str, replica: int, secret: str
):
    return create_pool_node(config, "prefill", "kv_producer", model_dir, served, replica, secret)
