"""Methods vLLM adds to each of an engine's workers (`worker_extension_cls`), which the node's
actor reaches with `AsyncLLM.collective_rpc(name, ...)`: what the connector's worker half can do
at the router's word, outside any request's steps."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

QUALNAME = "pdserve.kv.worker_extension.KVWorkerExtension"
"""What `engine_kwargs` passes vLLM as `worker_extension_cls`."""


class KVWorkerExtension:
    def pdserve_give_back(self, request_id: str, lease_deadline: float) -> bool:
        """Free the KV this worker holds for `request_id`: no decode node will read it. False
        when the worker holds none (no producer half)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return False
        producer = getattr(get_kv_transfer_group(), "producer", None)
        give_back = getattr(producer, "give_back", None)
        if give_back is None:
            return False
        give_back(request_id, lease_deadline)
        return True
