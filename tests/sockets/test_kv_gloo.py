"""The collective plane (the NCCL plane's pairing, ordering, deadlines and abort) run for real on
torch.distributed's gloo: pulls through the KV server and client on loopback, a peer that never
joins, a peer that dies mid-transfer, and two hosts in network namespaces (root only)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from decode_node.kv_client import KVClient
from pdserve_core.kv.handle import KVHandle
from pdserve_core.kv.layout import describe
from pdserve_core.kv.stats import TransferStats
from pdserve_core.kv.transport.collective import Pairing
from pdserve_core.kv.transport.gloo import GlooBackend, GlooPlane, parse_id
from pdserve_core.kv.wire import ProtocolError
from prefill_node.kv_server import KVServer
from prefill_node.leases import ProducerTable
from tests.conftest import REPO
from tests.helpers.kv_caches import cpu_caches

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 3, 12, 3, 16, 64
PEER = REPO / "tests/helpers/gloo_peer.py"


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    return cpu_caches(LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, seed)


def plane(kv) -> GlooPlane:
    return GlooPlane(describe(kv, "smol", BLOCK_SIZE, HEADS, HEAD_DIM, 0, 1, "gloo"), kv)


def handle(host: str, port: int, request_id: str, blocks: list[int]) -> KVHandle:
    return KVHandle(host, (port,), request_id, tuple(blocks), 5, time.time() + 60, "e", "gloo")


@pytest.fixture
def producer():
    kv = caches(seed=1)
    table = ProducerTable()
    server = KVServer(plane(kv), table, lambda: b"secret", TransferStats())
    port = server.start()
    yield kv, table, server, port
    server.close()


def test_pulls_move_exact_blocks_and_the_second_reuses_the_pair(producer):
    src, table, server, port = producer
    dst = caches(seed=None)
    consumer = plane(dst)
    client = KVClient(consumer, lambda: b"secret")
    for request, remote, local in (("r0", [1, 2, 7], [0, 3, 4]), ("r1", [5, 6], [8, 9])):
        table.offer(request, remote, time.time() + 30)
        client.pull(handle("127.0.0.1", port, request, remote), remote, local, 0,
                    time.monotonic() + 20)  # fmt: skip
        for name in src:
            assert torch.equal(dst[name][local], src[name][remote])
    assert len(consumer.pairing._by_key) == 1  # one communicator for both pulls
    assert len(server.plane.pairing._by_key) == 1


def test_a_join_the_peer_never_makes_fails_at_its_deadline_and_is_forgotten():
    consumer = Pairing(GlooBackend())
    peer = ("127.0.0.1", 1)
    first = consumer.consumer_fields(peer, "127.0.0.1")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        consumer.consumer_link(peer, first, "127.0.0.1", time.monotonic() + 1.0)
    assert time.monotonic() - started < 5
    consumer.forget(peer)  # what the plane does with a failed join
    assert consumer.consumer_fields(peer, "127.0.0.1")["nccl_unique_id"] != first["nccl_unique_id"]


def test_malformed_pair_ids_are_refused():
    producer = Pairing(GlooBackend())
    for bad in (b"x" * 128, b"host|port|key".ljust(128, b"\0"), b"h|99999|k".ljust(128, b"\0")):
        with pytest.raises(ProtocolError):
            producer.producer_link({"nccl_unique_id": bad}, "127.0.0.1", time.monotonic() + 1)
    with pytest.raises(ProtocolError, match="128 bytes"):
        producer.producer_link({"nccl_unique_id": b"short"})
    assert parse_id(b"127.0.0.1|4000|ab12".ljust(128, b"\0")) == ("127.0.0.1", 4000, "ab12")


def test_a_peer_that_dies_mid_transfer_fails_the_pull_in_time_and_the_pair_starts_over():
    """The producer joins, sends one run of three, and its process exits: the consumer's wait
    ends with an error well before its deadline, and the pair is aborted and forgotten."""
    kv = caches(seed=None)
    consumer = plane(kv)
    peer = ("127.0.0.1", 2)
    fields = consumer.consumer_pairing(peer, "127.0.0.1")
    dying = subprocess.Popen(
        [sys.executable, str(PEER), "send-then-die", fields["nccl_unique_id"].hex()],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        link = consumer.consumer_link(peer, fields, "127.0.0.1", time.monotonic() + 30)
        started = time.monotonic()
        with pytest.raises((ConnectionError, TimeoutError)):
            consumer.recv_blocks(None, [0, 1, 2], time.monotonic() + 20, link)
        assert time.monotonic() - started < 20
    finally:
        dying.wait(timeout=30)
    assert consumer.pairing._by_key == {}  # aborted: the next pull pairs afresh
    assert "nccl_unique_id" in consumer.consumer_pairing(peer, "127.0.0.1")


def test_a_pull_across_two_hosts(tmp_path):
    """Producer and consumer in two network namespaces (their own addresses, a bridge between):
    gloo binds each side to its host's address and the blocks arrive exact."""
    from tests.e2e.hosts import can_make_hosts

    if can_make_hosts():
        pytest.skip(can_make_hosts())
    from pdserve.hosts import EmulatedCluster, HostsError

    try:
        EmulatedCluster.find("pdk").down()
    except HostsError:
        pass
    hosts = EmulatedCluster.up(["prod", "cons"], "pdk", "127.103.0.0/24")
    try:
        out = tmp_path / "producer.json"
        server = hosts.popen("prod", [sys.executable, str(PEER), "serve", hosts.address("prod"),
                                      str(out)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        port = int(server.stdout.readline().split()[1])
        pulled = hosts.run(
            "cons", [sys.executable, str(PEER), "pull", hosts.address("prod"), str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert pulled.returncode == 0, pulled.stderr[-3000:]
        server.wait(timeout=60)
        sent, received = json.loads(out.read_text()), json.loads(pulled.stdout.splitlines()[-1])
        assert received["digests"] == sent["digests"] and received["pairs"] == 1
    finally:
        hosts.down()
