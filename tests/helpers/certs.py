"""Certificates for TLS tests: a throwaway CA and certificates it signs (trustme), as PEM files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Certs:
    ca_file: str
    cert_file: str
    key_file: str


def issue(folder: Path, names: tuple[str, ...] = ("127.0.0.1",), ca=None) -> Certs:
    """A certificate for `names` (IP addresses or host names), signed by `ca` (a new CA when
    None), written under `folder`."""
    ca = ca or trustme.CA()
    folder.mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert(*names)
    files = Certs(str(folder / "ca.pem"), str(folder / "cert.pem"), str(folder / "key.pem"))
    ca.cert_pem.write_to_path(files.ca_file)
    cert.cert_chain_pems[0].write_to_path(files.cert_file)
    cert.private_key_pem.write_to_path(files.key_file)
    return files
