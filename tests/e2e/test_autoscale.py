"""Pools that follow the balance, on a multi-node Ray cluster simulated on this machine: 1P2D of
`kv_both` nodes with `pools.autoscale` on. Long prompts load the prefill pool while the decode
pool idles, so the router moves a decode node into the prefill pool (no reload: the same engine
takes prefill legs from then on, its KV pulled by the remaining decode node), counts the decision
and logs it; every request before, during and after the move completes."""

from __future__ import annotations

import concurrent.futures
import random
import re
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import finish_server, metric, start_server

MOVE_DEADLINE_S = 180
DECISIONS = "pdserve_autoscale_decisions_total"
PROMPT_TOKENS = 1200


def serve_autoscaled(
    work, hosts: dict[str, int], replicas: dict[str, int], autoscale: str, routers: int = 1
):
    """A two-host Ray cluster (one advertising `prefill_pool`, one `decode_pool`, as many of each
    as `hosts` says) and `pdserve serve --routers <routers>` joined to it with `replicas` kv_both
    nodes per pool (half a CPU each), remote placement and `pools.autoscale` {enabled,
    `autoscale`}; yields the server."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    for pool, slots in hosts.items():
        cluster.add_node(num_cpus=1, resources={f"{pool}_pool": slots})
    cluster.wait_for_nodes()
    config = work / "pdserve.yaml"
    pools = "".join(
        f"  {pool}: {{replicas: {count}, num_cpus: 0.5, resources: {{{pool}_pool: 1}}}}\n"
        for pool, count in replicas.items()
    )
    config.write_text(
        "mode: disaggregated\n"
        "engine: {kv_cache_space_gib: 1}\n"
        "router: {placement: {mode: remote}}\n"
        f"pools:\n{pools}  autoscale: {{enabled: true, interval_s: 1, {autoscale}}}\n"
    )
    server = start_server(
        work, "--config", str(config), "--address", cluster.address, "--routers", str(routers)
    )
    try:
        yield server
    finally:
        finish_server(server)
        cluster.shutdown()


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    yield from serve_autoscaled(
        tmp_path_factory.mktemp("serve-autoscale"),
        hosts={"prefill": 1, "decode": 2},
        replicas={"prefill": 1, "decode": 2},
        autoscale="cooldown_s: 2, reversal_s: 600, min_pressure: 0.3",
    )


def _pools(server) -> dict:
    state = httpx.get(f"{server.url}/health", timeout=10).json()["pools"]
    return {name: [n["name"] for n in pool["nodes"]] for name, pool in state.items()}


def _ask(server, rng: random.Random, max_tokens: int = 2) -> dict:
    prompt = [rng.randrange(1000, 20000) for _ in range(PROMPT_TOKENS)]
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def load_until(server, done, deadline_s: float) -> tuple[list[dict], list[str]]:
    """Four clients send long prompts back to back until `done()` or `deadline_s`; `server`: a
    server, or a list of them (one per router) the clients take in turn. Returns (answers,
    failures)."""
    servers = server if isinstance(server, list) else [server]
    stop, answers, failures = threading.Event(), [], []

    def load(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                answers.append(_ask(servers[seed % len(servers)], rng))
            except Exception as error:  # noqa: BLE001 - returned, asserted by the caller
                failures.append(repr(error))

    workers = [threading.Thread(target=load, args=(seed,)) for seed in range(4)]
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and not done():
            time.sleep(0.5)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=300)
    return answers, failures


def test_a_loaded_prefill_pool_takes_a_node_from_the_idle_decode_pool(autoscaled):
    server = autoscaled
    before = _pools(server)
    assert len(before["prefill"]) == 1 and len(before["decode"]) == 2
    moved = {"action": "to_prefill", "reason": "moved"}
    assert metric(server, DECISIONS, **moved) == 0
    answers, failures = load_until(
        server, lambda: len(_pools(server)["prefill"]) >= 2, MOVE_DEADLINE_S
    )
    after = _pools(server)
    assert len(after["prefill"]) == 2 and len(after["decode"]) == 1, after
    [newcomer] = [name for name in after["prefill"] if name not in before["prefill"]]
    assert newcomer.startswith("pdserve-decode-")
    assert metric(server, DECISIONS, **moved) >= 1
    assert re.search(rf"autoscale: {newcomer} moves from the decode pool", server.log.read_text())
    assert not failures, failures[:3]
    assert answers and all(a["usage"]["completion_tokens"] == 2 for a in answers)

    # the moved node now takes prefill legs; their KV crosses to the remaining decode node
    routed = {"node": newcomer, "pool": "prefill"}
    start = metric(server, "pdserve_routing_decisions_total", **routed)
    rng = random.Random(99)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        later = list(pool.map(lambda _: _ask(server, rng, max_tokens=6), range(8)))
    assert all(a["usage"]["completion_tokens"] == 6 for a in later), later
    assert metric(server, "pdserve_routing_decisions_total", **routed) > start
