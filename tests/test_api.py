"""The public API as another team's service sees it: reflection, the unary
variant, stop strings, chat and token prompts, and the stream's shape."""
from __future__ import annotations

import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specmesh.client import build_request
from specmesh.v1 import orchestrator_pb2_grpc


def test_services_are_discoverable_by_reflection(tiny_cluster):
    for port, service in ((tiny_cluster.port, "specmesh.v1.Orchestrator"),
                          (tiny_cluster.draft_port, "specmesh.v1.Draft"),
                          (tiny_cluster.verifier_port, "specmesh.v1.Verifier")):
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            services = db.get_services()
            assert service in services and "grpc.health.v1.Health" in services
            descriptor = db.FindFileContainingSymbol(service)
            assert descriptor.package == "specmesh.v1"


def test_unary_equals_stream(tiny_cluster, tiny_client):
    request = build_request("the cat sat", max_new_tokens=20, k=3, drafter="model")
    streamed = tiny_client.generate("the cat sat", max_new_tokens=20, k=3, drafter="model")
    with grpc.insecure_channel(tiny_cluster.address) as channel:
        reply = orchestrator_pb2_grpc.OrchestratorStub(channel).GenerateUnary(request, timeout=60)
    assert list(reply.token_ids) == streamed.token_ids and reply.text == streamed.text
    assert reply.finish_reason == "length" and reply.stats.committed_tokens == 20


def test_stream_shape(tiny_client):
    chunks = list(tiny_client.stream(build_request("hello", max_new_tokens=12, k=2, seed=3, session_id="shape-1")))
    first, last = chunks[0], chunks[-1]
    assert first.session_id == "shape-1" and first.seed == 3 and first.k == 2 and first.drafter
    assert not first.token_ids and not first.finish_reason
    assert all(not c.finish_reason for c in chunks[:-1]) and last.finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 12 == last.stats.committed_tokens
    assert last.stats.steps == len(chunks) - 1
    assert all(c.step.accepted_tokens <= c.step.draft_tokens for c in chunks)
    assert last.stats.accepted_tokens == sum(c.step.accepted_tokens for c in chunks)


def test_stop_string_cuts_the_text(tiny_client):
    full = tiny_client.generate("hello world", max_new_tokens=40, k=3)
    stop = full.text[10:12]
    assert stop and stop not in full.text[:10]
    cut = tiny_client.generate("hello world", max_new_tokens=40, k=3, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]


def test_chat_and_token_prompts(tiny_client):
    chat = tiny_client.generate("hi there", chat=True, max_new_tokens=8, k=2)
    assert chat.stats.prompt_tokens > len("hi there")        # the chat template added its markup
    plain = tiny_client.generate("hi there", max_new_tokens=8, k=2)
    assert plain.stats.prompt_tokens == len("hi there")
    by_ids = tiny_client.generate([ord("h") % 40 + 1, 3, 4, 5], max_new_tokens=8, k=2)
    assert by_ids.stats.prompt_tokens == 4 and len(by_ids.token_ids) == 8
