"""The decode node's side of a KV pull: one connection to a prefill node's KV server.

`KVClient.pull` connects (over mutual TLS when the cluster has certificates), proves the
cluster secret and checks the producer's proof, sends its layout (and any pairing fields the data
plane needs), asks for the leased blocks, receives their bytes straight into this engine's paged
cache through the data plane, and confirms. `KVClient.follow` is the same conversation for a
prefetch: it streams a running prefill's layers into host memory (staging.py). Every failure
becomes a `TransferError` with a reason from `pdserve_core.kv.stats.FAILURE_REASONS`; the whole pull
is bounded by `deadline`.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from contextlib import contextmanager

from decode_node.staging import StagedKV
from pdserve_core.kv.handle import KVHandle
from pdserve_core.kv.transport.plane import DataPlane
from pdserve_core.kv.wire import (
    PROTOCOL_VERSION,
    ProtocolError,
    TransferError,
    layout_to_pb,
    new_nonce,
    proof,
    recv_message,
    send_message,
    verify,
)
from pdserve_proto.v1 import kv_transfer_pb2 as pb

CONTROL_TIMEOUT_S = 10.0


class KVClient:
    def __init__(
        self, plane: DataPlane, secret: Callable[[], bytes], tls: ssl.SSLContext | None = None
    ) -> None:
        self.plane = plane
        self._secret = secret
        self._tls = tls
        """Mutual TLS to every producer (pdserve_core/tls.py), or None: plain TCP."""

    def pull(
        self,
        handle: KVHandle,
        remote_blocks: list[int],
        local_blocks: list[int],
        tp_rank: int,
        deadline: float,
    ) -> int:
        """Copy `remote_blocks` of the producer into `local_blocks` here; returns bytes moved.
        With no blocks, tells the producer it may free the handle's blocks now."""
        if len(remote_blocks) != len(local_blocks):
            raise TransferError("bad_handle", "remote and local block counts differ")
        if tp_rank >= len(handle.ports):
            raise TransferError(
                "bad_handle", f"handle has no port for tensor-parallel rank {tp_rank}"
            )
        peer = (handle.host, handle.ports[tp_rank])
        with self._conversation(peer, deadline) as (conn, link):
            send_message(
                conn,
                pb.PullRequest(
                    request_id=handle.request_id,
                    block_ids=remote_blocks,
                    held_block_ids=handle.block_ids,
                    lease_deadline=handle.lease_deadline,
                    lease_token=handle.lease_token,
                    lease_readers=handle.readers,
                ),
            )
            reply = recv_message(conn, pb.PullReply)
            if reply.status != pb.PullReply.OK:
                reason = pb.PullReply.Status.Name(reply.status).lower()
                raise TransferError(reason, reply.message)
            expected = self.plane.payload_bytes(len(local_blocks))
            if reply.total_bytes != expected:
                raise TransferError(
                    "handshake", f"producer sends {reply.total_bytes} B, expected {expected}"
                )
            self.plane.recv_blocks(conn, local_blocks, deadline, link)
            send_message(conn, pb.PullDone(ok=True, received_bytes=expected))
            return expected

    def follow(self, peer: tuple[str, int], staged: StagedKV, deadline: float) -> tuple[int, float]:
        """Prefetch: receive the prefill `staged.key` names into `staged` while it runs (see
        prefill_node/progress.py); returns the bytes received and the seconds spent receiving
        them (not waiting for the prefill). Ends with `staged` complete, or raises
        `TransferError`."""
        with self._conversation(peer, deadline) as (conn, _):
            staged.attach(conn)
            ask = pb.PullRequest(follow_key=staged.key, follow_max_blocks=staged.capacity)
            send_message(conn, ask)
            received, receiving = 0, 0.0
            while True:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                piece = recv_message(conn, pb.KVPiece)
                if piece.error:
                    raise TransferError("unknown_request", f"prefetch refused: {piece.error}")
                if piece.done:
                    staged.complete(piece.request_id, list(piece.block_ids))
                    return received, receiving
                into = staged.room(piece.layer, piece.first_block, piece.num_blocks)
                started = time.monotonic()
                self.plane.recv_layer(conn, into, deadline)
                receiving += time.monotonic() - started
                staged.received(piece.layer, piece.first_block, piece.num_blocks)
                received += len(into)

    @contextmanager
    def _conversation(self, peer: tuple[str, int], deadline: float):
        """A connection to `peer` past authentication and the layout handshake: (socket, data
        link); every failure inside becomes a `TransferError`."""
        conn = _connect(peer, deadline, self._tls)
        try:
            conn.settimeout(max(0.01, min(CONTROL_TIMEOUT_S, deadline - time.monotonic())))
            self._prove_ourselves(conn)
            local_host = conn.getsockname()[0]
            pairing = self.plane.consumer_pairing(peer, local_host)
            layout = layout_to_pb(self.plane.layout)
            send_message(conn, pb.Handshake(layout=layout, **pairing))
            result = recv_message(conn, pb.HandshakeResult)
            if not result.ok:
                raise TransferError("handshake", result.message)
            yield conn, self.plane.consumer_link(peer, pairing, local_host, deadline)
        except TimeoutError:
            raise TransferError(
                "timeout", f"KV pull from {peer[0]}:{peer[1]} passed its deadline"
            ) from None
        except ProtocolError as error:
            raise TransferError("handshake", str(error)) from None
        except (ConnectionError, OSError) as error:
            raise TransferError(
                "connection_reset", f"KV pull from {peer[0]}:{peer[1]}: {error}"
            ) from None
        finally:
            conn.close()

    def _prove_ourselves(self, conn: socket.socket) -> None:
        challenge = recv_message(conn, pb.Challenge)
        if challenge.protocol_version != PROTOCOL_VERSION:
            raise TransferError(
                "handshake", f"producer speaks protocol {challenge.protocol_version}"
            )
        nonce = new_nonce()
        secret = self._secret()
        send_message(
            conn,
            pb.AuthResponse(nonce=nonce, mac=proof(secret, b"consumer", challenge.nonce, nonce)),
        )
        result = recv_message(conn, pb.AuthResult)
        if not result.ok:
            raise TransferError("auth", f"producer refused us: {result.message}")
        if not verify(proof(secret, b"producer", nonce, challenge.nonce), result.mac):
            raise TransferError("auth", "producer failed to prove the cluster secret")


def _connect(peer: tuple[str, int], deadline: float, tls: ssl.SSLContext | None) -> socket.socket:
    try:
        conn = socket.create_connection(peer, timeout=max(0.01, deadline - time.monotonic()))
    except OSError as error:
        raise TransferError(
            "connect", f"cannot reach KV server {peer[0]}:{peer[1]}: {error}"
        ) from None
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        return conn
    try:
        return tls.wrap_socket(conn, server_hostname=peer[0])
    except ssl.SSLError as error:
        conn.close()
        raise TransferError("auth", f"TLS with KV server {peer[0]}:{peer[1]}: {error}") from None
    except OSError as error:
        conn.close()
        raise TransferError(
            "connect", f"TLS handshake with KV server {peer[0]}:{peer[1]}: {error}"
        ) from None
