"""KV transports, registered by name and imported only when chosen (tcp never imports CUDA)."""

from __future__ import annotations

import importlib

_REGISTRY = {
    "tcp": ("pdserve.kv.transport.tcp", "TcpTransport"),
    "nccl": ("pdserve.kv.transport.nccl", "NcclTransport"),
}


def transport_class(name: str):
    try:
        module, cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(_REGISTRY)}") from None
    return getattr(importlib.import_module(module), cls)
