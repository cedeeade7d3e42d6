"""TLS contexts for pdserve's three planes: the router's HTTP face, its gRPC face, and the KV
TCP plane between prefill and decode nodes.

TLS is off by default: on one host every byte stays on loopback. On a cluster the KV plane
carries prompts' KV caches between hosts and the faces carry prompts and completions, so each
takes a certificate and key from the config; the KV plane is mutual (both ends present a
certificate signed by the cluster's CA and check the other's). Files are read once, when the
server or engine starts, and a missing or unreadable file fails that start with its path.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2


class TLSFilesError(ValueError):
    """A certificate, key or CA file that cannot be loaded."""


@dataclass(frozen=True)
class ServerFiles:
    """A TLS server's PEM files: its certificate and key, and with `client_ca_file` the CA whose
    certificates clients must present (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


def _load(what: str, paths: str, load) -> None:
    try:
        load()
    except (OSError, ssl.SSLError) as error:
        raise TLSFilesError(f"cannot load the TLS {what} ({paths}): {error}") from None


def server_context(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> ssl.SSLContext:
    """A server's context: presents `cert_file`; with `client_ca_file`, a client must present a
    certificate signed by that CA (mutual TLS)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = MINIMUM_VERSION
    _load(
        "certificate and key",
        f"{cert_file}, {key_file}",
        lambda: context.load_cert_chain(cert_file, key_file),
    )
    if client_ca_file:
        _load("client CA", client_ca_file, lambda: context.load_verify_locations(client_ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(
    ca_file: str,
    cert_file: str | None = None,
    key_file: str | None = None,
    check_hostname: bool = True,
) -> ssl.SSLContext:
    """A client's context: trusts servers signed by `ca_file` (and, with `check_hostname`, only
    for the address it dialled); presents `cert_file` when given."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.minimum_version = MINIMUM_VERSION
    _load("CA", ca_file, lambda: context.load_verify_locations(ca_file))
    context.check_hostname = check_hostname
    if cert_file:
        _load(
            "certificate and key",
            f"{cert_file}, {key_file}",
            lambda: context.load_cert_chain(cert_file, key_file),
        )
    return context


def read_bytes(path: str, what: str) -> bytes:
    """A PEM file's bytes (gRPC takes them, not paths)."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise TLSFilesError(f"cannot read the TLS {what} {path}: {error}") from None
