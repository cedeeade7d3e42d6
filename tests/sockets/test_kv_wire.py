"""The KV control channel's framing and HMAC proofs, over real socket pairs."""

from __future__ import annotations

import socket
import struct

import pytest

from pdserve_core.kv.transport.plane import block_runs
from pdserve_core.kv.wire import ProtocolError, proof, recv_message, send_message, verify
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
