"""xPyD on a multi-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`):
one host advertises `prefill_pool`, another `decode_pool`; `pdserve serve --address` joins it,
places each pool's nodes on the hosts that advertise its resource, and spreads load by policy."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.e2e.conftest import finish_server, start_server

SHAPES = {"2P1D": (2, 1), "1P2D": (1, 2)}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    hosts = {
        "prefill": cluster.add_node(num_cpus=1, resources={"prefill_pool": 2}),
        "decode": cluster.add_node(num_cpus=1, resources={"decode_pool": 2}),
    }
    cluster.wait_for_nodes()
    yield cluster, hosts
    cluster.shutdown()


@pytest.fixture(scope="module", params=list(SHAPES))
def served(request, cluster, tmp_path_factory):
    ray_cluster, hosts = cluster
    prefill, decode = SHAPES[request.param]
    work = tmp_path_factory.mktemp(f"serve-{request.param}")
    config = work / "pdserve.yaml"
    config.write_text(
        "mode: disaggregated\n"
        "engine: {kv_cache_space_gib: 1}\n"
        "router: {policy: least_outstanding}\n"
        "pools:\n"
        f"  prefill: {{replicas: {prefill}, num_cpus: 0.5, resources: {{prefill_pool: 1}}}}\n"
        f"  decode: {{replicas: {decode}, num_cpus: 0.5, resources: {{decode_pool: 1}}}}\n"
    )
    server = start_server(work, "--config", str(config), "--address", ray_cluster.address)
    yield request.param, server, hosts
    finish_server(server)


def pools(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()["pools"]


def test_nodes_land_on_the_hosts_that_advertise_their_pool(served):
    shape, server, hosts = served
    prefill, decode = SHAPES[shape]
    state = pools(server)
    assert state["prefill"]["healthy"] == prefill and state["decode"]["healthy"] == decode
    for pool in ("prefill", "decode"):
        assert {n["ray_node_id"] for n in state[pool]["nodes"]} == {hosts[pool].node_id}


def test_load_spreads_over_the_pool_and_answers_are_right(served):
    shape, server, _ = served
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}

    def ask(_):
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=180).json()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    # concurrent bf16 requests share batches, so their texts may differ: each must be whole
    assert all(a["usage"]["completion_tokens"] == 8 for a in answers), answers
    assert all(a["choices"][0]["text"].strip() for a in answers), answers

    def counts() -> dict:  # the router refreshes node stats every second
        state = pools(server)
        return {name: [n["requests_total"] for n in state[name]["nodes"]] for name in state}

    deadline = time.monotonic() + 15
    while not all(c > 0 for cs in counts().values() for c in cs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(c > 0 for cs in counts().values() for c in cs), (shape, counts())
