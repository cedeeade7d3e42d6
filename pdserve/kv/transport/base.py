"""The KV transport interface: one control conversation, pluggable ways to move the bytes.

Both transports speak the same control protocol over a TCP connection (framing, mutual HMAC
authentication, layout handshake, pull request, reply, done; see kv_transfer.proto). They differ
only in how block bytes travel after an OK reply, which subclasses provide:

- producer side (prefill worker): `_send_blocks(conn, block_ids, deadline, link)`;
- consumer side (decode worker): `_recv_blocks(conn, block_ids, deadline, link)`;
- optional per-peer pairing: `_consumer_pairing` adds Handshake fields, `_consumer_link` and
  `_producer_link` return the data link both sides then use (the NCCL communicator).

A run is a contiguous tensor slice: consecutive block ids of one layer, moved as one piece.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from pdserve.kv.handle import KVHandle
from pdserve.kv.layout import mismatch
from pdserve.kv.lease import ClaimError, ProducerTable
from pdserve.kv.stats import TransferStats
from pdserve.kv.wire import (
    PROTOCOL_VERSION,
    ProtocolError,
    lease_token,
    new_nonce,
    proof,
    recv_message,
    send_message,
    verify,
)
from pdserve_proto.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

CLAIM_WAIT_S = 5.0
"""How long a pull may wait for the producer's worker to learn of the request it asks for."""
CONTROL_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class TransferError(Exception):
    """A pull that failed; `reason` is one of pdserve.kv.stats.FAILURE_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive block ids as (first, count) runs: [3,4,5,9] -> [(3,3),(9,1)]."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


class KVTransport(ABC):
    name = "base"

    def __init__(
        self,
        layout: pb.KVLayout,
        kv_caches: dict[str, Any],
        secret: Callable[[], bytes],
        stats: TransferStats,
        host: str = "127.0.0.1",
        port: int = 0,
        rate_limit: float | None = None,
    ) -> None:
        self.layout = layout
        self.rate_limit = rate_limit
        self.layers = [kv_caches[name] for name in sorted(kv_caches)]
        self._secret = secret
        self.stats = stats
        self.host, self.port = host, port
        self._server: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = threading.Event()
        self._active: set[socket.socket] = set()
        self._active_lock = threading.Lock()

    # ---- what subclasses provide -------------------------------------------------------------

    @abstractmethod
    def _send_blocks(
        self, conn: socket.socket, blocks: list[int], deadline: float, link: Any
    ) -> None:
        """Producer: move these blocks of every layer, layer by layer, to the consumer."""

    @abstractmethod
    def _recv_blocks(
        self, conn: socket.socket, blocks: list[int], deadline: float, link: Any
    ) -> None:
        """Consumer: fill these blocks of every layer, in the same order, with the bytes."""

    def _consumer_pairing(self, peer: tuple[str, int]) -> dict[str, bytes]:
        """Consumer: extra Handshake fields for this peer (default: none)."""
        return {}

    def _consumer_link(self, peer: tuple[str, int], pairing: dict[str, bytes]) -> Any:
        """Consumer, after an accepted handshake: the data link to this peer (default: none)."""
        return None

    def _producer_link(self, handshake: pb.Handshake) -> Any:
        """Producer, after an accepted handshake: the data link to this consumer (default: none)."""
        return None

    # ---- shared ---------------------------------------------------------------------------------

    def runs(self, block_ids: list[int]) -> Iterator[Any]:
        """Tensor slices to move, layer by layer (sorted layer names), runs in block-id order."""
        grouped = block_runs(block_ids)
        for layer in self.layers:
            for first, count in grouped:
                yield layer[first : first + count]

    def pace(self, started: float, sent: int) -> None:
        """Sleep so that `sent` bytes since `started` stay under the rate limit, if any."""
        if self.rate_limit:
            ahead = sent / self.rate_limit - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)

    def payload_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.layout.block_bytes * self.layout.num_layers

    # ---- producer ------------------------------------------------------------------------------

    def start_server(self, table: ProducerTable) -> int:
        """Listen for pulls on host:port (0 picks a port); returns the bound port."""
        self._table = table
        self._server = socket.create_server((self.host, self.port), backlog=MAX_CONNECTIONS)
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="pdserve-kv-server", daemon=True).start()
        logger.info("KV server (%s) listening on %s:%d", self.name, self.host, self.port)
        return self.port

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._server.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                logger.warning("KV server: too many connections; refusing %s", peer)
                conn.close()
                continue
            threading.Thread(
                target=self._serve_connection,
                args=(conn, peer),
                name="pdserve-kv-conn",
                daemon=True,
            ).start()

    def _serve_connection(self, conn: socket.socket, peer: Any) -> None:
        with self._active_lock:
            self._active.add(conn)
        try:
            conn.settimeout(CONTROL_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._authenticate_peer(conn)
            handshake = recv_message(conn, pb.Handshake)
            problem = mismatch(self.layout, handshake.layout)
            send_message(conn, pb.HandshakeResult(ok=problem is None, message=problem or ""))
            if problem:
                raise ProtocolError(problem)
            link = self._producer_link(handshake)
            self._serve_pull(conn, recv_message(conn, pb.PullRequest), link)
        except (ProtocolError, ConnectionError, TimeoutError, OSError) as error:
            logger.warning("KV server: closed connection from %s: %s", peer, error)
        finally:
            with self._active_lock:
                self._active.discard(conn)
            conn.close()
            self._slots.release()

    def _authenticate_peer(self, conn: socket.socket) -> None:
        nonce = new_nonce()
        send_message(conn, pb.Challenge(protocol_version=PROTOCOL_VERSION, nonce=nonce))
        answer = recv_message(conn, pb.AuthResponse)
        secret = self._secret()
        if not verify(proof(secret, b"consumer", nonce, answer.nonce), answer.mac):
            send_message(conn, pb.AuthResult(ok=False, message="authentication failed"))
            raise ProtocolError("peer failed authentication (wrong cluster secret)")
        mac = proof(secret, b"producer", answer.nonce, nonce)
        send_message(conn, pb.AuthResult(ok=True, mac=mac))

    def _serve_pull(self, conn: socket.socket, request: pb.PullRequest, link: Any) -> None:
        blocks = list(request.block_ids)
        held = list(request.held_block_ids)
        token = lease_token(self._secret(), request.request_id, held, request.lease_deadline)
        grant = (held, request.lease_deadline) if verify(token, request.lease_token) else None
        try:
            self._table.claim(request.request_id, blocks, CLAIM_WAIT_S, grant)
        except ClaimError as refused:
            status = {
                "unknown_request": pb.PullReply.UNKNOWN_REQUEST,
                "lease_expired": pb.PullReply.LEASE_EXPIRED,
                "bad_blocks": pb.PullReply.BAD_BLOCKS,
            }[refused.reason]
            send_message(conn, pb.PullReply(status=status, message=str(refused)))
            logger.warning("KV server: refused pull of %s: %s", request.request_id, refused)
            return
        completed = False
        started = time.monotonic()
        total = self.payload_bytes(len(blocks))
        try:
            send_message(
                conn,
                pb.PullReply(
                    status=pb.PullReply.OK,
                    total_bytes=total,
                    num_layers=self.layout.num_layers,
                    num_blocks=len(blocks),
                ),
            )
            self._send_blocks(conn, blocks, time.monotonic() + CONTROL_TIMEOUT_S * 6, link)
            completed = recv_message(conn, pb.PullDone).ok
            if completed:
                self.stats.transfer("sent", total, time.monotonic() - started)
        finally:
            self._table.release(request.request_id, completed)

    # ---- consumer ------------------------------------------------------------------------------

    def pull(
        self,
        handle: KVHandle,
        remote_blocks: list[int],
        local_blocks: list[int],
        tp_rank: int,
        deadline: float,
    ) -> int:
        """Copy `remote_blocks` of the producer into `local_blocks` here; returns bytes moved."""
        if len(remote_blocks) != len(local_blocks):
            raise TransferError("bad_handle", "remote and local block counts differ")
        if tp_rank >= len(handle.ports):
            raise TransferError(
                "bad_handle", f"handle has no port for tensor-parallel rank {tp_rank}"
            )
        peer = (handle.host, handle.ports[tp_rank])
        conn = self._connect(peer, deadline)
        try:
            conn.settimeout(max(0.01, min(CONTROL_TIMEOUT_S, deadline - time.monotonic())))
            self._prove_ourselves(conn)
            pairing = self._consumer_pairing(peer)
            send_message(conn, pb.Handshake(layout=self.layout, **pairing))
            result = recv_message(conn, pb.HandshakeResult)
            if not result.ok:
                raise TransferError("handshake", result.message)
            link = self._consumer_link(peer, pairing)
            send_message(
                conn,
                pb.PullRequest(
                    request_id=handle.request_id,
                    block_ids=remote_blocks,
                    held_block_ids=handle.block_ids,
                    lease_deadline=handle.lease_deadline,
                    lease_token=handle.lease_token,
                ),
            )
            reply = recv_message(conn, pb.PullReply)
            if reply.status != pb.PullReply.OK:
                reason = pb.PullReply.Status.Name(reply.status).lower()
                raise TransferError(reason, reply.message)
            expected = self.payload_bytes(len(local_blocks))
            if reply.total_bytes != expected:
                raise TransferError(
                    "handshake", f"producer sends {reply.total_bytes} B, expected {expected}"
                )
            self._recv_blocks(conn, local_blocks, deadline, link)
            send_message(conn, pb.PullDone(ok=True, received_bytes=expected))
            return expected
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

    def _connect(self, peer: tuple[str, int], deadline: float) -> socket.socket:
        try:
            conn = socket.create_connection(peer, timeout=max(0.01, deadline - time.monotonic()))
        except OSError as error:
            raise TransferError(
                "connect", f"cannot reach KV server {peer[0]}:{peer[1]}: {error}"
            ) from None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

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

    def close(self) -> None:
        """Stop serving: no new connections, and transfers in progress are cut."""
        self._closed.set()
        if self._server is not None:
            self._server.close()
        with self._active_lock:
            for conn in self._active:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
