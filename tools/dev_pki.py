"""Throwaway certificates for tests and tools (trustme, a dev dependency): a CA file and a certificate
for localhost, usable as both server and client certificate, written as the files a Secret mounts."""
from __future__ import annotations

from pathlib import Path

import trustme

from specmesh.tls import ChannelTLS

HOSTS = ("localhost", "127.0.0.1", "::1")


def write_pki(folder: Path, ca: trustme.CA | None = None, name: str = "tier") -> ChannelTLS:
    ca = ca or trustme.CA()
    folder.mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert(*HOSTS)
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(folder / f"{name}.pem"))
    cert.private_key_pem.write_to_path(str(folder / f"{name}.key"))
    return ChannelTLS(str(folder / "ca.pem"), str(folder / f"{name}.pem"), str(folder / f"{name}.key"))
