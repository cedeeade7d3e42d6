"""Placing engine nodes as Ray actors: one factory for every kind, and the autoscaler's.

A node is an engine actor of one kind, placed with its pool's Ray resources:

    kind        actor                                  KV connector role   KV server port
    colocated   pdserve_core.engine.actor.EngineActor  none                none
    prefill     prefill_node.node.PrefillNode          kv_producer         kv_transfer.port + index
    decode      decode_node.node.DecodeNode            kv_consumer         none
    flex        pdserve.flex.FlexNode (either role)    kv_both             kv_transfer.port + index

The index numbers every node that serves KV within one run (prefill nodes first, then the
autoscaler's), so their ports never collide; with `kv_transfer.port` 0 each picks a free port.
A node that pulls KV is told the hosts prefill nodes may be on (`cluster_hosts`) and pulls from
nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import ray

from pdserve_core.config import PDServeConfig
from pdserve_core.kv import vllm_kv_transfer_config

logger = logging.getLogger(__name__)

ENGINE_START_TIMEOUT_S = 600.0
"""How long one engine may take to start (a cold model load on a slow disk, compilation)."""


def _actor_class(kind: str) -> type:
    if kind == "colocated":
        from pdserve_core.engine.actor import EngineActor

        return EngineActor
    if kind == "prefill":
        from prefill_node.node import PrefillNode

        return PrefillNode
    if kind == "decode":
        from decode_node.node import DecodeNode

        return DecodeNode
    if kind == "flex":
        from pdserve.flex import FlexNode

        return FlexNode
    raise ValueError(f"unknown node kind {kind!r}")


KV_ROLES = {"colocated": None, "prefill": "kv_producer", "decode": "kv_consumer", "flex": "kv_both"}


def node_name(pool: str, replica: int) -> str:
    """A node's name (its Ray actor's, and the router's for it)."""
    return f"pdserve-{pool}-{replica}"


def cluster_hosts(kv_host: str) -> tuple[str, ...]:
    """Where prefill nodes' KV servers can be: the address they bind to, or (bound to every
    interface) the Ray nodes' addresses they advertise."""
    hosts = {node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")}
    if kv_host not in ("0.0.0.0", "::"):
        hosts.add(kv_host)
    return tuple(sorted(hosts))


def place_node(
    config: PDServeConfig,
    model_dir: str,
    served: str,
    secret: str,
    kind: str,
    pool: str,
    replica: int,
    index: int = 0,
):
    """Place node `replica` of pool `pool` as a `kind` engine actor (named by `node_name`);
    `.start.remote()` next. `index` numbers the nodes that serve
    KV (their port offset)."""
    from pdserve_core.engine.actor import create_engine_actor

    role = KV_ROLES[kind]
    kv_transfer = None
    if role is not None:
        kv = config.kv_transfer
        serves = role in ("kv_producer", "kv_both")
        pulls = role in ("kv_consumer", "kv_both")
        port = kv.port + index if serves and kv.port else 0
        hosts = cluster_hosts(kv.host) if pulls else None
        kv_transfer = vllm_kv_transfer_config(
            role, kv.connector_settings(secret, port, hosts), kv.failure_policy
        )
    return create_engine_actor(
        _actor_class(kind),
        node_name(pool, replica),
        model_dir,
        served,
        config.engine,
        getattr(config.pools, pool),
        replica,
        kv_transfer=kv_transfer,
        stream_host=config.kv_transfer.host,
        stream_tls=config.kv_transfer.tls_files(),
        stream_secret=secret,
    )


def ray_node(config: PDServeConfig, actor: Any, info: Any, secret: str):
    """The router's view of one started node (`info`: what it said at its start): reached through
    Ray, its token stream as the config says (proving the run's cluster `secret`)."""
    from pdserve_core.engine.deltas import client_tls
    from router.links.nodes import Node
    from router.links.ray_nodes import RayNodeClient

    kv = config.kv_transfer
    tls = client_tls(kv.tls_files(), kv.tls.check_hostname if kv.tls else True)
    direct = config.router.token_stream == "direct"
    return Node(info.name, RayNodeClient(actor, info.name, direct, tls, secret), info)


def place_pools(config: PDServeConfig, model_dir: str, served: str, secret: str) -> dict:
    """Every node of the configured mode's pools: {pool name: [actor, ...]}."""
    pools = config.pools
    if config.mode == "colocated":
        return {
            "colocated": [
                place_node(config, model_dir, served, secret, "colocated", "colocated", replica)
                for replica in range(pools.colocated.replicas)
            ]
        }
    flex = pools.autoscale.enabled  # every node can then take either role
    first = {"prefill": 0, "decode": pools.prefill.replicas}
    return {
        name: [
            place_node(
                config,
                model_dir,
                served,
                secret,
                "flex" if flex else name,
                name,
                replica,
                first[name] + replica,
            )
            for replica in range(getattr(pools, name).replicas)
        ]
        for name in ("prefill", "decode")
    }


class RayNodeFactory:
    """The autoscaler's way to start and stop nodes (`router.decides.autoscale.NodeFactory`): `flex`
    nodes placed with a pool's resources, each given the lowest replica number and KV index
    that no living node holds — a cluster that grows and shrinks all day reuses them instead of
    counting past the port range."""

    def __init__(
        self, config: PDServeConfig, model_dir: Path, served: str, secret: str, actors: list
    ) -> None:
        self.config, self.model_dir, self.served, self.secret = config, model_dir, served, secret
        self.actors = actors
        pools = config.pools
        self.replicas = {
            "prefill": set(range(pools.prefill.replicas)),
            "decode": set(range(pools.decode.replicas)),
        }
        """Replica numbers held, by role (the pools' own nodes hold the first ones)."""
        self.indexes = set(range(pools.prefill.replicas + pools.decode.replicas))
        self.held: dict[str, tuple[Any, str, int, int]] = {}
        """Node name -> (actor, role, replica, index) of the nodes started here."""

    @staticmethod
    def _lowest_free(held: set[int]) -> int:
        return next(i for i in range(len(held) + 1) if i not in held)

    def _needs(self, role: str) -> dict[str, float]:
        pool = getattr(self.config.pools, role)
        needs = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
        return {name: amount for name, amount in needs.items() if amount}

    def can_add(self, role: str) -> bool:
        free = ray.available_resources()
        return all(free.get(name, 0.0) >= amount for name, amount in self._needs(role).items())

    async def add(self, role: str):
        replica, index = self._lowest_free(self.replicas[role]), self._lowest_free(self.indexes)
        actor = place_node(
            self.config, str(self.model_dir), self.served, self.secret, "flex", role, replica, index
        )
        name = node_name(role, replica)
        self.replicas[role].add(replica)
        self.indexes.add(index)
        self.held[name] = (actor, role, replica, index)
        self.actors.append(actor)
        try:
            info = await asyncio.wait_for(actor.start.remote(), ENGINE_START_TIMEOUT_S)
        except BaseException:
            self._stop(name)
            raise
        logger.info("%s engine %s up in %.1f s (pid %s)", role, info.name, info.start_s, info.pid)
        return ray_node(self.config, actor, info, self.secret)

    async def remove(self, node) -> None:
        """Shut the node's engine down (it has drained), then end its actor."""
        try:
            await asyncio.wait_for(node.client.shutdown(), 60)
        finally:
            self._stop(node.name)

    def _stop(self, name: str) -> None:
        if name not in self.held:
            return
        actor, role, replica, index = self.held.pop(name)
        ray.kill(actor)
        if actor in self.actors:
            self.actors.remove(actor)
        self.replicas[role].discard(replica)
        self.indexes.discard(index)
