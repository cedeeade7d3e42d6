"""The KV control channel's wire (proto/pdserve/v1/kv_transfer.proto): framing, proofs, leases.

Each control message is a 4-byte big-endian length and a serialized protobuf message. Lengths
are capped (`MAX_MESSAGE_BYTES`) so a malformed or hostile peer cannot make us allocate; every
read has the socket's timeout. Authentication is HMAC-SHA256 challenge-response in both
directions over fresh nonces: the secret never crosses the wire, and a replayed answer is useless.
The token plane (pdserve_core/engine/deltas.py) proves the same secret with the same messages, under
roles of its own, so no proof made for one plane serves on the other.
The producer's half of the conversation is `prefill_node/kv_server.py`, the consumer's
`decode_node/kv_client.py`; protobuf types stop there and here (`layout_to_pb`, `layout_from_pb`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import struct
from dataclasses import asdict

from google.protobuf.message import DecodeError, Message

from pdserve_core.kv.layout import KVLayout
from pdserve_proto.v1 import kv_transfer_pb2 as pb

PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 1 << 20
MAX_AUTH_BYTES = 256
"""Authentication messages are two 32-byte fields: nothing larger is read from an unknown peer."""
NONCE_BYTES = 32
_LENGTH = struct.Struct(">I")
_CONTEXT = b"pdserve-kv-v1"


class ProtocolError(ConnectionError):
    """The peer broke the protocol (bad frame, bad message, failed proof); close the link."""


class TransferError(Exception):
    """A pull that failed; `reason` is one of pdserve_core.kv.stats.FAILURE_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket or raise ConnectionError if the peer closes first."""
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("peer closed the connection mid-message")
        view = view[got:]


def encode_message(message: Message) -> bytes:
    payload = message.SerializeToString()
    return _LENGTH.pack(len(payload)) + payload


def send_message(sock: socket.socket, message: Message) -> None:
    sock.sendall(encode_message(message))


def recv_message(
    sock: socket.socket, message_type: type[Message], max_bytes: int = MAX_MESSAGE_BYTES
) -> Message:
    """One framed message; a length over `max_bytes` is refused before anything is allocated
    (messages that come before authentication are allowed only a few hundred bytes)."""
    header = bytearray(_LENGTH.size)
    recv_exact_into(sock, memoryview(header))
    (length,) = _LENGTH.unpack(header)
    if length > max_bytes:
        raise ProtocolError(f"control message of {length} bytes exceeds {max_bytes}")
    payload = bytearray(length)
    recv_exact_into(sock, memoryview(payload))
    return _parse(message_type, bytes(payload))


async def read_message(
    reader: asyncio.StreamReader, message_type: type[Message], max_bytes: int = MAX_MESSAGE_BYTES
) -> Message:
    """`recv_message` on an asyncio stream (the caller bounds the time)."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > max_bytes:
        raise ProtocolError(f"control message of {length} bytes exceeds {max_bytes}")
    return _parse(message_type, await reader.readexactly(length))


def _parse(message_type: type[Message], payload: bytes) -> Message:
    message = message_type()
    try:
        message.ParseFromString(payload)
    except DecodeError as error:
        raise ProtocolError(f"malformed {message_type.__name__}: {error}") from None
    return message


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC over both nonces, bound to the speaker's role so one side's proof never serves
    as the other's."""
    return hmac.new(secret, _CONTEXT + role + first + second, hashlib.sha256).digest()


def lease_token(
    secret: bytes,
    engine_id: str,
    request_id: str,
    block_ids: list[int],
    deadline: float,
    readers: int,
) -> bytes:
    """The producer scheduler's signature on a lease: the engine that holds it (vLLM draws a new
    id at every engine start, so a lease outlives no restart), request, blocks held, deadline,
    and how many completed pulls it allows."""
    blocks = ",".join(map(str, block_ids))
    body = f"{engine_id}|{request_id}|{blocks}|{deadline!r}|{readers}".encode()
    return hmac.new(secret, _CONTEXT + b"lease" + body, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(**asdict(layout))


def layout_from_pb(message: pb.KVLayout) -> KVLayout:
    return KVLayout(**{name: getattr(message, name) for name in KVLayout.__dataclass_fields__})
