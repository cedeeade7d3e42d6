"""Bounds on the connections the router's faces accept, whatever arrives on them.

HTTP (uvicorn): at most `max_connections` connections and requests in progress (uvicorn's
`limit_concurrency`; beyond it a new request gets 503 at once), and at most
`max_connections_per_client` connections from one client address (429, then closed, beyond);
a connection must send a request's whole head within `header_timeout_s` of connecting, or of
the request's first byte, or it is closed (uvicorn has no such bound: a client that opens
connections and never finishes their headers would keep them for ever); an idle keep-alive
connection is closed after `KEEP_ALIVE_S`. The body's bound is the app's
(`router.body_timeout_s`, router/faces/openai_http.py).

gRPC: at most `max_connections` calls at once, and `max_connections_per_client` from one
client address (RESOURCE_EXHAUSTED beyond; router/faces/grpc_api.py), a connection closed if its
handshake is not done within `GRPC_HANDSHAKE_S` or once idle for `GRPC_IDLE_S`, and keepalive
pings from clients limited to one a minute.

With `router.tls` both faces speak TLS only (and with its `client_ca_file`, only to clients
holding a certificate that CA signed).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import Counter
from typing import Any

from pdserve_core.tls import ServerFiles
from router.errors import Overloaded, error_body

KEEP_ALIVE_S = 5
GRPC_IDLE_S = 300
GRPC_HANDSHAKE_S = 10
"""A gRPC connection must finish its handshake (TLS, when on, and HTTP/2's) within this."""


class PerClient:
    """Connections (HTTP) or calls (gRPC) open at once per client address, bounded: one client
    cannot take every place under the total bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: Counter[str] = Counter()

    def take(self, client: str) -> bool:
        if self.open[client] >= self.limit:
            return False
        self.open[client] += 1
        return True

    def give(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]

    def refusal(self, client: str, what: str) -> Overloaded:
        return Overloaded(
            f"too many {what} at once from {client} "
            f"(router.max_connections_per_client: {self.limit})"
        )


def _refusal_bytes(error: Overloaded) -> bytes:
    body = json.dumps(error_body(error)).encode()
    head = (
        f"HTTP/1.1 {error.http_status} Too Many Requests\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _bounded_protocol(header_timeout_s: float, per_client: PerClient) -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Bounded(HttpToolsProtocol):
        """httptools' protocol, closing a connection whose request head is late, and answering
        429 to a client address that already holds its share of connections."""

        _head_timer: asyncio.TimerHandle | None = None
        _head_by = 0.0
        """When the request head must be in (the loop's clock)."""
        _client: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if isinstance(peer, tuple) else ""
            if not per_client.take(client):
                transport.write(_refusal_bytes(per_client.refusal(client, "connections")))
                transport.close()
                return
            self._client = client
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._client is not None:
                per_client.give(self._client)
                self._client = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            """The head is due `header_timeout_s` from now: an armed timer is moved (one timer,
            not two, for a connection's first request), else one is set."""
            self._head_by = self.loop.time() + header_timeout_s
            if self._head_timer is None:
                self._head_timer = self.loop.call_at(self._head_by, self._late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _late(self) -> None:
            if self.loop.time() < self._head_by:  # moved since it was set
                self._head_timer = self.loop.call_at(self._head_by, self._late)
                return
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return Bounded


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    max_connections: int,
    header_timeout_s: float,
    log_level: str = "warning",
    tls: ServerFiles | None = None,
    per_client: int | None = None,
) -> Any:
    import uvicorn

    secure: dict[str, Any] = {}
    if tls is not None:
        secure = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
        if tls.client_ca_file:
            secure.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=_bounded_protocol(header_timeout_s, PerClient(per_client or max_connections)),
        limit_concurrency=max_connections,
        timeout_keep_alive=KEEP_ALIVE_S,
        **secure,
    )


def grpc_options(max_request_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_connection_idle_ms", GRPC_IDLE_S * 1000),
        ("grpc.server_handshake_timeout_ms", GRPC_HANDSHAKE_S * 1000),
        ("grpc.http2.min_ping_interval_without_data_ms", 60_000),
        ("grpc.http2.max_ping_strikes", 2),
    ]
