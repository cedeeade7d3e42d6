"""The KV hand-over shared by both node roles.

What both sides of a transfer need lives here: the handle that travels in vLLM's
`kv_transfer_params` (`handle.py`), the layout both caches must share (`layout.py`), the control
channel's framing, proofs and lease tokens (`wire.py`), the settings (`settings.py`), transfer
statistics (`stats.py`), the data planes that move block bytes (`transport/`: tcp, nccl), and the
connector class vLLM loads (`connector.py`), which picks the producer half
(`prefill_node/kv_producer.py`) or the consumer half (`decode_node/kv_consumer.py`) by `kv_role`.
"""

from __future__ import annotations

from typing import Any, Literal

from pdserve_core.kv.settings import ConnectorSettings

CONNECTOR_NAME = "PDServeConnector"
CONNECTOR_MODULE = "pdserve_core.kv.connector"


def vllm_kv_transfer_config(
    role: Literal["kv_producer", "kv_consumer", "kv_both"],
    settings: ConnectorSettings,
    failure_policy: Literal["recompute", "fail"],
) -> dict[str, Any]:
    """Fields of a vLLM `KVTransferConfig` that load this connector for one engine."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": settings.to_extra(),
    }
