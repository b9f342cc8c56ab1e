"""Only the callers allowed in get in: bearer tokens on the public API, a
separate internal token between the tiers, sessions only their owner may
cancel, tokens re-read when their file changes, and no token in any log."""
from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from specmesh.client import Client, build_request
from specmesh.v1 import cache_pb2, draft_pb2_grpc, verifier_pb2_grpc
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from tools.otlp_collector import Collector
from tests.conftest import SERVING, health_status, status_of

ALICE, BOB, INTERNAL = "alice-7f3c9e1d2b", "bob-55aa01ce93", "internal-0b9d77e4f1"


@pytest.fixture(scope="module")
def locked(tiny_models, redis_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    (root / "tokens").write_text(f"# public API tokens\n{ALICE}\n{BOB}\n")
    (root / "internal").write_text(INTERNAL + "\n")
    # Traced (to a collector in this process) and metered, so spans and metrics can be searched for tokens too.
    with Collector() as collector:
        cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                          redis_url=redis_url, log_dir=root / "logs", startup_timeout_s=900, metrics=True,
                          extra_env={"SPECMESH_INTERNAL_TOKEN_FILE": str(root / "internal"), **collector.env()},
                          orchestrator_args=["--auth-tokens-file", str(root / "tokens")])
        with cluster:
            cluster.collector = collector
            yield cluster, root


def test_the_public_api_wants_an_accepted_token(locked):
    cluster, _ = locked
    assert health_status(cluster.address, "specmesh.v1.Orchestrator") == SERVING   # probes need none
    with Client(cluster.address) as nobody, Client(cluster.address, token="guess") as stranger, \
            Client(cluster.address, token=ALICE) as alice:
        assert status_of(lambda: nobody.generate("hi", max_new_tokens=4)) == grpc.StatusCode.UNAUTHENTICATED
        assert status_of(lambda: stranger.generate("hi", max_new_tokens=4)) == grpc.StatusCode.UNAUTHENTICATED
        assert alice.generate("hi", max_new_tokens=4, k=2, drafter="model").finish_reason == "length"


def test_internal_apis_want_the_internal_token(locked):
    cluster, _ = locked
    for port, stub_cls in ((cluster.verifier_port, verifier_pb2_grpc.VerifierStub),
                           (cluster.draft_port, draft_pb2_grpc.DraftStub)):
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            stub = stub_cls(channel)
            info = cache_pb2.InfoRequest()
            assert status_of(lambda: stub.Info(info, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
            assert status_of(lambda: stub.Info(info, timeout=10, metadata=(("authorization", f"Bearer {ALICE}"),))
                         ) == grpc.StatusCode.UNAUTHENTICATED   # a public token opens no internal door
            assert status_of(lambda: stub.Info(info, timeout=10, metadata=(("authorization", f"Bearer {INTERNAL}"),))
                         ) == grpc.StatusCode.OK


def test_only_the_owner_may_cancel_a_session(locked):
    cluster, _ = locked
    with Client(cluster.address, token=ALICE) as alice, Client(cluster.address, token=BOB) as bob:
        stream = alice.stream(build_request("a long one", max_new_tokens=400, k=2, drafter="model",
                                            session_id="alices"))
        next(stream)
        assert status_of(lambda: bob.cancel("alices")) == grpc.StatusCode.PERMISSION_DENIED
        alice.cancel("alices")
        assert [c.finish_reason for c in stream][-1] == "cancelled"


def test_a_revoked_token_is_refused_without_a_restart(locked):
    cluster, root = locked
    (root / "tokens").write_text(f"{ALICE}\n")   # Bob's token revoked
    deadline = time.monotonic() + 10
    with Client(cluster.address, token=BOB) as bob:
        while status_of(lambda: bob.generate("hi", max_new_tokens=2)) != grpc.StatusCode.UNAUTHENTICATED:
            assert time.monotonic() < deadline, "the revoked token is still accepted"
            time.sleep(0.5)


def test_no_token_reaches_a_log_a_span_or_a_metric(locked):
    cluster, root = locked
    with Client(cluster.address, token=ALICE) as alice:   # one more traced call, whatever ran before
        alice.generate("hi", max_new_tokens=4, k=2)
    deadline = time.monotonic() + 30
    while not any(s["name"].endswith("Generate") for s in cluster.collector.spans()):
        assert time.monotonic() < deadline, "no Generate span exported"
        time.sleep(0.2)
    places = {log_file.name: log_file.read_text() for log_file in (root / "logs").glob("*.log")}
    places["spans"] = json.dumps(cluster.collector.spans(), default=str)
    for name in cluster.metrics_ports:
        places[f"{name} /metrics"] = urllib.request.urlopen(cluster.metrics_url(name), timeout=10).read().decode()
    for place, text in places.items():
        for secret in (ALICE, BOB, INTERNAL):
            assert secret not in text, f"{secret} in {place}"
