"""The connector's settings, read once from vLLM's `kv_connector_extra_config`.

This is the one place the KV defaults are written: `pdserve_core.config.KVTransferConfig` takes its
defaults from here, and a plain vLLM server loading the connector gets the same ones.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve_core.kv.transport import DEFAULT as DEFAULT_TRANSPORT
from pdserve_core.kv.transport import PLANES
from pdserve_core.tls import client_context, server_context

SECRET_ENV = "PDSERVE_KV_SECRET"
TRANSPORTS = tuple(PLANES)
LOADS = ("sync", "async")
UCX_NAME = re.compile(r"(UCX_)?[A-Z][A-Z0-9_]*")
UCX_MESSAGE_TLS = frozenset(
    ("all", "tcp", "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5",
     "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5")
)  # fmt: skip
"""UCX transports that carry NIXL's messages: active messages with peer-failure handling. The
others move bytes only (cuda_ipc, cuda_copy, cma) or cannot report a dead peer (sm, posix,
sysv, self); a TLS list of those alone fails NIXL's UCX backend at start (seen on an H200:
"no active messages transport")."""


def check_ucx(ucx: dict) -> None:
    """Refuse UCX settings the nixl plane cannot start with: names that are not UCX variables,
    and a positive `TLS` list with no transport for NIXL's messages."""
    for name, value in ucx.items():
        if not UCX_NAME.fullmatch(str(name)) or not isinstance(value, str | int):
            raise ValueError(
                f"ucx: {name!r}={value!r}: not a UCX variable name (e.g. TLS, NET_DEVICES) and "
                "its value"
            )
        if str(name).removeprefix("UCX_") != "TLS" or str(value).startswith("^"):
            continue
        chosen = {part.strip().split(":")[0] for part in str(value).split(",")}
        if not chosen & UCX_MESSAGE_TLS:
            raise ValueError(
                f"ucx: TLS={value!r} has no transport NIXL can send its messages over (tcp, rc, "
                f"dc, ud or ib) and its UCX backend would not start: add one, e.g. "
                f"'{value},tcp'"
            )


@dataclass(frozen=True)
class ConnectorSettings:
    host: str = "127.0.0.1"
    """Address the producer's KV server binds to."""
    advertise_host: str | None = None
    """Address consumers are told to pull from (default: `host`)."""
    port: int = 0
    """Base port of the KV servers (rank r listens on port + r); 0 picks free ports."""
    transport: str = DEFAULT_TRANSPORT
    """Data plane for block bytes: "tcp" (sockets, any host), "nccl" (GPU to GPU), "gloo" (the
    same collective plane as nccl, between CPU caches) or "nixl" (NIXL's UCX backend: RDMA,
    NVLink, shared memory or TCP, whichever UCX finds)."""
    ucx: dict[str, str] | None = None
    """The nixl plane's UCX settings, by variable name without the `UCX_` prefix (e.g.
    {"TLS": "rc,cuda_copy,cuda_ipc", "NET_DEVICES": "mlx5_0:1"}); set in each engine's
    environment before UCX starts, over what it inherited."""
    lease_s: float = 30.0
    """How long the producer keeps a finished prefill's blocks for a consumer."""
    timeout_s: float = 10.0
    """Deadline of one pull."""
    secret: str | None = field(default=None, repr=False)
    secret_file: str | None = None
    """Read the secret from this file at each connection (lets operators rotate it)."""
    send_rate_limit_bytes_per_s: float | None = None
    """Cap a producer's sending rate per transfer (None: as fast as the link goes)."""
    load: str = "sync"
    """Consumer: "sync" loads a request's KV at the start of the step that schedules it (it
    decodes in that same step); "async" loads it on a thread while the request waits outside the
    batch (scheduled one or two steps after the load ends; the step is never held up)."""
    prefetch_mib: int = 512
    """Consumer: host memory (MiB) for KV streamed from prefills while they run, when the router
    names this node as the decode node before the prefill ends (the TCP plane); 0: pull only
    after the prefill."""
    peer_hosts: tuple[str, ...] | None = None
    """Consumer: the hosts a handle may send it to pull from (None: any). A handle naming another
    host fails its request as a bad handle."""
    tls_cert_file: str | None = None
    """With `tls_key_file` and `tls_ca_file`: every KV connection is mutual TLS. This engine
    presents this certificate (PEM) to its peers, as a server and as a client."""
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    """The cluster CA: a peer whose certificate it did not sign is refused."""
    tls_check_hostname: bool = True
    """Consumer: the producer's certificate must name the address pulled from (an IP address in
    its subjectAltName). False: any certificate the CA signed will do (one certificate for the
    whole cluster)."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(known)}"
            )
        if extra.get("peer_hosts") is not None:
            extra["peer_hosts"] = tuple(str(host) for host in extra["peer_hosts"])
        settings = cls(**extra)
        check_ucx(settings.ucx or {})
        if settings.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {settings.transport!r}")
        if settings.load not in LOADS:
            raise ValueError(f"load must be one of {LOADS}, not {settings.load!r}")
        if settings.prefetch_mib < 0:
            raise ValueError("prefetch_mib must be 0 or more")
        if settings.lease_s <= 0 or settings.timeout_s <= 0:
            raise ValueError("lease_s and timeout_s must be positive")
        if not (0 <= int(settings.port) <= 65535):
            raise ValueError(f"port {settings.port} is out of range")
        settings.read_secret()  # fail at start, not at the first pull
        settings.server_tls()
        settings.client_tls()
        return settings

    def to_extra(self) -> dict[str, Any]:
        """The `kv_connector_extra_config` dict that gives back these settings."""
        extra = {name: value for name, value in asdict(self).items() if value is not None}
        if "peer_hosts" in extra:
            extra["peer_hosts"] = list(extra["peer_hosts"])
        return extra

    def read_secret(self) -> bytes:
        if self.secret_file:
            try:
                value = Path(self.secret_file).read_text().strip()
            except OSError as error:
                raise ValueError(f"cannot read secret_file {self.secret_file}: {error}") from None
        else:
            value = self.secret or os.environ.get(SECRET_ENV, "")
        if not value:
            raise ValueError(
                f"the KV connector needs a cluster secret: set 'secret' or 'secret_file' in "
                f"kv_connector_extra_config, or ${SECRET_ENV}"
            )
        return value.encode()

    def _tls_files(self) -> tuple[str, str, str] | None:
        files = (self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if not any(files):
            return None
        if not all(files):
            raise ValueError("KV TLS needs tls_cert_file, tls_key_file and tls_ca_file together")
        return files  # type: ignore[return-value]

    def server_tls(self) -> ssl.SSLContext | None:
        """The KV server's context (peers must present a certificate the CA signed), or None."""
        files = self._tls_files()
        return None if files is None else server_context(*files)

    def client_tls(self) -> ssl.SSLContext | None:
        """The KV client's context (it presents this engine's certificate), or None."""
        files = self._tls_files()
        if files is None:
            return None
        cert, key, ca = files
        return client_context(ca, cert, key, self.tls_check_hostname)

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host


DEFAULTS = ConnectorSettings()
