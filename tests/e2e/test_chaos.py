"""Chaos (tests/e2e/chaos.py): steady streamed traffic through a live router while engine
processes are killed at random and hostile requests are mixed in; then an account of every
request and every kill. 2P2D on a multi-node Ray cluster simulated here, and 1P1D on this
machine. `PDSERVE_CHAOS_S` sets the traffic's length and `PDSERVE_CHAOS_SHAPES` the shapes
(CI runs a short 2P2D; docs/design.md and docs/api.md quote a longer run of both). The suite
runs 2P2D alone: each of a pool's nodes killed with a sibling left (retried, resumed on the
other) and, now and then, with none (fallbacks); 1P1D's kills of a pool's only node are
tests/e2e/test_disaggregated.py's, one at a time.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from tests.e2e import chaos
from tests.e2e.conftest import finish_server, samples, start_server

DURATION_S = float(os.environ.get("PDSERVE_CHAOS_S", "45"))
KILL_EVERY_S = float(os.environ.get("PDSERVE_CHAOS_KILL_EVERY_S", "15"))
SHAPES = os.environ.get("PDSERVE_CHAOS_SHAPES", "2P2D").split(",")
if unknown := set(SHAPES) - {"1P1D", "2P2D"}:
    raise ValueError(f"PDSERVE_CHAOS_SHAPES: {sorted(unknown)} not among 1P1D, 2P2D")
HEALTHY_WITHIN_S = 240.0
LEASE_S = 10.0


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[int]:
    from transformers import AutoTokenizer

    from tests.conftest import REPO

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return tokenizer((REPO / "docs/design.md").read_text()).input_ids


@pytest.fixture(scope="module", params=SHAPES)
def served(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"chaos-{request.param}")
    config = work / "pdserve.yaml"
    settings = (
        f"kv_transfer: {{lease_s: {LEASE_S}}}\n"
        "router: {request_timeout_s: 180}\n"
        "engine: {kv_cache_space_gib: 1}\n"
    )
    if request.param == "1P1D":
        config.write_text(settings)
        server = start_server(work, "--config", str(config))
        yield request.param, server
        finish_server(server)
        return
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1, resources={"prefill_pool": 2})
    cluster.add_node(num_cpus=1, resources={"decode_pool": 2})
    cluster.wait_for_nodes()
    config.write_text(
        settings + "pools:\n"
        "  prefill: {replicas: 2, num_cpus: 0.5, resources: {prefill_pool: 1}}\n"
        "  decode: {replicas: 2, num_cpus: 0.5, resources: {decode_pool: 1}}\n"
    )
    try:
        server = start_server(work, "--config", str(config), "--address", cluster.address)
        yield request.param, server
        finish_server(server)
    finally:
        cluster.shutdown()


def test_every_request_ends_and_every_pool_comes_back(served, prompts, tmp_path):
    shape, server = served
    account, stop = chaos.Account(), threading.Event()
    headers: dict = {}
    threads = [
        threading.Thread(
            target=chaos.client, args=(server.url, headers, prompts, seed, stop, account)
        )
        for seed in range(3)
    ]
    threads.append(
        threading.Thread(
            target=chaos.killer, args=(server.url, headers, KILL_EVERY_S, 7, stop, account)
        )
    )
    watcher_stop = threading.Event()
    watcher = threading.Thread(
        target=chaos.watch_recovery, args=(server.url, headers, watcher_stop, account)
    )
    for thread in [*threads, watcher]:
        thread.start()
    time.sleep(DURATION_S)  # the traffic's length is the experiment itself
    stop.set()
    for thread in threads:
        thread.join(timeout=chaos.CLIENT_TIMEOUT_S + 30)
        assert not thread.is_alive(), "a client is stuck past its timeout"

    deadline = time.monotonic() + HEALTHY_WITHIN_S
    while True:
        pools = chaos.health(server.url, headers)["pools"]
        if all(view["healthy"] == len(view["nodes"]) for view in pools.values()):
            break
        assert time.monotonic() < deadline, f"pools not healthy in {HEALTHY_WITHIN_S} s: {pools}"
        time.sleep(1)
    deadline = time.monotonic() + LEASE_S + 20
    while any(n["kv_blocks_held"] for v in pools.values() for n in v["nodes"]):
        assert time.monotonic() < deadline, f"KV blocks still held: {pools}"
        time.sleep(1)
        pools = chaos.health(server.url, headers)["pools"]
    deadline = time.monotonic() + 10  # the last recoveries are noted at the watcher's next sample
    while any(k.recovered_s is None for k in account.kills) and time.monotonic() < deadline:
        time.sleep(0.2)
    watcher_stop.set()
    watcher.join(timeout=10)

    scraped = samples(server)
    counted = {
        name: sum(s.value for s in scraped if s.name == f"pdserve_{name}_total")
        for name in ("stream_resumes", "request_retries", "prefill_fallbacks", "decode_fallbacks")
    }
    blocks = sum(n["kv_blocks_held"] for v in pools.values() for n in v["nodes"])
    summary = {
        "shape": shape,
        "duration_s": DURATION_S,
        **account.summary(),
        **counted,
        "kv_blocks_held_after": blocks,
    }
    (tmp_path / "chaos.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    results = [o.result for o in account.outcomes]
    assert account.kills, "nothing was killed"
    assert "hung" not in results and "broken" not in results, summary
    for outcome in account.outcomes:
        if outcome.kind.startswith("hostile-") and outcome.kind != "hostile-vanish":
            if outcome.kind == "hostile-slow":
                assert outcome.result in ("completed", "error-http-503"), outcome
            else:
                assert outcome.result in ("error-http-400", "error-http-413"), outcome
        if outcome.kind == "stream":  # stateless: resumed through any single failure
            assert outcome.result in ("completed", "error-http-503", "error-event"), outcome
    # A 503 is a refusal at the door while no node could take the request (its count grows with
    # how fast clients come back, not with the service); of the streams taken on, most finish.
    taken = [o for o in account.outcomes if o.kind == "stream" and o.result != "error-http-503"]
    completed = sum(1 for o in taken if o.result == "completed")
    assert taken and completed >= 0.5 * len(taken), summary
    assert all(kill.recovered_s is not None for kill in account.kills), summary
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=120
    )
    assert ok.status_code == 200
