"""Which node serves in which pool, when one process decides it for several routers.

With `pools.autoscale` and `router.replicas` > 1 the keeper (pdserve/routers.py) alone runs the
autoscaler: its moves, adds and removes change its own pools, and it sends every router the
roster that results — each pool's nodes, by name, with what each said at its start. A router
makes its pools hold exactly that (`follow`): a node named in another pool moves there (the same
`Node`, so its counts and stats go with it, as a move within one router does), a node it has
never seen joins, a node no longer named leaves (the keeper stops it once drained). Requests
already on a node that moved or left finish there. A router started later is given the roster
of its time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.links.nodes import Node


def describe(pools: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The roster of `pools` (role -> `Pool`), as it travels: each node's start info."""
    return {
        role: [dataclasses.asdict(node.info) for node in pool.nodes] for role, pool in pools.items()
    }


def follow(
    pools: Mapping[str, Any],
    roster: Mapping[str, Sequence[Any]],
    make_node: Callable[[Any], Node],
) -> list[str]:
    """Make `pools` (role -> `Pool`) hold what `roster` (role -> each node's `NodeInfo`) says;
    `make_node(info)` reaches a node this router has not seen. Returns what changed, one line
    each; a role the roster does not name keeps its nodes."""
    known = {node.name: (role, node) for role, pool in pools.items() for node in pool.nodes}
    wanted = {info.name: role for role, infos in roster.items() for info in infos}
    unknown = set(roster) - set(pools)
    if unknown:
        raise ValueError(f"the roster names pools this router lacks: {sorted(unknown)}")
    changes = []
    for role, pool in pools.items():
        if role not in roster:
            continue
        for node in list(pool.nodes):
            if wanted.get(node.name) != role:
                pool.nodes.remove(node)
                if node.name not in wanted:
                    changes.append(f"{node.name} left the {role} pool")
    for role, infos in roster.items():
        pool = pools[role]
        for info in infos:
            if any(node.name == info.name for node in pool.nodes):
                continue
            if info.name in known:
                was, node = known[info.name]
                changes.append(f"{info.name} moves from the {was} pool to the {role} pool")
            else:
                node = make_node(info)
                changes.append(f"{info.name} joined the {role} pool")
            pool.nodes.append(node)
    return changes
