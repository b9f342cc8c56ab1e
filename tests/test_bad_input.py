"""Bad input gets the right status, names the field, and harms nothing else."""
from __future__ import annotations

import grpc
import pytest

from specmesh.client import build_request
from specmesh.v1 import orchestrator_pb2
from tests.conftest import SERVING, health_status


def _status(client, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(request, timeout=60))
    return info.value


CASES = [
    ("empty text", build_request("   "), "text"),
    ("empty chat", orchestrator_pb2.GenerateRequest(chat=orchestrator_pb2.ChatPrompt()), "chat.messages"),
    ("no prompt", orchestrator_pb2.GenerateRequest(), "prompt"),
    ("max_new_tokens 0", build_request("hi", max_new_tokens=0), "max_new_tokens"),
    ("max_new_tokens negative", build_request("hi", max_new_tokens=-3), "max_new_tokens"),
    ("max_new_tokens beyond context", build_request("hi", max_new_tokens=10_000_000), "max_new_tokens"),
    ("temperature negative", build_request("hi", temperature=-0.5), "sampling.temperature"),
    ("temperature nan", build_request("hi", temperature=float("nan")), "sampling.temperature"),
    ("top_p zero", build_request("hi", top_p=0.0), "sampling.top_p"),
    ("top_p above one", build_request("hi", top_p=1.5), "sampling.top_p"),
    ("top_k negative", build_request("hi", top_k=-1), "sampling.top_k"),
    ("k negative", build_request("hi", k=-1), "k"),
    ("k above max", build_request("hi", k=1000), "k"),
    ("unknown drafter", build_request("hi", drafter="medusa"), "drafter"),
    ("token out of vocabulary", build_request([1, 2, 10**6]), "tokens.token_ids"),
    ("bad chat role", orchestrator_pb2.GenerateRequest(chat=orchestrator_pb2.ChatPrompt(
        messages=[orchestrator_pb2.ChatMessage(role="wizard", content="hi")])), "chat.messages[0].role"),
]


@pytest.mark.parametrize("request_, field", [(r, f) for _, r, f in CASES], ids=[c[0] for c in CASES])
def test_invalid_argument_names_the_field(tiny_client, request_, field):
    error = _status(tiny_client, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(field), error.details()


def test_cancel_unknown_session_is_not_found(tiny_client):
    with pytest.raises(grpc.RpcError) as info:
        tiny_client.cancel("no-such-session")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_session_id_in_use_is_already_exists(tiny_client):
    stream = tiny_client.stream(build_request("hello hello hello", max_new_tokens=200, k=2, session_id="dup-1"))
    first = next(stream)
    assert first.session_id == "dup-1"
    try:
        error = _status(tiny_client, build_request("hi", session_id="dup-1"))
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        stream.cancel()


def test_services_stay_serving_and_correct_after_bad_input(tiny_cluster, tiny_client):
    before = tiny_client.generate("the cat sat", max_new_tokens=16, k=3)
    for _, request_, _ in CASES:
        with pytest.raises(grpc.RpcError):
            list(tiny_client.stream(request_, timeout=60))
    for service, port in (("specmesh.v1.Orchestrator", tiny_cluster.port),
                          ("specmesh.v1.Draft", tiny_cluster.draft_port),
                          ("specmesh.v1.Verifier", tiny_cluster.verifier_port)):
        assert health_status(f"localhost:{port}", service) == SERVING
    after = tiny_client.generate("the cat sat", max_new_tokens=16, k=3)
    assert after.token_ids == before.token_ids


def test_internal_apis_reject_bad_input(tiny_cluster):
    """The draft and verifier check what they are sent too, not only the orchestrator."""
    from specmesh.v1 import cache_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(f"localhost:{tiny_cluster.draft_port}") as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        for request_, field in [
            (draft_pb2.ProposeRequest(session_id="x", sync=cache_pb2.CacheSync(token_ids=[1]), k=99), "k"),
            (draft_pb2.ProposeRequest(session_id="x", sync=cache_pb2.CacheSync(token_ids=[1]), k=1,
                                      drafter="nope"), "drafter"),
            (draft_pb2.ProposeRequest(sync=cache_pb2.CacheSync(token_ids=[1]), k=1), "session_id"),
            (draft_pb2.ProposeRequest(session_id="x", sync=cache_pb2.CacheSync(token_ids=[1]), k=1,
                                      top_n=10_000), "top_n"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Propose(request_, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(field)
        with pytest.raises(grpc.RpcError) as info:
            stub.Propose(draft_pb2.ProposeRequest(session_id="never-seen", sync=cache_pb2.CacheSync(start=5), k=1),
                         timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details().startswith("cache miss")
    with grpc.insecure_channel(f"localhost:{tiny_cluster.verifier_port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(verifier_pb2.VerifyRequest(session_id="x", sync=cache_pb2.CacheSync(token_ids=[10**6])),
                        timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            stub.Prefill(verifier_pb2.PrefillRequest(session_id="x"), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        sync = cache_pb2.CacheSync(token_ids=[1, 2])
        for bad, field in [
            (draft_pb2.DraftProposal(token_id=3, q_ids=[3, 10**6], q_probs=[0.5, 0.5]), "proposals[0].q_ids"),
            (draft_pb2.DraftProposal(token_id=3, q_ids=[3], q_probs=[0.5, 0.5]), "proposals[0]"),
            (draft_pb2.DraftProposal(token_id=3, q_ids=list(range(65)), q_probs=[1 / 65] * 65), "proposals[0]"),
            (draft_pb2.DraftProposal(token_id=3, q_ids=[4], q_probs=[1.0]), "proposals[0]"),
            (draft_pb2.DraftProposal(token_id=3, q_ids=[3], q_probs=[float("nan")]), "proposals[0].q_probs"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Verify(verifier_pb2.VerifyRequest(session_id="q", sync=sync, proposals=[bad]), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(field), info.value.details()


SERVICE_METHODS = {
    "orchestrator": ["/specmesh.v1.Orchestrator/Generate", "/specmesh.v1.Orchestrator/GenerateUnary",
                     "/specmesh.v1.Orchestrator/Cancel"],
    "draft": ["/specmesh.v1.Draft/Propose", "/specmesh.v1.Draft/Release", "/specmesh.v1.Draft/Info"],
    "verifier": ["/specmesh.v1.Verifier/Prefill", "/specmesh.v1.Verifier/Verify", "/specmesh.v1.Verifier/Release",
                 "/specmesh.v1.Verifier/Info"],
}


def _ports(cluster) -> dict[str, int]:
    return {"orchestrator": cluster.port, "draft": cluster.draft_port, "verifier": cluster.verifier_port}


def _raw_status(channel, method: str, payload: bytes) -> grpc.RpcError | None:
    call = channel.unary_stream(method) if method.endswith("/Generate") else channel.unary_unary(method)
    try:
        result = call(payload, timeout=30)
        if method.endswith("/Generate"):
            list(result)
    except grpc.RpcError as error:
        return error
    return None


@pytest.mark.parametrize("payload", [
    b"\x0a\x03\xff\xfe\xfd",      # field 1 (text / session_id) as invalid UTF-8
    b"\x52\x02\xc3\x28",          # field 10 (GenerateRequest.session_id) as invalid UTF-8
    b"\x3a\x03\xed\xa0\x80",      # field 7 (GenerateRequest.stop) as an encoded surrogate
    b"\xff\xff\xff\xff",          # not a message at all
], ids=["field 1", "session_id", "stop", "corrupt"])
def test_undecodable_requests_are_invalid_argument_on_every_service(tiny_cluster, payload):
    for service, port in _ports(tiny_cluster).items():
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            for method in SERVICE_METHODS[service]:
                error = _raw_status(channel, method, payload)
                if error is None:   # these bytes decode as this method's message (another field number)
                    continue
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error.code(), error.details())


def test_invalid_utf8_is_refused_by_every_method(tiny_cluster):
    """Field 1 is a string in every request here except Info's (empty) message."""
    for service, port in _ports(tiny_cluster).items():
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            for method in SERVICE_METHODS[service]:
                if method.endswith("/Info"):
                    continue
                error = _raw_status(channel, method, b"\x0a\x02\xff\xfe")
                assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, method


@pytest.mark.parametrize("session_id", ["has\nnewline", "x" * 1_000_000, "x" * 129, "semi;colon"],
                         ids=["newline", "1 MB", "129 chars", "charset"])
def test_a_bad_session_id_is_refused_by_every_service_that_takes_one(tiny_cluster, tiny_client, session_id):
    from specmesh.v1 import cache_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2, verifier_pb2, verifier_pb2_grpc

    sync = cache_pb2.CacheSync(token_ids=[1, 2])
    errors = [_status(tiny_client, build_request("hi", max_new_tokens=2, session_id=session_id))]
    with pytest.raises(grpc.RpcError) as info:
        tiny_client.stub.Cancel(orchestrator_pb2.CancelRequest(session_id=session_id), timeout=30)
    errors.append(info.value)
    with grpc.insecure_channel(f"localhost:{tiny_cluster.draft_port}") as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        for call, request_ in [(stub.Propose, draft_pb2.ProposeRequest(session_id=session_id, sync=sync, k=1)),
                               (stub.Release, cache_pb2.ReleaseRequest(session_id=session_id))]:
            with pytest.raises(grpc.RpcError) as info:
                call(request_, timeout=30)
            errors.append(info.value)
    with grpc.insecure_channel(f"localhost:{tiny_cluster.verifier_port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        for call, request_ in [(stub.Prefill, verifier_pb2.PrefillRequest(session_id=session_id, token_ids=[1])),
                               (stub.Verify, verifier_pb2.VerifyRequest(session_id=session_id, sync=sync)),
                               (stub.Release, cache_pb2.ReleaseRequest(session_id=session_id))]:
            with pytest.raises(grpc.RpcError) as info:
                call(request_, timeout=30)
            errors.append(info.value)
    for error in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("session_id")
        assert len(error.details()) < 300 and "\n" not in error.details()


def test_a_newline_in_a_session_id_forges_no_log_line(tiny_cluster, tiny_client):
    forged = "12:00:00 orchestrator INFO specmesh.orchestrator: forged-by-a-caller"
    _status(tiny_client, build_request("hi", max_new_tokens=2, session_id="ok\n" + forged))
    tiny_client.generate("hi", max_new_tokens=2)   # a request that logs, after it
    for name in ("orchestrator", "draft-0", "verifier-0"):
        assert "forged-by-a-caller" not in tiny_cluster.processes[name].log_path.read_text(errors="replace")


def test_a_tiny_temperature_is_served_as_its_greedy_limit(tiny_client):
    greedy = tiny_client.generate("the cat sat", max_new_tokens=12, k=3)
    for temperature in (1e-40, 1e-45):
        tiny = tiny_client.generate("the cat sat", max_new_tokens=12, k=3, temperature=temperature, seed=5)
        assert tiny.token_ids == greedy.token_ids


def test_a_message_over_the_size_limit_is_resource_exhausted(tiny_cluster):
    from google.protobuf.internal.encoder import _VarintBytes

    from specmesh.bounds import DEFAULT_MAX_MESSAGE_BYTES

    size = DEFAULT_MAX_MESSAGE_BYTES + 2 * 2**20     # one string field, just over every service's limit
    for service, port in _ports(tiny_cluster).items():
        with grpc.insecure_channel(f"localhost:{port}", options=[("grpc.max_send_message_length", -1)]) as channel:
            error = _raw_status(channel, SERVICE_METHODS[service][0], b"\x0a" + _VarintBytes(size) + b"a" * size)
            assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, service


def test_internal_apis_refuse_a_negative_start_and_a_q_not_summing_to_one(tiny_cluster):
    from specmesh.v1 import cache_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(f"localhost:{tiny_cluster.draft_port}") as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        stub.Propose(draft_pb2.ProposeRequest(session_id="neg", sync=cache_pb2.CacheSync(token_ids=[1, 2, 3]), k=1),
                     timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            stub.Propose(draft_pb2.ProposeRequest(session_id="neg", sync=cache_pb2.CacheSync(start=-2), k=1),
                         timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("sync.start")
        stub.Release(cache_pb2.ReleaseRequest(session_id="neg"), timeout=30)
    with grpc.insecure_channel(f"localhost:{tiny_cluster.verifier_port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(verifier_pb2.VerifyRequest(session_id="neg", sync=cache_pb2.CacheSync(start=-1)), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("sync.start")
        heavy = draft_pb2.DraftProposal(token_id=3, q_ids=[3], q_probs=[1e30])
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(verifier_pb2.VerifyRequest(session_id="neg", sync=cache_pb2.CacheSync(token_ids=[1, 2]),
                                                   proposals=[heavy]), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("proposals[0].q_probs"), info.value.details()
