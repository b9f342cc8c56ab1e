"""A gRPC health probe that speaks TLS: `python -m specmesh_cli.probe --port 50061 --service specmesh.v1.Draft`.

Kubernetes' own gRPC probes speak plaintext only, so a tier that serves TLS
(and, on the internal tiers, wants a client certificate) is probed with this
instead, run in its own container. It reads the tier's own TLS files from the
same SPECMESH_TLS_* variables the service reads, and presents the tier's
certificate as its client certificate. Exit status 0 when SERVING, 1 otherwise
(the reason on stderr), as grpc_health_probe does. Imports only grpc: a probe
runs every few seconds.
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def credentials(environ=os.environ) -> grpc.ChannelCredentials | None:
    """TLS when the tier serves it: its CA checks the server's certificate, and its own pair (if it
    has one) is the client certificate a mutual-TLS port wants. None: plaintext."""
    cert, key = environ.get("SPECMESH_TLS_CERT_FILE"), environ.get("SPECMESH_TLS_KEY_FILE")
    ca = environ.get("SPECMESH_TLS_CLIENT_CA_FILE") or environ.get("SPECMESH_TLS_CA_FILE")
    if not (cert or ca):
        return None
    return grpc.ssl_channel_credentials(_read(ca), private_key=_read(key), certificate_chain=_read(cert))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh_cli.probe", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, help="a port on this host")
    parser.add_argument("--address", help="host:port elsewhere (instead of --port)")
    parser.add_argument("--service", default="", help="grpc.health.v1 service name; empty: the whole server")
    parser.add_argument("--server-name", default="",
                        help="name the certificate is checked against (one of its DNS names; default: localhost)")
    parser.add_argument("--timeout-s", type=float, default=4.0)
    args = parser.parse_args(argv)
    if not (args.port or args.address):
        parser.error("give --port or --address")
    address = args.address or f"localhost:{args.port}"
    try:
        creds = credentials()
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name and creds else []
        channel = grpc.secure_channel(address, creds, options=options) if creds else grpc.insecure_channel(address)
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                              timeout=args.timeout_s)
    except grpc.RpcError as error:
        print(f"{address}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"{address}: {error}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{address}: {args.service or 'server'} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
