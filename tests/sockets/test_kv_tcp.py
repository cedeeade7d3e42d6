"""A KV pull over real loopback sockets: the prefill node's KV server, the decode node's client,
the TCP data plane between them, with CPU tensors laid out like vLLM's cache."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest
import torch

import prefill_node.kv_server as kv_server
from decode_node.kv_client import KVClient
from pdserve_core.kv.handle import KVHandle
from pdserve_core.kv.layout import LayoutError, describe, mismatch
from pdserve_core.kv.stats import TransferStats
from pdserve_core.kv.transport import plane_class
from pdserve_core.kv.transport.tcp import TcpPlane
from pdserve_core.kv.wire import TransferError
from prefill_node.kv_server import KVServer
from prefill_node.leases import ProducerTable

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 16, 3, 128, 64


def caches(fill: bool) -> dict[str, torch.Tensor]:
    """[blocks, heads, block_size, 2*head_dim] bf16 per layer, as on vLLM's CPU backend."""
    out = {}
    for layer in range(LAYERS):
        shape = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
        t = (
            torch.randn(shape).to(torch.bfloat16)
            if fill
            else torch.zeros(shape, dtype=torch.bfloat16)
        )
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def layout(kv, **changes):
    args = dict(
        model="smol",
        block_size=BLOCK_SIZE,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        tp_rank=0,
        tp_size=1,
        transport="tcp",
    )
    args.update(changes)
    return describe(kv, **args)


def handle(port: int, request_id: str, blocks: list[int], lease_s: float = 30) -> KVHandle:
    return KVHandle(
        "127.0.0.1", (port,), request_id, tuple(blocks), 5, time.time() + lease_s, "e", "tcp"
    )


@pytest.fixture
def producer():
    kv = caches(fill=True)
    table = ProducerTable()
    server = KVServer(TcpPlane(layout(kv), kv), table, lambda: b"secret", TransferStats())
    port = server.start()
    yield kv, table, server, port
    server.close()


def consumer(secret=b"secret", **layout_changes):
    kv = caches(fill=False)
    return kv, KVClient(TcpPlane(layout(kv, **layout_changes), kv), lambda: secret)


def test_pull_copies_exact_blocks_and_releases_the_lease(producer):
    src, table, _, port = producer
    dst, client = consumer()
    table.offer("req-1", [2, 3, 4, 9], time.time() + 30)
    moved = client.pull(
        handle(port, "req-1", [2, 3, 4, 9]), [2, 3, 4, 9], [0, 1, 5, 6], 0, time.monotonic() + 10
    )
    assert moved == 4 * LAYERS * HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2
    for name in src:
        assert torch.equal(dst[name][[0, 1, 5, 6]], src[name][[2, 3, 4, 9]])
        assert not dst[name][[2, 3, 4]].any()  # nothing else written
    assert until(table.collect_done) == {"req-1"}


def until(poll, timeout: float = 5.0):
    """Poll until it returns something truthy (the server finishes just after the client)."""
    deadline = time.monotonic() + timeout
    while not (value := poll()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def test_data_planes_are_chosen_by_name_lazily():
    assert plane_class("tcp") is TcpPlane
    with pytest.raises(ValueError, match="unknown KV transport 'udp'"):
        plane_class("udp")


def test_wrong_secret_is_refused_without_kv(producer, caplog):
    _, table, _, port = producer
    dst, client = consumer(secret=b"guess")
    table.offer("req-2", [1], time.time() + 30)
    with caplog.at_level(logging.WARNING):
        with pytest.raises(TransferError) as failed:
            client.pull(handle(port, "req-2", [1]), [1], [1], 0, time.monotonic() + 10)
        # the server logs the refusal just after the client has read it
        assert until(lambda: "wrong cluster secret" in caplog.text)
    assert failed.value.reason == "auth"
    assert not any(t.any() for t in dst.values())
    assert table.blocks_held() == 1  # still offered: the real consumer may still come


def test_layout_mismatch_names_the_field(producer):
    _, table, _, port = producer
    _, client = consumer(model="llama")
    table.offer("req-3", [1], time.time() + 30)
    with pytest.raises(TransferError) as failed:
        client.pull(handle(port, "req-3", [1]), [1], [1], 0, time.monotonic() + 10)
    assert failed.value.reason == "handshake"
    assert "model is 'smol' here but 'llama' on the peer" in str(failed.value)


def test_mismatch_checks_every_field():
    kv = caches(fill=False)
    base = layout(kv)
    assert mismatch(base, layout(kv)) is None
    assert "block_size" in mismatch(base, layout(kv, block_size=64))
    assert "dtype" in mismatch(
        base, describe({k: v.float() for k, v in kv.items()}, "smol", 128, 3, 64, 0, 1, "tcp")
    )
    assert "num_layers" in mismatch(base, layout(dict(list(kv.items())[:2])))


def test_non_contiguous_blocks_are_refused():
    kv = {"l0": torch.zeros(4, 8, 3, 16).transpose(0, 1)}
    with pytest.raises(LayoutError, match="contiguous"):
        layout(kv)


@pytest.mark.parametrize(
    ("offer", "ask", "reason"),
    [(None, [1], "unknown_request"), ([1, 2], [2, 7], "bad_blocks")],
)
def test_refused_pulls_say_why(producer, monkeypatch, offer, ask, reason):
    monkeypatch.setattr(kv_server, "CLAIM_WAIT_S", 0.2)
    _, table, _, port = producer
    _, client = consumer()
    if offer:
        table.offer("req-4", offer, time.time() + 30)
    with pytest.raises(TransferError) as failed:
        client.pull(handle(port, "req-4", ask), ask, ask, 0, time.monotonic() + 10)
    assert failed.value.reason == reason


def test_expired_lease(producer):
    _, table, _, port = producer
    _, client = consumer()
    table.offer("req-5", [1], time.time() - 1)
    with pytest.raises(TransferError) as failed:
        client.pull(handle(port, "req-5", [1]), [1], [1], 0, time.monotonic() + 10)
    assert failed.value.reason == "lease_expired"
    assert table.collect_done() == {"req-5"} and table.leases_expired == 1


def test_nobody_listening():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _, client = consumer()
    started = time.monotonic()
    with pytest.raises(TransferError) as failed:
        client.pull(handle(port, "r", [1]), [1], [1], 0, time.monotonic() + 5)
    assert failed.value.reason == "connect" and time.monotonic() - started < 5


def test_a_stalled_producer_ends_at_the_deadline():
    server = socket.create_server(("127.0.0.1", 0))  # accepts, never speaks
    port = server.getsockname()[1]
    _, client = consumer()
    started = time.monotonic()
    with server, pytest.raises(TransferError) as failed:
        client.pull(handle(port, "r", [1]), [1], [1], 0, time.monotonic() + 1.0)
    assert failed.value.reason == "timeout"
    assert time.monotonic() - started < 3


def test_producer_dying_mid_transfer_is_a_reset(producer):
    src, table, server, port = producer
    server.plane.rate_limit = 2e6  # ~1.5 MB at 2 MB/s: long enough to cut
    _, client = consumer()
    table.offer("req-6", list(range(6)), time.time() + 30)
    sending = threading.Event()
    pace = server.plane.pace

    def paced(started: float, sent: int) -> None:
        sending.set()  # the blocks are on their way
        pace(started, sent)

    server.plane.pace = paced

    def cut() -> None:
        assert sending.wait(10)
        server.close()

    killer = threading.Thread(target=cut)
    killer.start()
    with pytest.raises(TransferError) as failed:
        client.pull(
            handle(port, "req-6", list(range(6))),
            list(range(6)),
            list(range(6)),
            0,
            time.monotonic() + 10,
        )
    killer.join()
    assert failed.value.reason in ("connection_reset", "timeout")
    assert table.collect_done() == set()  # not completed: still held until the lease ends


def test_garbage_from_a_peer_is_closed_and_logged(producer, caplog):
    _, table, _, port = producer
    table.offer("req-7", [1], time.time() + 30)
    with caplog.at_level(logging.WARNING), socket.create_connection(("127.0.0.1", port)) as raw:
        raw.settimeout(5)
        raw.recv(4096)  # the challenge
        raw.sendall(struct.pack(">I", 8) + b"\x08\x96\x01garbage")
        leftover = b""
        try:
            while chunk := raw.recv(4096):
                leftover += chunk
        except ConnectionResetError:
            pass  # closed on us: what a malformed peer should get
    assert len(leftover) < 200  # at most a refusal, never KV bytes
    deadline = time.monotonic() + 5
    while "closed connection" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "closed connection" in caplog.text
    assert table.blocks_held() == 1


def test_a_signed_lease_serves_a_pull_that_outran_the_offer(producer, monkeypatch):
    from pdserve_core.kv.wire import lease_token

    monkeypatch.setattr(kv_server, "CLAIM_WAIT_S", 0.2)
    src, table, _, port = producer
    dst, client = consumer()
    deadline = time.time() + 30
    signed = KVHandle(
        "127.0.0.1",
        (port,),
        "early",
        (4, 5),
        200,
        deadline,
        "e",
        "tcp",
        lease_token(b"secret", "", "early", [4, 5], deadline, 1),
    )
    client.pull(signed, [5], [1], 0, time.monotonic() + 10)  # no offer yet: the lease stands in
    for name in src:
        assert torch.equal(dst[name][1], src[name][5])
    assert until(table.collect_done) == {"early"}
    table.offer("early", [4, 5], deadline)  # the late notice is ignored: already settled
    assert table.blocks_held() == 0
    forged = KVHandle(
        "127.0.0.1",
        (port,),
        "forged",
        (4, 5),
        200,
        deadline,
        "e",
        "tcp",
        lease_token(b"guess", "", "forged", [4, 5], deadline, 1),
    )
    with pytest.raises(TransferError) as failed:
        client.pull(forged, [5], [1], 0, time.monotonic() + 10)
    assert failed.value.reason == "unknown_request"


def test_a_peer_that_never_proves_itself_loses_its_slot(producer, monkeypatch):
    """Slow-loris on the handshake: the server hangs up at the auth deadline, whatever the
    per-read timeouts."""
    monkeypatch.setattr(kv_server, "AUTH_DEADLINE_S", 1.0)
    _, _, _, port = producer
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.settimeout(10)
        raw.recv(4096)  # the challenge
        started = time.monotonic()
        raw.sendall(struct.pack(">I", 40))  # a length, then silence
        assert raw.recv(4096) == b""  # closed on us
        assert time.monotonic() - started < 5


def test_a_flood_from_one_peer_does_not_fail_another_peers_pulls(producer, caplog):
    """A host that can reach the KV port connects again and again and says nothing: it holds at
    most its own share of places; a decode worker on another address still pulls."""
    src, table, _, port = producer
    flood = []
    try:
        for _ in range(kv_server.MAX_PULLS + 40):  # more than every pull slot
            raw = socket.socket()
            raw.bind(("127.0.0.2", 0))  # another host of the loopback network
            raw.settimeout(10)
            raw.connect(("127.0.0.1", port))
            flood.append(raw)
        open_ = [raw for raw in flood if raw.recv(4096)]  # a challenge, or closed at once
        assert len(open_) == kv_server.MAX_UNPROVEN_PER_PEER
        dst, client = consumer()
        table.offer("req-f", [1, 2], time.time() + 30)
        client.pull(handle(port, "req-f", [1, 2]), [1, 2], [3, 4], 0, time.monotonic() + 10)
        for name in src:
            assert torch.equal(dst[name][[3, 4]], src[name][[1, 2]])
    finally:
        for raw in flood:
            raw.close()
    assert "too many unproven connections; refused {'127.0.0.2': 1}" in caplog.text


def test_an_oversized_frame_before_authentication_is_refused_unread(producer):
    _, _, _, port = producer
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.settimeout(10)
        raw.recv(4096)
        raw.sendall(struct.pack(">I", 1 << 20))  # 1 MiB "answer": never allocated
        try:
            assert raw.recv(4096) == b""
        except ConnectionResetError:
            pass


def test_a_lease_signed_for_another_engine_start_is_not_honoured(monkeypatch):
    """Lease tokens bind the producer engine's id (new at every start): a token replayed
    against a restarted producer on the same port serves nothing."""
    from pdserve_core.kv.wire import lease_token

    monkeypatch.setattr(kv_server, "CLAIM_WAIT_S", 0.2)
    kv = caches(fill=True)
    server = KVServer(
        TcpPlane(layout(kv), kv), ProducerTable(), lambda: b"secret", TransferStats(),
        engine_id="engine-after-restart",
    )  # fmt: skip
    port = server.start()
    try:
        _, client = consumer()
        deadline = time.time() + 30
        token = lease_token(b"secret", "engine-before-restart", "old", [4, 5], deadline, 1)
        old = KVHandle("127.0.0.1", (port,), "old", (4, 5), 200, deadline, "e", "tcp", token)
        with pytest.raises(TransferError) as refused:
            client.pull(old, [5], [1], 0, time.monotonic() + 10)
        assert refused.value.reason == "unknown_request"
    finally:
        server.close()


def tls_pair(tmp_path, producer_names=("127.0.0.1",), consumer_ca=None, check_hostname=True):
    """A producer on mutual TLS and a consumer with its own certificate (signed by the same CA
    unless `consumer_ca` says otherwise)."""
    import trustme

    from pdserve_core.kv.settings import ConnectorSettings
    from tests.helpers.certs import issue

    ca = trustme.CA()
    server_files = issue(tmp_path / "producer", producer_names, ca)
    client_files = issue(tmp_path / "consumer", ("127.0.0.1",), consumer_ca or ca)
    server_side = ConnectorSettings(
        tls_cert_file=server_files.cert_file,
        tls_key_file=server_files.key_file,
        tls_ca_file=server_files.ca_file,
    )
    client_side = ConnectorSettings(
        tls_cert_file=client_files.cert_file,
        tls_key_file=client_files.key_file,
        tls_ca_file=server_files.ca_file,
        tls_check_hostname=check_hostname,
    )
    kv = caches(fill=True)
    table = ProducerTable()
    server = KVServer(
        TcpPlane(layout(kv), kv),
        table,
        lambda: b"secret",
        TransferStats(),
        tls=server_side.server_tls(),
    )
    dst = caches(fill=False)
    client = KVClient(TcpPlane(layout(dst), dst), lambda: b"secret", client_side.client_tls())
    return kv, table, server, server.start(), dst, client


def test_a_pull_over_mutual_tls_copies_exact_blocks(tmp_path):
    src, table, server, port, dst, client = tls_pair(tmp_path)
    try:
        table.offer("req-t", [1, 2, 5], time.time() + 30)
        moved = client.pull(
            handle(port, "req-t", [1, 2, 5]), [1, 2, 5], [3, 4, 6], 0, time.monotonic() + 10
        )
        assert moved == 3 * LAYERS * HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2
        for name in src:
            assert torch.equal(dst[name][[3, 4, 6]], src[name][[1, 2, 5]])
        assert until(table.collect_done) == {"req-t"}
    finally:
        server.close()


@pytest.mark.parametrize(
    "case, reasons",
    [
        ("plain client", ("connection_reset", "handshake")),
        ("client of another CA", ("connection_reset", "auth")),
        ("certificate for another address", ("auth",)),
    ],
)
def test_tls_refuses_peers_it_cannot_verify(tmp_path, case, reasons):
    import trustme

    pair = dict(tmp_path=tmp_path)
    if case == "client of another CA":
        pair["consumer_ca"] = trustme.CA()
    if case == "certificate for another address":
        pair["producer_names"] = ("127.0.0.9",)
    src, table, server, port, dst, client = tls_pair(**pair)
    if case == "plain client":
        client = consumer()[1]
    try:
        table.offer("req-x", [1], time.time() + 30)
        with pytest.raises(TransferError) as refused:
            client.pull(handle(port, "req-x", [1]), [1], [2], 0, time.monotonic() + 5)
        assert refused.value.reason in reasons, refused.value
        assert table.blocks_held() == 1 and not table.collect_done()  # nothing was served
    finally:
        server.close()


def test_one_cluster_certificate_serves_any_address_without_hostname_checks(tmp_path):
    src, table, server, port, dst, client = tls_pair(
        tmp_path, producer_names=("pdserve-cluster",), check_hostname=False
    )
    try:
        table.offer("req-c", [1], time.time() + 30)
        client.pull(handle(port, "req-c", [1]), [1], [2], 0, time.monotonic() + 10)
        for name in src:
            assert torch.equal(dst[name][2], src[name][1])
    finally:
        server.close()


def test_tls_settings_come_in_threes_and_name_a_missing_file(tmp_path):
    from pdserve_core.kv.settings import ConnectorSettings

    with pytest.raises(ValueError, match="together"):
        ConnectorSettings.from_extra({"secret": "s", "tls_cert_file": "x.pem"})
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="missing.pem"):
        ConnectorSettings.from_extra(
            {
                "secret": "s",
                "tls_cert_file": missing,
                "tls_key_file": missing,
                "tls_ca_file": missing,
            }
        )
