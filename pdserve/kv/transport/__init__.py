"""KV data planes, registered by name and imported only when chosen (tcp never imports CUDA)."""

from __future__ import annotations

import importlib

_REGISTRY = {
    "tcp": ("pdserve.kv.transport.tcp", "TcpPlane"),
    "nccl": ("pdserve.kv.transport.nccl", "NcclPlane"),
    "gloo": ("pdserve.kv.transport.gloo", "GlooPlane"),
}


def plane_class(name: str):
    try:
        module, cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(_REGISTRY)}") from None
    return getattr(importlib.import_module(module), cls)
