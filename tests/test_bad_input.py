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
