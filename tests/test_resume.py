"""Resume on any orchestrator: a stream whose orchestrator is killed mid-stream
is continued by another from the Redis record, token for token; two
orchestrators racing for one session never both commit."""
from __future__ import annotations

import threading

import grpc
import pytest

from specmesh.client import Client, build_request
from specmesh.v1 import orchestrator_pb2
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from tests.conftest import stream_through_a_kill

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

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
    tokens = stream_through_a_kill(cluster, build_request("resume me please", temperature=temperature, seed=seed,
                                                          **REQUEST))
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


def _resume(address: str, session_id: str, offset: int) -> tuple[list[int], str, str]:
    tokens, text, finish = [], "", ""
    with Client(address) as client:
        for chunk in client.stream(orchestrator_pb2.GenerateRequest(session_id=session_id, resume_offset=offset)):
            assert chunk.offset == offset + len(tokens)
            tokens += chunk.token_ids
            text += chunk.text
            finish = chunk.finish_reason or finish
    return tokens, text, finish


@pytest.mark.parametrize("kind", ["greedy", "sampled", "stop-string"])
def test_a_finished_session_resumed_replays_its_tail_and_its_end(two_orchestrators, kind):
    """A client that lost the last chunks of a stream that ended gets them, and the same end, not NOT_FOUND."""
    cluster = two_orchestrators
    a, b = (f"localhost:{p}" for p in cluster.orchestrator_ports[:2])
    request = dict(max_new_tokens=40, k=3, drafter="model")
    with Client(a) as client:
        done = client.generate("the end of a session", **request, **({"temperature": 0.9, "seed": 5}
                                                                      if kind == "sampled" else {}))
        if kind == "stop-string":   # a stop string the greedy output reaches past its 20th character
            done = client.generate("the end of a session", stop=[done.text[20:23]], **request)
            assert done.finish_reason == "stop"
    assert done.finish_reason in ("length", "stop") and len(done.token_ids) > 7
    for offset in (len(done.token_ids) - 7, len(done.token_ids), 0):
        tokens, text, finish = _resume(b, done.session_id, offset)   # on the other orchestrator
        assert tokens == done.token_ids[offset:]
        assert finish == done.finish_reason
        if offset == 0:
            assert text == done.text


@pytest.mark.parametrize("ending, finish", [("eos", "stop"), ("length", "length")])
def test_a_session_whose_driver_died_after_its_last_step_ends_on_resume(two_orchestrators, ending, finish):
    """The record says "running" but its tokens already end (the orchestrator died before ending it):
    a resume replays them and ends, without decoding past the end."""
    import asyncio

    from orchestrator.sessions import SessionStore
    from specmesh.models import load_tokenizer

    cluster = two_orchestrators
    tokenizer, _ = load_tokenizer(cluster.model)
    prompt = tokenizer("an orphaned session").input_ids
    generated = tokenizer("it was cut").input_ids + ([tokenizer.eos_token_id] if ending == "eos" else [])
    params = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "k": 3, "drafter": "model",
              "max_new_tokens": len(generated) + (50 if ending == "eos" else 0), "stop": []}
    session_id = f"orphan-{ending}"

    async def write_record():
        store = SessionStore.from_url(cluster.redis_url, 60)
        try:
            await store.create(session_id, prompt + generated, params, seed=3, prompt_len=len(prompt))
        finally:
            await store.client.aclose()

    asyncio.run(write_record())
    tokens, _, got = _resume(cluster.address, session_id, 2)
    assert (tokens, got) == (generated[2:], finish)
    assert _resume(cluster.address, session_id, 0)[1:] == (tokenizer.decode(generated, skip_special_tokens=True),
                                                           finish)   # now kept as finished


def test_a_finished_session_is_not_found_after_finished_ttl_s(two_orchestrators, tmp_path):
    """A third orchestrator keeping finished records 1 s: once its record expires, a resume is NOT_FOUND."""
    import time

    import redis

    cluster = two_orchestrators
    short = Cluster(model=cluster.model, port=free_port(), redis_url=cluster.redis_url, log_dir=tmp_path,
                    draft_ports=cluster.draft_ports, verifier_ports=cluster.verifier_ports,
                    orchestrator_args=["--finished-ttl-s", "1"], startup_timeout_s=900)
    short.start_tier("orchestrator")
    try:
        short.wait()
        with Client(short.address) as client:
            done = client.generate("gone soon", max_new_tokens=12, k=3, drafter="model")
        store = redis.Redis.from_url(cluster.redis_url)
        deadline = time.monotonic() + 60
        while store.exists(f"specmesh:session:{{{done.session_id}}}") and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as error:
            _resume(short.address, done.session_id, 0)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        short.stop()


def test_a_resume_without_a_session_id_is_invalid(two_orchestrators):
    """INVALID_ARGUMENT naming the field (the servicer once raised it without importing it: INTERNAL)."""
    with Client(f"localhost:{two_orchestrators.orchestrator_ports[1]}") as client, pytest.raises(grpc.RpcError) as err:
        list(client.stream(orchestrator_pb2.GenerateRequest(resume_offset=0)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume_offset needs the session_id" in err.value.details()
