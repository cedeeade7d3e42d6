"""Control-channel framing, HMAC proofs, and the producer's lease table (pure logic)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from pdserve.kv.lease import ClaimError, ProducerTable
from pdserve.kv.transport.base import block_runs
from pdserve.kv.wire import ProtocolError, proof, recv_message, send_message, verify
from pdserve_proto.v1 import kv_transfer_pb2 as pb


def test_messages_round_trip_over_a_socket():
    a, b = socket.socketpair()
    with a, b:
        send_message(a, pb.PullRequest(request_id="r-1", block_ids=[3, 4, 9]))
        got = recv_message(b, pb.PullRequest)
    assert got.request_id == "r-1" and list(got.block_ids) == [3, 4, 9]


def test_oversized_and_malformed_frames_are_protocol_errors():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 50 << 20))
        with pytest.raises(ProtocolError, match="exceeds"):
            recv_message(b, pb.PullRequest)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 4) + b"\xff\xff\xff\xff")
        with pytest.raises(ProtocolError, match="malformed"):
            recv_message(b, pb.PullRequest)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 10) + b"abc")
        a.close()
        with pytest.raises(ConnectionError):
            recv_message(b, pb.PullRequest)


def test_proofs_bind_secret_role_and_nonces():
    mac = proof(b"s", b"consumer", b"n1", b"n2")
    assert verify(mac, proof(b"s", b"consumer", b"n1", b"n2"))
    assert not verify(mac, proof(b"other", b"consumer", b"n1", b"n2"))
    assert not verify(mac, proof(b"s", b"producer", b"n1", b"n2"))
    assert not verify(mac, proof(b"s", b"consumer", b"n2", b"n1"))


def test_block_runs_group_consecutive_ids():
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert block_runs([]) == []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_offer_claim_release_frees_the_blocks():
    table = ProducerTable(clock=Clock())
    table.offer("r", [1, 2, 3], deadline=1010)
    assert table.blocks_held() == 3
    table.claim("r", [2, 3], wait_s=0)
    assert table.collect_done() == set()  # being read
    table.release("r", completed=True)
    assert table.collect_done() == {"r"}
    assert table.blocks_held() == 0 and table.leases_expired == 0


def test_a_failed_read_keeps_the_offer_until_its_lease_ends():
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.offer("r", [1], deadline=1010)
    table.claim("r", [1], wait_s=0)
    table.release("r", completed=False)
    assert table.collect_done() == set()
    clock.now = 1011
    assert table.collect_done() == {"r"}
    assert table.leases_expired == 1
    with pytest.raises(ClaimError) as refused:
        table.claim("r", [1], wait_s=0)
    assert refused.value.reason == "lease_expired"


def test_no_expiry_under_a_reader():
    clock = Clock()
    table = ProducerTable(clock=clock)
    table.offer("r", [7], deadline=1001)
    table.claim("r", [7], wait_s=0)
    clock.now = 2000
    assert table.collect_done() == set()  # never freed while read
    table.release("r", completed=True)
    assert table.collect_done() == {"r"} and table.leases_expired == 0


def test_claims_are_checked():
    clock = Clock()
    table = ProducerTable(clock=clock)
    with pytest.raises(ClaimError) as unknown:
        table.claim("nope", [1], wait_s=0.05)
    assert unknown.value.reason == "unknown_request"
    table.offer("r", [1, 2], deadline=1010)
    with pytest.raises(ClaimError) as bad:
        table.claim("r", [2, 5], wait_s=0)
    assert bad.value.reason == "bad_blocks" and "[5]" in str(bad.value)
    clock.now = 1011
    with pytest.raises(ClaimError) as late:
        table.claim("r", [1], wait_s=0)
    assert late.value.reason == "lease_expired"


def test_a_claim_waits_for_an_offer_that_is_on_its_way():
    table = ProducerTable()
    timer = threading.Timer(0.1, table.offer, args=("r", [1], time.time() + 30))
    timer.start()
    started = time.monotonic()
    table.claim("r", [1], wait_s=5)
    assert time.monotonic() - started < 4
    timer.join()
