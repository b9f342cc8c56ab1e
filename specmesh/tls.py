"""TLS on every gRPC port, mutual TLS between the tiers, and certificates that rotate.

Files, not bytes: a certificate arrives mounted from a Secret, and cert-manager
renews it in place, so both ends re-read their files when they change.

- A server (`server_credentials`) hands gRPC a fetcher that gRPC calls on every
  new connection; it answers a new configuration only when a file changed
  (a stat per handshake, no reading), so rotation needs no restart and a
  half-written pair (key and certificate that do not match) is ignored until
  the pair is whole again.
- A client (`ChannelTLS`) builds channel credentials from its files; a holder
  of long-lived channels (the orchestrator's replica channels) asks `changed()`
  now and then and reconnects with fresh credentials, since gRPC Python's
  channel credentials are fixed once made.

With `client_ca_file` set a server requires a client certificate signed by
that CA: that is mutual TLS, the internal tiers' identity check (only holders
of a certificate from the internal CA get a connection at all).
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("specmesh.tls")


def _stamp(paths) -> tuple:
    """What changes when a mounted file is replaced: a Secret update swaps a symlink, so the
    target's inode changes; an in-place rewrite changes its mtime or size."""
    stamp = []
    for path in paths:
        st = os.stat(path)
        stamp.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(stamp)


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what} {path}: {error.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} {path}: not a PEM file")
    return data


def check_pair(cert_file: str, key_file: str) -> None:
    """ValueError unless the key belongs to the certificate (a mismatched pair fails only at the
    first handshake, where nobody reads the message)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"TLS certificate {cert_file} and key {key_file} do not make a pair: {error}") from None


@dataclass(frozen=True)
class ServerTLS:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None   # set: mutual TLS, a client certificate from this CA is required

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        check_pair(self.cert_file, self.key_file)
        pair = (_read(self.key_file, "TLS key"), _read(self.cert_file, "TLS certificate"))
        roots = _read(self.client_ca_file, "TLS client CA") if self.client_ca_file else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=roots)


def server_tls(cert_file: str | None, key_file: str | None, client_ca_file: str | None = None) -> ServerTLS | None:
    """The settings as a ServerTLS; None for plaintext. Half a configuration is an error, not plaintext."""
    if not cert_file and not key_file:
        if client_ca_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file: mutual TLS is TLS first")
        return None
    if not (cert_file and key_file):
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")
    return ServerTLS(cert_file, key_file, client_ca_file)


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """Credentials that re-read `tls`'s files when they change (checked at each new connection)."""
    stamp = [_stamp(tls.files)]

    def fetch():
        try:
            now = _stamp(tls.files)
            if now == stamp[0]:
                return None
            configuration = tls.configuration()
        except (OSError, ValueError) as error:   # mid-rotation: keep serving the last good pair
            log.warning("TLS files changed but cannot be used yet (keeping the current ones): %s", error)
            return None
        stamp[0] = now
        log.info("TLS certificate reloaded from %s", tls.cert_file)
        return configuration

    return grpc.dynamic_ssl_server_credentials(tls.configuration(), fetch,
                                               require_client_authentication=bool(tls.client_ca_file))


@dataclass(frozen=True)
class ChannelTLS:
    """A client's side: the CA that the server's certificate must chain to, and for mutual TLS
    the certificate and key this client presents."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(p for p in (self.ca_file, self.cert_file, self.key_file) if p)

    def credentials(self) -> grpc.ChannelCredentials:
        key = cert = None
        if self.cert_file:
            check_pair(self.cert_file, self.key_file)
            key, cert = _read(self.key_file, "TLS key"), _read(self.cert_file, "TLS certificate")
        return grpc.ssl_channel_credentials(_read(self.ca_file, "TLS CA"), private_key=key, certificate_chain=cert)

    def stamp(self) -> tuple:
        return _stamp(self.files)


def channel_tls(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
                ) -> ChannelTLS | None:
    """The settings as a ChannelTLS; None for plaintext channels."""
    if not ca_file:
        return None
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both tls_cert_file and tls_key_file")
    return ChannelTLS(ca_file, cert_file, key_file)


def aio_channel(address: str, tls: ChannelTLS | None, **kwargs) -> grpc.aio.Channel:
    """An asyncio channel, secure when `tls` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(address, **kwargs)
    return grpc.aio.secure_channel(address, tls.credentials(), **kwargs)


def channel(address: str, tls: ChannelTLS | None, **kwargs) -> grpc.Channel:
    """A blocking channel, secure when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(address, **kwargs)
    return grpc.secure_channel(address, tls.credentials(), **kwargs)


async def follow_rotation(tls: ChannelTLS, on_change, every_s: float = 10.0) -> None:
    """Call `on_change()` whenever `tls`'s files changed and make a usable set again (a rotation
    half done is waited out). Runs until cancelled."""
    stamp = tls.stamp()
    while True:
        await asyncio.sleep(every_s)
        try:
            now = tls.stamp()
            if now == stamp:
                continue
            tls.credentials()   # whole and matching, or wait for the next look
        except (OSError, ValueError) as error:
            log.warning("TLS files changed but cannot be used yet (keeping the current channels): %s", error)
            continue
        stamp = now
        log.info("TLS files changed: reconnecting with the new credentials")
        on_change()
