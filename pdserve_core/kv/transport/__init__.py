"""KV data planes, registered by name and imported only when chosen (tcp never imports CUDA).

`PLANES` is the one list of transports: the config's `kv_transfer.transport` choices, the
connector's settings check and the generated reference all read it. A new transport is a module
with its plane class and one line here."""

from __future__ import annotations

import importlib

PLANES = {
    "tcp": ("pdserve_core.kv.transport.tcp", "TcpPlane"),
    "nccl": ("pdserve_core.kv.transport.nccl", "NcclPlane"),
    "gloo": ("pdserve_core.kv.transport.gloo", "GlooPlane"),
    "nixl": ("pdserve_core.kv.transport.nixl", "NixlPlane"),
}
"""Transport name -> (module, plane class)."""
DEFAULT = "tcp"
"""The plane of a connector told none, and of a handle that names none."""


def plane_class(name: str):
    try:
        module, cls = PLANES[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(PLANES)}") from None
    return getattr(importlib.import_module(module), cls)
