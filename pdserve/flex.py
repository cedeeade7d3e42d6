"""Nodes that play either role, for pools that follow the balance (`pools.autoscale`).

A `FlexNode` hosts a `kv_both` engine: its connector holds the producer half (a KV server that hands
prefilled blocks out) and the consumer half (pulls from other nodes' servers), and the actor has
both roles' methods (`prefill` and `decode`, and `generate` for whole requests). Which pool it is in
is the router's choice alone, so moving it (router/decides/autoscale.py) changes where new requests
go and nothing on the node: what it runs, it finishes. Each node keeps the Ray resources and the
name of the pool it was started in. `pdserve/nodes.py` places it.

It lives with the application, not beside the roles: it is made of both, and the roles never
import each other.
"""

from __future__ import annotations

from decode_node.node import DecodeNode
from prefill_node.node import PrefillNode


class FlexNode(PrefillNode, DecodeNode):
    ROLE = "flex"
    """Calibrations have no per-role model for it: the shared fit prices its steps."""
