"""The prefill node's KV server: hands leased blocks to decode workers that prove the secret.

One connection serves one pull, in the order of proto/pdserve/v1/kv_transfer.proto:
1. Challenge → the consumer's HMAC answer (wrong secret: refused, closed, nothing sent) → our
   own proof back (mutual authentication).
2. The consumer's KV layout; the first field that differs ends the conversation.
3. Its PullRequest: the lease table is asked for the blocks (`ProducerTable.claim`); a pull that
   arrives before the worker heard of the request carries the scheduler's signed lease.
4. PullReply with the byte count, then the bytes through the data plane (TCP, a collective, or
   NIXL's READ of what the plane offers), then the
   consumer's PullDone: only a completed pull lets the blocks go.
   A PullRequest with a `follow_key` is a prefetch instead (progress.py): no lease is claimed;
   each layer of the running prefill's blocks goes as a KVPiece and its bytes as soon as the
   forward wrote it, and a last KVPiece says done (with the block ids) or why not.
Every connection has deadlines: `AUTH_DEADLINE_S` to prove the secret (reading nothing larger
than an answer needs), `CONTROL_DEADLINE_S` for the whole conversation before the bytes; a peer
that sends slowly loses its connection. Until it has proven the secret a connection holds one of
`MAX_UNPROVEN` places, at most `MAX_UNPROVEN_PER_PEER` of them per peer address, so one host that
can reach the port cannot take every place by connecting and saying nothing; a proven connection
then holds one of `MAX_PULLS` pull slots (a prefetch, one of `MAX_FOLLOWS` of its own).
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve_core.kv.layout import mismatch
from pdserve_core.kv.stats import TransferStats
from pdserve_core.kv.transport.plane import DataPlane
from pdserve_core.kv.wire import (
    MAX_AUTH_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    layout_from_pb,
    lease_token,
    new_nonce,
    proof,
    recv_message,
    send_message,
    verify,
)
from pdserve_proto.v1 import kv_transfer_pb2 as pb
from prefill_node.leases import ClaimError, ProducerTable
from prefill_node.progress import Piece, WriteProgress

logger = logging.getLogger(__name__)

CLAIM_WAIT_S = 5.0
"""How long a pull may wait for the producer's worker to learn of the request it asks for."""
AUTH_DEADLINE_S = 3.0
CONTROL_DEADLINE_S = 10.0
SEND_TIMEOUT_S = 60.0
FOLLOW_S = 120.0
"""The longest a prefetch follows one prefill (its queueing and its compute together)."""
MAX_PULLS = 64
"""Pulls served at once (connections past authentication)."""
MAX_FOLLOWS = 64
"""Prefetches served at once, apart from the pulls: a burst of queued prefills, each followed
while it waits, must not leave the finished ones' pulls without a slot."""
MAX_UNPROVEN = 128
"""Connections that have not yet proven the secret, all peers together."""
MAX_UNPROVEN_PER_PEER = 32
"""... and from one peer address: above what one host's decode workers open at once (4 pull
threads per worker, 8 workers)."""
REFUSAL_LOG_EVERY_S = 10.0

_REFUSAL = {
    "unknown_request": pb.PullReply.UNKNOWN_REQUEST,
    "lease_expired": pb.PullReply.LEASE_EXPIRED,
    "bad_blocks": pb.PullReply.BAD_BLOCKS,
}


def _within(conn: socket.socket, deadline: float) -> None:
    """The socket's timeout: what is left until `deadline` (a slow peer runs out of it)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the peer took too long")
    conn.settimeout(left)


class KVServer:
    def __init__(
        self,
        plane: DataPlane,
        table: ProducerTable,
        secret: Callable[[], bytes],
        stats: TransferStats,
        host: str = "127.0.0.1",
        port: int = 0,
        engine_id: str = "",
        tls: ssl.SSLContext | None = None,
        progress: WriteProgress | None = None,
    ) -> None:
        self.plane, self.table, self.stats = plane, table, stats
        self.progress = progress
        """Running prefills that decode nodes may follow (None: prefetches are refused)."""
        self._tls = tls
        """Mutual TLS on every connection (pdserve_core/tls.py), or None: plain TCP."""
        self.engine_id = engine_id
        """The producer engine's id: leases signed for another engine (or an earlier start of
        this one) are not honoured."""
        self._secret = secret
        self.host, self.port = host, port
        self._server: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_PULLS)
        self._follows = threading.BoundedSemaphore(MAX_FOLLOWS)
        self._unproven: dict[str, int] = {}
        """Peer address -> its connections that have not proven the secret yet."""
        self._refused: dict[str, int] = {}
        """Peer address -> connections refused since its last log line."""
        self._refusal_logged = 0.0
        self._closed = threading.Event()
        self._active: set[socket.socket] = set()
        self._active_lock = threading.Lock()

    def start(self) -> int:
        """Listen for pulls on host:port (0 picks a port); returns the bound port."""
        self._server = socket.create_server((self.host, self.port), backlog=MAX_PULLS)
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="pdserve-kv-server", daemon=True).start()
        logger.info("KV server (%s) listening on %s:%d", self.plane.name, self.host, self.port)
        return self.port

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

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._server.accept()
            except OSError:
                return
            address = peer[0]
            with self._active_lock:
                crowded = (
                    sum(self._unproven.values()) >= MAX_UNPROVEN
                    or self._unproven.get(address, 0) >= MAX_UNPROVEN_PER_PEER
                )
                if not crowded:
                    self._unproven[address] = self._unproven.get(address, 0) + 1
            if crowded:
                self._refuse(conn, address, "unproven connections")
                continue
            threading.Thread(
                target=self._serve_connection,
                args=(conn, peer),
                name="pdserve-kv-conn",
                daemon=True,
            ).start()

    def _refuse(self, conn: socket.socket, address: str, why: str) -> None:
        """Close at once; one log line per `REFUSAL_LOG_EVERY_S` however fast a flood comes."""
        conn.close()
        now = time.monotonic()
        with self._active_lock:
            self._refused[address] = self._refused.get(address, 0) + 1
            if now - self._refusal_logged < REFUSAL_LOG_EVERY_S:
                return
            refused, self._refused, self._refusal_logged = self._refused, {}, now
        logger.warning("KV server: too many %s; refused %s", why, refused)

    def _proven(self, address: str) -> None:
        with self._active_lock:
            left = self._unproven.pop(address) - 1
            if left:
                self._unproven[address] = left

    def _serve_connection(self, conn: socket.socket, peer: Any) -> None:
        with self._active_lock:
            self._active.add(conn)
        address, unproven, slot = peer[0], True, False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            started = time.monotonic()
            _within(conn, started + AUTH_DEADLINE_S)
            if self._tls is not None:
                conn = self._secure(conn)
            self._authenticate_peer(conn, started + AUTH_DEADLINE_S)
            self._proven(address)
            unproven = False
            slot = self._slots.acquire(blocking=False)
            if not slot:
                self._refuse(conn, address, "pulls at once")
                return
            deadline = started + CONTROL_DEADLINE_S
            _within(conn, deadline)
            handshake = recv_message(conn, pb.Handshake)
            problem = mismatch(self.plane.layout, layout_from_pb(handshake.layout))
            send_message(conn, pb.HandshakeResult(ok=problem is None, message=problem or ""))
            if problem:
                raise ProtocolError(problem)
            pairing = {f.name: value for f, value in handshake.ListFields() if f.name != "layout"}
            link = self.plane.producer_link(pairing, conn.getsockname()[0], deadline)
            _within(conn, deadline)
            request = recv_message(conn, pb.PullRequest)
            if request.follow_key:  # a prefetch waits for its prefill: never on a pull's slot
                self._slots.release()
                slot = False
                if not self._follows.acquire(blocking=False):
                    send_message(conn, pb.KVPiece(error="too many prefetches at once"))
                    return
                try:
                    self._serve_follow(conn, request)
                finally:
                    self._follows.release()
            else:
                self._serve_pull(conn, request, link)
        except (ProtocolError, ConnectionError, TimeoutError, OSError) as error:
            logger.warning("KV server: closed connection from %s: %s", peer, error)
        finally:
            with self._active_lock:
                self._active.discard(conn)
            conn.close()
            if unproven:
                self._proven(address)
            if slot:
                self._slots.release()

    def _secure(self, conn: socket.socket) -> socket.socket:
        """The TLS handshake, under the authentication deadline; the wrapped socket replaces the
        plain one (close() then cuts it)."""
        with self._active_lock:
            self._active.discard(conn)
        secured = self._tls.wrap_socket(conn, server_side=True)
        with self._active_lock:
            self._active.add(secured)
        return secured

    def _authenticate_peer(self, conn: socket.socket, deadline: float) -> None:
        nonce = new_nonce()
        send_message(conn, pb.Challenge(protocol_version=PROTOCOL_VERSION, nonce=nonce))
        _within(conn, deadline)
        answer = recv_message(conn, pb.AuthResponse, MAX_AUTH_BYTES)
        secret = self._secret()
        if not verify(proof(secret, b"consumer", nonce, answer.nonce), answer.mac):
            send_message(conn, pb.AuthResult(ok=False, message="authentication failed"))
            raise ProtocolError("peer failed authentication (wrong cluster secret)")
        mac = proof(secret, b"producer", answer.nonce, nonce)
        send_message(conn, pb.AuthResult(ok=True, mac=mac))

    def _serve_pull(self, conn: socket.socket, request: pb.PullRequest, link: Any) -> None:
        blocks = list(request.block_ids)
        held = list(request.held_block_ids)
        readers = max(1, request.lease_readers)
        token = lease_token(
            self._secret(),
            self.engine_id,
            request.request_id,
            held,
            request.lease_deadline,
            readers,
        )
        signed = verify(token, request.lease_token)
        grant = (held, request.lease_deadline, readers) if signed else None
        try:
            self.table.claim(request.request_id, blocks, CLAIM_WAIT_S, grant)
        except ClaimError as refused:
            reply = pb.PullReply(status=_REFUSAL[refused.reason], message=str(refused))
            send_message(conn, reply)
            logger.warning("KV server: refused pull of %s: %s", request.request_id, refused)
            return
        completed = False
        started = time.monotonic()
        total = self.plane.payload_bytes(len(blocks))
        try:
            send_message(
                conn,
                pb.PullReply(
                    status=pb.PullReply.OK,
                    total_bytes=total,
                    num_layers=self.plane.layout.num_layers,
                    num_blocks=len(blocks),
                ),
            )
            self.plane.send_blocks(conn, blocks, time.monotonic() + SEND_TIMEOUT_S, link)
            completed = recv_message(conn, pb.PullDone).ok
            if completed:
                self.stats.transfer("sent", total, time.monotonic() - started)
        finally:
            self.table.release(request.request_id, completed)

    def _serve_follow(self, conn: socket.socket, request: pb.PullRequest) -> None:
        """Stream a running prefill's pieces as they are written (a prefetch; see progress.py)."""
        if self.progress is None or not self.plane.follows:
            why = f"this producer ({self.plane.name} plane) cannot be followed"
            send_message(conn, pb.KVPiece(error=why))
            return
        started = time.monotonic()
        deadline, sent = started + FOLLOW_S, 0
        limit = request.follow_max_blocks

        def gone() -> bool:  # the consumer sends nothing while it follows: anything is its end
            return self._closed.is_set() or bool(select.select([conn], [], [], 0)[0])

        for item in self.progress.follow(request.follow_key, deadline, gone):
            if not isinstance(item, Piece):
                if item.error:
                    send_message(conn, pb.KVPiece(error=item.error))
                    return
                done = pb.KVPiece(done=True, request_id=item.request_id, block_ids=item.block_ids)
                send_message(conn, done)
                self.stats.transfer("sent", sent, time.monotonic() - started)
                return
            if item.first_block + len(item.block_ids) > limit:
                send_message(conn, pb.KVPiece(error=f"the prompt holds more than {limit} blocks"))
                return
            if item.ready is not None:
                item.ready.synchronize()
            _within(conn, deadline)
            piece = pb.KVPiece(
                layer=item.layer, first_block=item.first_block, num_blocks=len(item.block_ids)
            )
            send_message(conn, piece)
            self.plane.send_layer(conn, item.layer, list(item.block_ids), deadline)
            sent += len(item.block_ids) * self.plane.layout.block_bytes
            self.plane.pace(started, sent)
