"""How a command reaches a locked orchestrator: the flags (a bearer token, TLS, mutual TLS) and the
client they make. Shared by `specmesh generate` and `specmesh soak`."""
from __future__ import annotations

import argparse
import os


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """How a command reaches a locked orchestrator: a bearer token, TLS, mutual TLS."""
    parser.add_argument("--token-file", default=os.environ.get("SPECMESH_TOKEN_FILE"),
                        help="a file holding the bearer token (an orchestrator with auth_tokens_file) "
                             "[SPECMESH_TOKEN_FILE]")
    parser.add_argument("--tls-ca-file", default=os.environ.get("SPECMESH_TLS_CA_FILE"),
                        help="CA of the orchestrator's certificate: connect over TLS [SPECMESH_TLS_CA_FILE]")
    parser.add_argument("--tls-cert-file", default=None, help="client certificate, for mutual TLS")
    parser.add_argument("--tls-key-file", default=None, help="its private key")


def client_for(args, address: str | None = None, **kwargs):
    """A specmesh.client.Client from add_client_arguments' flags."""
    from specmesh import auth
    from specmesh.client import Client
    from specmesh.tls import channel_tls

    token = auth.read_token(args.token_file) if args.token_file else None
    return Client(address or args.addr, token=token,
                  tls=channel_tls(args.tls_ca_file, args.tls_cert_file, args.tls_key_file), **kwargs)
