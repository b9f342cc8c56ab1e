"""The OpenAI-compatible gateway against a live stack: the real `openai` SDK
for what clients do, plain HTTP (httpx) for the edge cases, and a hypothesis
fuzz of malformed requests.

One cluster (tiny random models, metrics on) runs draft, verifier,
orchestrator and gateway as four processes; every test goes through the
gateway's HTTP port exactly as a client would.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections import defaultdict

import httpx
import openai
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families

from gateway.fuzz import malformed_requests
from specmesh.client import Client
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from tests.conftest import SERVING, health_status

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

MAX_BODY = 64 * 1024
HAIKU = [{"role": "user", "content": "Write a haiku about caches"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_models, redis_url):
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis_url, log_dir=tmp_path_factory.mktemp("logs-gateway"), startup_timeout_s=900,
                      metrics=True, http_port=free_port(), gateway_args=["--max-body-bytes", str(MAX_BODY)])
    with cluster:
        yield cluster


@pytest.fixture(scope="module")
def model(stack) -> str:
    return stack.served_model()


@pytest.fixture
def sdk(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def _scrape(url: str) -> dict[str, list]:
    samples = defaultdict(list)
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=10).read().decode()):
        for s in family.samples:
            samples[s.name].append((s.labels, s.value))
    return samples


def _value(samples, name: str, **labels) -> float:
    return sum(v for l, v in samples.get(name, []) if all(l.get(k) == want for k, want in labels.items()))


def _cached_sessions(stack: Cluster) -> float:
    return sum(_value(_scrape(stack.metrics_url(tier)), "specmesh_cached_sessions") for tier in ("draft", "verifier"))


def _wait_for(condition, timeout_s: float = 30.0) -> bool:
    """Poll a condition (caches are released just after a stream ends); bounded, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


# ---------------------------------------------------------------- the openai SDK


def test_models_lists_the_target_and_its_drafters(sdk, model):
    ids = [m.id for m in sdk.models.list()]
    assert ids == [model, f"{model}:hybrid", f"{model}:model", f"{model}:ngram"]   # every drafter served
    assert sdk.models.retrieve(f"{model}:ngram").id == f"{model}:ngram"


def test_chat_non_streaming(sdk, model):
    reply = sdk.chat.completions.create(model=model, messages=HAIKU, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == model and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    usage = reply.usage
    assert usage.completion_tokens <= 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculative"]
    assert spec["committed_tokens"] == usage.completion_tokens
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["committed_per_step"] >= 1.0 and 0.0 <= spec["acceptance_rate"] <= 1.0


def test_chat_streaming_matches_non_streaming(sdk, model):
    kwargs = dict(model=model, messages=HAIKU, max_tokens=16, temperature=0.8, seed=11)
    whole = sdk.chat.completions.create(**kwargs)
    chunks = list(sdk.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_streaming_and_not(sdk, model):
    whole = sdk.completions.create(model=model, prompt="hello world", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text and whole.usage.completion_tokens <= 10
    streamed = "".join(c.choices[0].text for c in
                       sdk.completions.create(model=model, prompt="hello world", max_tokens=10, temperature=0,
                                              stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_seed_reproduces(sdk, model):
    def sample(seed):
        return sdk.chat.completions.create(model=model, messages=HAIKU, max_tokens=20, temperature=1.0, top_p=0.95,
                                           seed=seed, extra_body={"top_k": 50}).choices[0].message.content
    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_greedy_text_equals_the_grpc_api(stack, sdk, model):
    with Client(stack.address) as grpc_client:
        expected_chat = grpc_client.generate("Write a haiku about caches", chat=True, max_new_tokens=24, k=3).text
        expected_text = grpc_client.generate("once upon a time", max_new_tokens=24, drafter="ngram").text
    chat = sdk.chat.completions.create(model=model, messages=HAIKU, max_tokens=24, temperature=0,
                                       extra_body={"k": 3})
    assert chat.choices[0].message.content == expected_chat
    assert chat.system_fingerprint == "specmesh-model-k3"
    text = sdk.completions.create(model=f"{model}:ngram", prompt="once upon a time", max_tokens=24, temperature=0)
    assert text.choices[0].text == expected_text and text.system_fingerprint.startswith("specmesh-ngram-")


def test_errors_are_the_sdks_exceptions(sdk, model):
    with pytest.raises(openai.BadRequestError) as k:
        sdk.chat.completions.create(model=model, messages=HAIKU, extra_body={"k": 99})
    assert k.value.body["param"] == "k" and "k:" in k.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model=model, prompt="hi", max_tokens=100000)
    assert too_long.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as drafter:
        sdk.chat.completions.create(model=model, messages=HAIKU, extra_body={"drafter": "nope"})
    assert drafter.value.body["param"] == "drafter"
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.chat.completions.create(model="gpt-4o", messages=HAIKU)
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        list(sdk.chat.completions.create(model=model, messages=HAIKU, n=3, stream=True))


# ---------------------------------------------------------------- plain HTTP edge cases


def test_edge_cases_get_4xx(stack, model):
    url = f"{stack.http_url}/v1/chat/completions"
    cases = {
        "malformed JSON": (dict(content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"}),
                           400, None),
        "wrong type": (dict(json={"model": model, "messages": HAIKU, "temperature": "hot"}), 400, "temperature"),
        "oversized body": (dict(json={"model": model, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}),
                           413, None),
        "n > 1": (dict(json={"model": model, "messages": HAIKU, "n": 2}), 400, "n"),
        "unknown model": (dict(json={"model": "nope", "messages": HAIKU}), 404, "model"),
        "missing messages": (dict(json={"model": model}), 400, "messages"),
        "bad role": (dict(json={"model": model, "messages": [{"role": "robot", "content": "x"}]}), 400,
                     "messages[0].role"),
    }
    for name, (kwargs, status, param) in cases.items():
        reply = httpx.post(url, timeout=60, **kwargs)
        assert reply.status_code == status, (name, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], name
        assert error["param"] == param, name
    assert _wait_for(lambda: _cached_sessions(stack) == 0)


def test_token_ids_beyond_int32_get_400_and_a_huge_top_k_keeps_every_token(stack, model):
    # Token ids and top_k are int32 on the wire: what does not fit is the client's error (or, for
    # top_k, means "no truncation"), never the gateway's 500.
    url = f"{stack.http_url}/v1/completions"
    for prompt in ([2 ** 31], [2147483648.0], [[1, 2 ** 40]], [-1]):
        reply = httpx.post(url, timeout=60, json={"model": model, "prompt": prompt, "max_tokens": 1})
        assert reply.status_code == 400, (prompt, reply.text)
        assert reply.json()["error"]["param"].startswith("prompt"), (prompt, reply.text)
    reply = httpx.post(url, timeout=60, json={"model": model, "prompt": [1, 2], "max_tokens": 2, "top_k": 2 ** 40,
                                              "temperature": 1, "seed": 3})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_disconnect_mid_stream_releases_the_session(stack, model):
    """The client leaves after a few chunks of a 400-token stream: the gRPC call is cancelled, the
    orchestrator releases the caches on both replicas and the session's Redis keys."""
    before = _value(_scrape(stack.metrics_url("orchestrator")), "specmesh_committed_tokens_total")
    body = {"model": model, "prompt": "once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        data = []
        for line in lines:
            if line.startswith("data: "):
                data.append(json.loads(line[len("data: "):]))
                if len(data) == 3:
                    break
    assert all(d["choices"][0]["finish_reason"] is None for d in data)   # left mid-stream
    session_id = data[0]["id"].removeprefix("cmpl-")
    assert _wait_for(lambda: _cached_sessions(stack) == 0)
    gateway = _scrape(f"{stack.http_url}/metrics")
    assert _value(gateway, "specmesh_gateway_client_disconnects_total") >= 1
    assert _value(gateway, "specmesh_gateway_active_streams") == 0
    orchestrator = _scrape(stack.metrics_url("orchestrator"))
    assert _value(orchestrator, "specmesh_orchestrator_active_sessions") == 0
    # Cancelled, not run to the end: far fewer than 400 tokens were committed.
    assert _value(orchestrator, "specmesh_committed_tokens_total") - before < 200
    keys = redis.Redis.from_url(stack.redis_url).keys(f"*{{{session_id}}}*")
    assert keys == []


def test_disconnect_while_waiting_for_a_non_streaming_reply(stack, model):
    body = {"model": model, "prompt": "once upon a time", "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    assert _wait_for(lambda: _cached_sessions(stack) == 0 and _value(
        _scrape(stack.metrics_url("orchestrator")), "specmesh_orchestrator_active_sessions") == 0)


def test_32_concurrent_streams_complete(stack, model):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str | None, bool]:
        body = {"model": model, "messages": [{"role": "user", "content": f"count to {i}"}], "max_tokens": 12,
                "temperature": 0.7, "seed": i, "stream": True}
        text, finish, done = "", None, False
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[len("data: "):])["choices"][0]
                    text += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
        return text, finish, done

    async def all_of_them():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    assert all(done and finish in ("stop", "length") for _, finish, done in results)
    assert sum(1 for text, _, _ in results if text) >= 30   # a stream may stop at once on EOS
    assert _wait_for(lambda: _cached_sessions(stack) == 0)


def test_health_and_metrics(stack):
    assert httpx.get(f"{stack.http_url}/health").json() == {"status": "ok", "orchestrator": "SERVING"}
    assert httpx.get(f"{stack.http_url}/ping").status_code == 200
    gateway = _scrape(f"{stack.http_url}/metrics")
    assert _value(gateway, "specmesh_gateway_requests_total", route="/v1/chat/completions", status="200") > 0
    assert _value(gateway, "specmesh_gateway_time_to_first_token_seconds_count") > 0


# ---------------------------------------------------------------- fuzz


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=120) as client:
        yield client


def test_fuzzed_requests_never_get_a_5xx(stack, model, http):
    statuses = defaultdict(int)

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(malformed_requests(model))
    def check(request):
        method, path, body, content_type = request
        reply = http.request(method, path, content=body, headers={"content-type": content_type} if content_type else {})
        statuses[reply.status_code] += 1
        assert reply.status_code < 500, (request, reply.text)
        if reply.status_code >= 400:
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > 100   # mostly refused, as they should be
    assert http.get("/health").status_code == 200
    for address, service in ((stack.address, "specmesh.v1.Orchestrator"),
                             (f"localhost:{stack.draft_port}", "specmesh.v1.Draft"),
                             (f"localhost:{stack.verifier_port}", "specmesh.v1.Verifier")):
        assert health_status(address, service) == SERVING
    assert _wait_for(lambda: _cached_sessions(stack) == 0)


def test_sigterm_lets_open_streams_finish_then_exits_cleanly(stack, model):
    """Last in this module: it stops the gateway. SIGTERM closes the listening socket at once, while
    a stream already open runs to its end ([DONE]); then the process exits with status 0."""
    gateway = stack.processes["gateway"]
    body = {"model": model, "prompt": "once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    finish, done, after_refusal = None, False, 0
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        gateway.send_signal(signal.SIGTERM)
        assert _wait_for(lambda: _refused(stack.http_url))   # no new connections...
        for line in lines:                                     # ...while this stream goes on
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                after_refusal += 1
                finish = json.loads(line[len("data: "):])["choices"][0]["finish_reason"] or finish
    assert done and finish in ("length", "stop")   # ended as streams end, not cut off
    assert after_refusal > 0
    assert gateway.wait(60) == 0


def _refused(url: str) -> bool:
    """No new request is served: the connection is refused, or (a connection the kernel had queued just
    before the socket closed) dropped without an answer."""
    try:
        httpx.get(f"{url}/ping", timeout=2)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False
