"""The emulated cluster of tests/e2e/test_hosts.py (the same four network namespaces and their
Ray, `emulated_hosts`; deploy/config/cluster-cpu.yaml) with `kv_transfer.transport: nixl`:
every request's KV is READ by NIXL across the prefill host's link (UCX over TCP,
`kv_transfer.ucx: {TLS: tcp}` — on one machine UCX would otherwise read the other namespace's
memory directly, around the link), counted on both sides; and the prefill host's cable pulled
during a READ costs the client nothing."""

from __future__ import annotations

import pytest

from tests.e2e.hosts import bring_up, can_make_hosts, tear_down, wait_for
from tests.e2e.test_hosts import (
    PROMPT,
    cut_the_prefill_host_mid_transfer,
    healthy,
    nodes,
    stream,
    total,
)

pytestmark = pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))

NIXL = {"transport": "nixl", "ucx": {"TLS": "tcp"}}


@pytest.fixture(scope="module")
def cluster(default_model_dir, emulated_hosts, tmp_path_factory):
    cluster = bring_up(emulated_hosts, tmp_path_factory.mktemp("hosts-nixl"), kv=NIXL)
    yield cluster
    left = tear_down(cluster)
    assert left == [], f"engine processes left on the hosts: {left}"


def test_every_requests_kv_is_read_by_nixl_across_the_link(cluster):
    sent = total(cluster, "pdserve_kv_transfer_bytes_total", direction="sent")
    received = total(cluster, "pdserve_kv_transfer_bytes_total", direction="received")
    loaded = total(cluster, "pdserve_kv_handovers_total", outcome="loaded")
    left_prefill = cluster.link_bytes("prefill", "from")
    answers = [stream(cluster, 16, f"{PROMPT} Part {i}.") for i in range(4)]
    assert all(a.usage["completion_tokens"] == 16 and a.finish == "length" for a in answers)
    wait_for(
        lambda: total(cluster, "pdserve_kv_handovers_total", outcome="loaded") == loaded + 4,
        20,
        "four hand-overs loaded",
    )
    assert total(cluster, "pdserve_kv_handovers_total", outcome="recomputed") == 0
    assert total(cluster, "pdserve_kv_transfer_failures_total") == 0
    wait_for(  # each side reports its bytes with its engine's next stats
        lambda: (
            total(cluster, "pdserve_kv_transfer_bytes_total", direction="sent") - sent
            == total(cluster, "pdserve_kv_transfer_bytes_total", direction="received") - received
            > 0
        ),
        20,
        "the bytes counted on both sides",
    )
    moved = total(cluster, "pdserve_kv_transfer_bytes_total", direction="sent") - sent
    assert cluster.link_bytes("prefill", "from") - left_prefill >= moved  # over the cable
    assert total(cluster, "pdserve_kv_prefetches_total", outcome="used") == 0  # TCP's alone


def test_the_prefill_hosts_cable_pulled_during_a_read_costs_the_client_nothing(cluster):
    long_prompt = " ".join([PROMPT] * 60)  # ~1000 tokens: ~46 MB of float32 KV
    result, took, failures = cut_the_prefill_host_mid_transfer(cluster, long_prompt + " Once.")
    assert result.error is None and result.usage["completion_tokens"] == 8, result
    assert total(cluster, "pdserve_kv_transfer_failures_total") > failures
    wait_for(  # the decode node counts it as the request ends; the router sees it next check
        lambda: total(cluster, "pdserve_kv_handovers_total", outcome="recomputed") >= 1,
        20,
        "the cut hand-over counted as recomputed",
    )
    print(f"prefill host cut mid-READ: request done in {took:.1f} s (kv timeout 10 s)")
    assert took < 10 + 30  # the pull's deadline, then the prompt recomputed on the decode host
    wait_for(lambda: healthy(cluster, "prefill") == 1, 60, "the prefill host rejoins")
    wait_for(
        lambda: all(n["kv_blocks_held"] == 0 for n in nodes(cluster, "prefill")),
        60,
        "the cut READ's blocks are released",
    )
    after = stream(cluster, 8, f"{PROMPT} After the cut.")  # and NIXL reads again
    assert after.usage["completion_tokens"] == 8
