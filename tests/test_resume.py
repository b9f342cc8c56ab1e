"""Resume on any orchestrator: a stream whose orchestrator is killed mid-stream
is continued by another from the Redis record, token for token; two
orchestrators racing for one session never both commit."""
from __future__ import annotations

import signal
import threading

import grpc
import pytest

from specmesh.client import Client, build_request
from specmesh.v1 import orchestrator_pb2
from specmesh_cli.launcher import Cluster
from specmesh_cli.redis_server import free_port

REQUEST = dict(max_new_tokens=200, k=3, drafter="model")


@pytest.fixture(scope="module")
def two_orchestrators(tiny_models, redis_url, tmp_path_factory):
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis_url, log_dir=tmp_path_factory.mktemp("logs-resume"), startup_timeout_s=900,
                      orchestrator_replicas=2)
    with cluster:
        yield cluster


@pytest.mark.parametrize("temperature, seed", [(0.0, 1), (0.9, 2), (0.9, 3), (1.0, 4)])
def test_kill_9_of_the_orchestrator_mid_stream_then_resume_on_another(two_orchestrators, temperature, seed):
    cluster = two_orchestrators
    with Client(f"localhost:{cluster.orchestrator_ports[1]}") as client:
        reference = client.generate("resume me please", temperature=temperature, seed=seed, **REQUEST)
    # The client's channel knows both; pick_first sends the stream to the first, which is then killed.
    tokens, killed = [], False
    with Client(cluster.target) as client:
        for chunk in client.stream(build_request("resume me please", temperature=temperature, seed=seed, **REQUEST)):
            assert chunk.offset == len(tokens)
            tokens += chunk.token_ids
            if len(tokens) >= 20 and not killed:
                cluster.stop_tier("orchestrator", signal.SIGKILL)
                killed = True
    cluster.start_tier("orchestrator")   # back for the next case
    cluster.wait()
    assert killed
    assert tokens == reference.token_ids


def test_two_orchestrators_racing_for_one_session(two_orchestrators):
    """B resumes a session A still drives: A is fenced off (ABORTED), B finishes it, the output is right."""
    cluster = two_orchestrators
    a, b = (f"localhost:{p}" for p in cluster.orchestrator_ports[:2])
    with Client(b) as client:
        reference = client.generate("a contested session", temperature=0.9, seed=9, **REQUEST)
    request = build_request("a contested session", temperature=0.9, seed=9, session_id="contested", **REQUEST)
    first, errors = [], []
    started = threading.Event()

    def drive_on_a():
        try:
            with grpc.insecure_channel(a) as channel:
                from specmesh.v1 import orchestrator_pb2_grpc

                for chunk in orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=120):
                    first.extend(chunk.token_ids)
                    if len(first) >= 10:
                        started.set()
        except grpc.RpcError as error:
            errors.append(error.code())
        finally:
            started.set()

    thread = threading.Thread(target=drive_on_a)
    thread.start()
    assert started.wait(120)
    offset = len(first)
    resumed = []
    with Client(b) as client:
        for chunk in client.stream(orchestrator_pb2.GenerateRequest(session_id="contested", resume_offset=offset)):
            resumed += chunk.token_ids
    thread.join(120)
    assert errors in ([grpc.StatusCode.ABORTED], [grpc.StatusCode.FAILED_PRECONDITION], [])
    assert first[:offset] + resumed == reference.token_ids


def test_resume_of_an_unknown_session_is_not_found(two_orchestrators):
    with Client(two_orchestrators.address) as client:
        with pytest.raises(grpc.RpcError) as error:
            list(client.stream(orchestrator_pb2.GenerateRequest(session_id="never-was", resume_offset=0)))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
