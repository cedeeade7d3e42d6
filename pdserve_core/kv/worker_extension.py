"""The KV connector's methods on each of an engine's workers (part of vLLM's
`worker_extension_cls`, pdserve_core/engine/worker.py), which the node's actor reaches with
`AsyncLLM.collective_rpc(name, ...)`: what the connector's worker half can do at the router's
word, outside any request's steps. On an engine without a connector they find none."""

from __future__ import annotations

import logging

from pdserve_core.kv.handle import PREFETCH_KEY, prefetch_key

logger = logging.getLogger(__name__)


def _half(name: str):
    """An attribute of this worker's KV connector (None without one)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), name, None)


class KVWorkerExtension:
    def pdserve_kv_endpoint(self) -> dict | None:
        """Where this worker serves KV (host, port, tensor-parallel rank), or None without a
        producer half; and whether its consumer half takes prefetches."""
        producer, consumer = _half("producer"), _half("consumer")
        info: dict = {"prefetch": bool(consumer is not None and consumer.staging.budget_bytes)}
        if producer is not None and hasattr(producer, "port"):
            settings = _half("settings")
            info |= {"host": settings.public_host, "port": producer.port}
        return info

    def pdserve_prefetch(
        self, key: str, host: str, ports: list[int], num_tokens: int, block_size: int
    ) -> bool:
        """Follow a prefill on `host` under `key` and stage its KV (decode_node/staging.py)."""
        consumer = _half("consumer")
        prefetch = getattr(consumer, "prefetch", None)
        if prefetch is None:
            return False
        return prefetch(key, host, ports, num_tokens, block_size)

    def pdserve_end_follow(self, key: str) -> bool:
        """End the follow of prefill `key`: it will not run (progress.py). False without a
        producer half."""
        progress = getattr(_half("producer"), "progress", None)
        if progress is None or prefetch_key({PREFETCH_KEY: key}) is None:
            return False
        progress.fail(key, "the prefill will not run (its leg failed or was cancelled)")
        return True

    def pdserve_give_back(self, request_id: str, lease_deadline: float) -> bool:
        """Free the KV this worker holds for `request_id`: no decode node will read it. False
        when the worker holds none (no producer half)."""
        give_back = getattr(_half("producer"), "give_back", None)
        if give_back is None:
            return False
        give_back(request_id, lease_deadline)
        return True

    def pdserve_give_back_leg(self, leg_id: str) -> int:
        """Free the KV this worker holds, or is about to hold, for the prefill leg `leg_id`,
        which the router stopped before its end. The offers freed now (0 without a producer
        half)."""
        give_back_leg = getattr(_half("producer"), "give_back_leg", None)
        if give_back_leg is None:
            return 0
        return give_back_leg(leg_id)
