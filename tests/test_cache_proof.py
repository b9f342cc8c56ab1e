"""A poisoned cache cannot change the output: every CacheSync carries the
fingerprint of the committed prefix, and a replica whose cache does not match
it answers "cache miss" and is rebuilt from the committed tokens."""
from __future__ import annotations

import grpc

from specmesh.client import Client, build_request
from specmesh.v1 import cache_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPT, TOKENS = "the quick brown fox jumps over the lazy dog", 48


def _poison(cluster, session_id: str) -> None:
    """Replace the session's caches on both replicas through their internal APIs."""
    # Longer than what the stream has committed, so only the fingerprint can tell (the tiny vocabulary has 48 tokens).
    junk = [(7 * i + 3) % 40 + 5 for i in range(200)]
    with grpc.insecure_channel(f"localhost:{cluster.verifier_port}") as channel:
        verifier_pb2_grpc.VerifierStub(channel).Prefill(
            verifier_pb2.PrefillRequest(session_id=session_id, token_ids=junk), timeout=30)
    with grpc.insecure_channel(f"localhost:{cluster.draft_port}") as channel:
        draft_pb2_grpc.DraftStub(channel).Propose(draft_pb2.ProposeRequest(
            session_id=session_id, sync=cache_pb2.CacheSync(start=0, token_ids=junk), k=1, drafter="model"),
            timeout=30)


def test_a_cache_poisoned_mid_stream_leaves_the_output_unchanged(tiny_cluster):
    request = dict(max_new_tokens=TOKENS, k=3, drafter="model", temperature=0.9, seed=11)
    with Client(tiny_cluster.address) as client:
        reference = client.generate(PROMPT, **request)
        session_id, tokens, poisoned = "poison-me", [], False
        for chunk in client.stream(build_request(PROMPT, session_id=session_id, **request)):
            tokens += chunk.token_ids
            if len(tokens) >= 6 and not poisoned:
                _poison(tiny_cluster, session_id)
                poisoned = True
    assert poisoned
    assert tokens == reference.token_ids


def test_a_sync_without_the_fingerprint_is_a_cache_miss(tiny_cluster):
    with grpc.insecure_channel(f"localhost:{tiny_cluster.verifier_port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        stub.Prefill(verifier_pb2.PrefillRequest(session_id="no-proof", token_ids=[5, 6, 7]), timeout=30)
        try:
            try:
                stub.Verify(verifier_pb2.VerifyRequest(session_id="no-proof", sync=cache_pb2.CacheSync(start=3)),
                            timeout=30)
                raise AssertionError("a sync that proves nothing was trusted")
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "cache miss" in error.details() and "fingerprint" in error.details()
        finally:
            stub.Release(cache_pb2.ReleaseRequest(session_id="no-proof"), timeout=30)
