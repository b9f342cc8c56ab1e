"""The gateway's pieces without a cluster: OpenAI <-> proto translation, error
mapping, and each gRPC status reaching the openai SDK as its own exception type
(the app in-process against a stub Orchestrator gRPC server whose replies the
test chooses: the one place this file stands in for the real orchestrator)."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from gateway import errors, translate
from gateway.app import create_app
from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from specmesh.config import GatewayConfig
from specmesh_cli.ports import free_port
from specmesh.v1 import orchestrator_pb2, orchestrator_pb2_grpc

SERVED = translate.Served(model="tiny", target_model="/models/tiny", drafters={"ngram": "", "model": "draft"},
                          default_drafter="model", max_context=512, default_k=4, max_k=8)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


# ---------------------------------------------------------------- requests


def test_chat_fields_map_onto_the_generate_request():
    req = chat(messages=[{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               max_tokens=5, max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=-1, stop="END",
               k=3, top_k=40, user="alice")
    msg = translate.generate_request(req)
    assert [(m.role, m.content) for m in msg.chat.messages] == [("system", "be brief"), ("user", "ab")]
    assert msg.max_new_tokens == 7                     # max_completion_tokens wins, as at OpenAI
    assert msg.sampling.temperature == pytest.approx(0.5) and msg.sampling.top_p == pytest.approx(0.9)
    assert msg.sampling.top_k == 40 and msg.k == 3
    assert msg.seed == 2 ** 64 - 1                     # OpenAI's signed seed wraps onto ours
    assert list(msg.stop) == ["END"]
    assert msg.drafter == ""                           # the server's default


def test_defaults_follow_openai():
    msg = translate.generate_request(chat())
    assert msg.sampling.temperature == translate.DEFAULT_TEMPERATURE == 1.0
    assert not msg.HasField("max_new_tokens") and not msg.HasField("seed") and not msg.HasField("k")
    assert not msg.sampling.HasField("top_p")


def test_completion_prompts():
    text = translate.generate_request(CompletionRequest(model="tiny", prompt="once upon", stop=["a", "b"]))
    assert text.text == "once upon" and list(text.stop) == ["a", "b"]
    ids = translate.generate_request(CompletionRequest(model="tiny", prompt=[[5, 6, 7]]))   # a batch of one
    assert list(ids.tokens.token_ids) == [5, 6, 7]
    with pytest.raises(APIError) as many:
        translate.generate_request(CompletionRequest(model="tiny", prompt=["a", "b"]))
    assert (many.value.status, many.value.param) == (400, "prompt")


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stop": ["ok", ""]}, "stop"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
])
def test_what_we_cannot_do_is_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as error:
        translate.generate_request(chat(**fields))
    assert (error.value.status, error.value.param, error.value.type) == (400, param, "invalid_request_error")


def test_neutral_values_of_unsupported_fields_are_accepted():
    translate.generate_request(chat(n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                                    tools=[], response_format={"type": "text"}, parallel_tool_calls=True))


def test_model_ids_pick_the_drafter():
    assert SERVED.model_ids() == ["tiny", "tiny:model", "tiny:ngram"]
    assert SERVED.resolve("tiny") == "" and SERVED.resolve("tiny:ngram") == "ngram"
    assert translate.generate_request(chat(model="tiny:ngram"), SERVED.resolve("tiny:ngram")).drafter == "ngram"
    for unknown in ("gpt-4o", "tiny:nope", "tiny:", ":ngram"):
        with pytest.raises(APIError) as error:
            SERVED.resolve(unknown)
        assert (error.value.status, error.value.param, error.value.code) == (404, "model", "model_not_found")
    with pytest.raises(APIError) as clash:
        translate.generate_request(chat(drafter="model"), "ngram")
    assert clash.value.param == "drafter"


def test_models_list():
    listed = SERVED.models_list(created=1)
    assert [m["id"] for m in listed["data"]] == SERVED.model_ids()
    assert listed["data"][0]["specmesh"]["role"] == "target" and listed["data"][0]["max_model_len"] == 512
    assert listed["data"][1]["parent"] == "tiny" and listed["data"][1]["specmesh"]["draft_model"] == "draft"


# ---------------------------------------------------------------- responses


def _stats(**kw) -> orchestrator_pb2.GenerateStats:
    base = dict(steps=4, draft_tokens=12, accepted_tokens=6, committed_tokens=10, prompt_tokens=7,
                acceptance_rate=0.5, committed_per_step=2.5)
    return orchestrator_pb2.GenerateStats(**{**base, **kw})


def test_usage_carries_the_speculative_counts():
    u = translate.usage(_stats())
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (7, 10, 17)
    assert u["speculative"] == {"draft_tokens": 12, "accepted_tokens": 6, "committed_tokens": 10,
                                "acceptance_rate": 0.5, "committed_per_step": 2.5, "steps": 4}


def test_reply_builds_openai_objects():
    reply = translate.Reply(chat=True, model="tiny", created=5)
    reply.add(orchestrator_pb2.GenerateChunk(session_id="s1", seed=9, drafter="ngram", k=4))
    reply.add(orchestrator_pb2.GenerateChunk(text="Hel", stats=_stats()))
    reply.add(orchestrator_pb2.GenerateChunk(text="lo", finish_reason="length", stats=_stats()))
    body = reply.response()
    assert body["id"] == "chatcmpl-s1" and body["object"] == "chat.completion" and body["seed"] == 9
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 10
    assert reply.chunk(None, first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert reply.chunk("x", with_usage_field=True)["usage"] is None
    assert reply.usage_chunk()["choices"] == [] and reply.usage_chunk()["usage"]["total_tokens"] == 17
    text = translate.Reply(chat=False, model="tiny", created=5)
    text.add(orchestrator_pb2.GenerateChunk(session_id="s2", text="ab", finish_reason="stop"))
    assert text.response()["choices"][0]["text"] == "ab" and text.response()["object"] == "text_completion"
    assert [translate.finish_reason(r) for r in ("", "stop", "length", "cancelled")] == \
        [None, "stop", "length", "cancelled"]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.PERMISSION_DENIED, 403),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 502), (grpc.StatusCode.UNKNOWN, 502),
])
def test_grpc_statuses_map_to_http(code, status):
    assert errors.from_grpc(rpc_error(code, "something")).status == status


def test_invalid_argument_names_the_openai_field():
    e = errors.from_grpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be > 0, got 0"))
    assert (e.param, e.message) == ("max_tokens", "max_tokens: must be > 0, got 0")
    e = errors.from_grpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: too many"),
                         max_tokens_field="max_completion_tokens")
    assert e.param == "max_completion_tokens"
    e = errors.from_grpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[1].role: must be ..."), "messages")
    assert e.param == "messages[1].role"
    for proto, openai_name in (("sampling.top_p", "top_p"), ("tokens.token_ids", "prompt"), ("k", "k"),
                               ("drafter", "drafter")):
        assert errors.from_grpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"{proto}: bad")).param == openai_name
    assert errors.validation_param(("body", "messages", 0, "content", "str")) == "messages[0].content"


# ---------------------------------------------------------------- through the SDK


class _StubOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """Answers Generate with the status a test sets; ListModels with "tiny"."""

    def __init__(self):
        self.code, self.details = grpc.StatusCode.OK, ""

    async def Generate(self, request, context):
        if self.code != grpc.StatusCode.OK:
            await context.abort(self.code, self.details)
        yield orchestrator_pb2.GenerateChunk(session_id="stub", seed=1, drafter="ngram", k=4)
        yield orchestrator_pb2.GenerateChunk(text="ok", finish_reason="stop", stats=_stats(committed_tokens=1))

    async def ListModels(self, request, context):
        return orchestrator_pb2.ListModelsResponse(target_model="tiny", max_context=512, default_drafter="ngram",
                                                   drafters=[orchestrator_pb2.DrafterModel(name="ngram")])


@pytest.fixture
async def stub_gateway():
    stub = _StubOrchestrator()
    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(stub, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    app = create_app(GatewayConfig(orchestrator_addr=f"127.0.0.1:{port}", max_body_bytes=2048))
    async with app.router.lifespan_context(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none", http_client=http, max_retries=0)
        yield stub, client, http
        await http.aclose()
    await server.stop(0)


@pytest.mark.parametrize("code, exception", [
    (grpc.StatusCode.INVALID_ARGUMENT, openai.BadRequestError),
    (grpc.StatusCode.NOT_FOUND, openai.NotFoundError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, openai.RateLimitError),
    (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError),
    (grpc.StatusCode.UNAUTHENTICATED, openai.AuthenticationError),
    (grpc.StatusCode.PERMISSION_DENIED, openai.PermissionDeniedError),
])
async def test_statuses_reach_the_sdk_as_its_exceptions(stub_gateway, code, exception):
    stub, client, _ = stub_gateway
    stub.code, stub.details = code, "k: must be in [0, 8], got 9" if code == grpc.StatusCode.INVALID_ARGUMENT else "no"
    with pytest.raises(exception) as error:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["type"] and error.value.body["message"]
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert error.value.body["param"] == "k"
    stub.code = grpc.StatusCode.OK
    ok = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content == "ok" and ok.usage.completion_tokens == 1


async def test_bad_bodies_get_openai_errors(stub_gateway):
    _, _, http = stub_gateway
    big = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 4096})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    async def chunked():   # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(4):
            yield b"x" * 1000
        yield b'"}'

    streamed = await http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    broken = await http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', 
                             headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
    wrong = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": "hi"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "messages"
    assert (await http.get("/v1/nothing")).json()["error"]["message"] == "Not Found"
    assert (await http.get("/v1/completions")).status_code == 405
