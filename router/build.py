"""The router, built from its config: the one place its parts are put together.

`pdserve serve` (nodes reached through Ray) and the simulator (`pdserve simulate`, engines in
virtual time) both build their router here, from the same `PDServeConfig`, so a router setting
reaches both or neither. What a setting becomes:

    router.policy            each pool's way of choosing a node (router/decides/policies.py)
    router.node_silence_s    how long a node may say nothing before it leaves its pool
    router.engine_stall_s    how long an engine holding requests may go without a step before
                             its pool's health checks (router/membership.py) end it
    router.prefix_aware      route by what each node holds of a prompt
                             (router/decides/prefixes.py)
    router.prefill_fallback  prefill on the decode node when no prefill node is healthy
    router.placement         where a prompt is computed (router/decides/placement.py), with the
                             decode engines' prompt-chunk cap (`decode_step_cap`) as its stall
                             estimate
    router.max_attempts, stream_resume, max_engine_deaths
                             the retry policy (router/decides/retry.py)
    router.max_n, max_schema_bytes, max_response_tokens
                             what one request may ask (`RequestLimits`)
    pools.autoscale          the autoscaler over the prefill and decode pools
                             (router/decides/autoscale.py)

The runtime classes take these values and keep no defaults of their own: the config schema
(pdserve_core/config.py) is where each default is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from pdserve_core.config import PDServeConfig
from router.decides.autoscale import Decision, NodeFactory, PoolScaler
from router.decides.placement import Placement
from router.decides.policies import make_policy
from router.decides.retry import RetryPolicy
from router.dispatch import Dispatcher, RouteObserver
from router.links.nodes import Node
from router.membership import Membership
from router.pools import Hearing, Pool
from router.service import RequestLimits


def decode_step_cap(config: PDServeConfig) -> int:
    """The most prompt tokens a decode node's engine computes for one request in one step (the
    placement rule's stall estimate): the decode pool's cap, else the engines' (0: none)."""
    cap = config.pools.decode.long_prefill_token_threshold
    return config.engine.long_prefill_token_threshold if cap is None else cap


def pools(config: PDServeConfig, members: Mapping[str, Sequence[Node]]) -> dict[str, Pool]:
    """A pool per role in `members` ("colocated", or "prefill" and "decode"), sharing one
    `Hearing`: silence is judged against what the router hears of any node."""
    hearing = Hearing()
    router = config.router
    return {
        role: Pool(
            role,
            list(nodes),
            make_policy(router.policy, role),
            silence_s=router.node_silence_s,
            hearing=hearing,
        )
        for role, nodes in members.items()
    }


def dispatcher(
    config: PDServeConfig,
    members: Mapping[str, Sequence[Node]],
    observer: RouteObserver | None = None,
) -> Dispatcher:
    """The dispatcher over `members`: colocated when they are one "colocated" pool, else
    disaggregated over "prefill" and "decode"."""
    built = pools(config, members)
    router = config.router
    if set(built) == {"colocated"}:
        return Dispatcher.colocated(built["colocated"], observer, prefix_aware=router.prefix_aware)
    if set(built) != {"prefill", "decode"}:
        raise ValueError(f"pools {sorted(built)}: a router needs colocated, or prefill and decode")
    return Dispatcher.disaggregated(
        built["prefill"],
        built["decode"],
        router.prefill_fallback,
        Placement(router.placement, step_cap_tokens=decode_step_cap(config)),
        observer,
        prefix_aware=router.prefix_aware,
    )


def memberships(
    config: PDServeConfig, pools: Iterable[Pool], prefix_aware: bool | None = None
) -> list[Membership]:
    """The health checks of each pool (started and stopped by the caller); `prefix_aware`: read
    each node's block log with them (default `router.prefix_aware`)."""
    router = config.router
    aware = router.prefix_aware if prefix_aware is None else prefix_aware
    return [Membership(pool, stall_s=router.engine_stall_s, prefix_aware=aware) for pool in pools]


def retry_policy(config: PDServeConfig) -> RetryPolicy:
    router = config.router
    return RetryPolicy(router.max_attempts, router.stream_resume, router.max_engine_deaths)


def request_limits(config: PDServeConfig) -> RequestLimits:
    router = config.router
    return RequestLimits(router.max_n, router.max_schema_bytes, router.max_response_tokens)


def scaler(
    config: PDServeConfig,
    dispatcher: Dispatcher,
    on_decision: Callable[[Decision], None] | None = None,
    factory: NodeFactory | None = None,
) -> PoolScaler | None:
    """The autoscaler over the prefill and decode pools (None unless `pools.autoscale.enabled`
    and the router is disaggregated)."""
    if not config.pools.autoscale.enabled or dispatcher.mode != "disaggregated":
        return None
    return pool_scaler(config, dispatcher.prefill, dispatcher.decode, on_decision, factory)


def pool_scaler(
    config: PDServeConfig,
    prefill: Pool,
    decode: Pool,
    on_decision: Callable[[Decision], None] | None = None,
    factory: NodeFactory | None = None,
) -> PoolScaler:
    """The autoscaler over two pools: a router's, or the keeper's when several routers follow
    one decision (pdserve/routers.py)."""
    policy = config.pools.autoscale
    return PoolScaler(prefill, decode, policy, config.router.tpot_target_s, on_decision, factory)
