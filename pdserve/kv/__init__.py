"""KV transfer between a prefill engine (producer) and a decode engine (consumer).

`connector.py` is the vLLM v1 KV connector (`PDServeConnector`); `transport/` holds the data
planes (tcp, nccl) behind one interface; `handle.py` is what travels in `kv_transfer_params`.
"""

from __future__ import annotations

from typing import Any, Literal

CONNECTOR_NAME = "PDServeConnector"
CONNECTOR_MODULE = "pdserve.kv.connector"


def vllm_kv_transfer_config(
    role: Literal["kv_producer", "kv_consumer", "kv_both"],
    secret: str,
    transport: str = "tcp",
    failure_policy: str = "recompute",
    host: str = "127.0.0.1",
    port: int = 0,
    lease_s: float = 30.0,
    timeout_s: float = 10.0,
    **extra: Any,
) -> dict[str, Any]:
    """Fields of a vLLM `KVTransferConfig` that load this connector for one engine."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {
            "transport": transport,
            "host": host,
            "port": port,
            "lease_s": lease_s,
            "timeout_s": timeout_s,
            "secret": secret,
            **extra,
        },
    }
