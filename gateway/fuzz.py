"""Malformed requests for the gateway, as hypothesis strategies: what
tests/test_gateway.py and `specmesh bench-gateway` throw at a live gateway.

Each example is (method, path, body bytes, content type). Bodies are
mostly-valid completions with one or more fields broken (wrong types, out of
range, unknown model, bad roles), plus arbitrary bytes and JSON that is not an
object. Valid-looking ones ask for at most 4 tokens so the fuzz stays quick.
(hypothesis is a dev dependency; only the test and the benchmark import this.)
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

ROUTES = ("/v1/chat/completions", "/v1/completions")

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                          st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
_json_any = st.recursive(_json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                         max_leaves=12)

# Values for each field: in range, out of range, or of the wrong type.
_FIELDS = {
    # Never null: a valid request without a limit would generate the server default (slow, not malformed).
    "max_tokens": st.one_of(st.integers(-5, 4), st.integers(10 ** 6, 2 ** 40), _json_any.filter(lambda v: v is not None)),
    "max_completion_tokens": st.one_of(st.integers(-5, 4), _json_any),
    "temperature": st.one_of(st.floats(-3, 5, allow_nan=False), _json_any),
    "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), _json_any),
    "top_k": st.one_of(st.integers(-5, 100), st.integers(2 ** 31 - 2, 2 ** 40), _json_any),
    "seed": st.one_of(st.integers(-2 ** 65, 2 ** 65), _json_any),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5), _json_any),
    "n": st.one_of(st.integers(-2, 4), _json_any),
    "k": st.one_of(st.integers(-3, 40), st.integers(2 ** 31 - 2, 2 ** 40), _json_any),
    "drafter": st.one_of(st.sampled_from(["ngram", "model", "nope", ""]), _json_any),
    "stream": st.one_of(st.booleans(), _json_any),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _json_any),
    "user": _json_any,
    "logprobs": _json_any,
    "presence_penalty": _json_any,
}


def _messages():
    role = st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot", ""])
    content = st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2), _json_any)
    message = st.one_of(st.fixed_dictionaries({"role": role, "content": content}), _json_any)
    return st.one_of(st.lists(message, max_size=3), _json_any)


def _prompt():
    # Ids beyond the vocabulary, and beyond int32 (the wire's type), as integers and as whole floats.
    beyond = st.one_of(st.integers(2 ** 31 - 2, 2 ** 40), st.integers(-2 ** 40, -2 ** 31 - 1))
    return st.one_of(st.text(max_size=30), st.lists(st.integers(-10, 70000), max_size=6),
                     st.lists(st.one_of(st.integers(0, 100), beyond, beyond.map(float)), min_size=1, max_size=3),
                     st.lists(st.text(max_size=5), max_size=3), _json_any)


@st.composite
def _body(draw, model: str, route: str) -> bytes:
    body: dict = {"model": draw(st.one_of(st.just(model), st.just(model + ":ngram"), st.text(max_size=10),
                                         _json_any))}
    if route.endswith("chat/completions"):
        body["messages"] = draw(_messages())
    else:
        body["prompt"] = draw(_prompt())
    body["max_tokens"] = draw(st.integers(1, 4))   # overwritten below when fuzzed
    for name in draw(st.sets(st.sampled_from(sorted(_FIELDS)), min_size=1, max_size=4)):
        body[name] = draw(_FIELDS[name])
    for name in draw(st.sets(st.sampled_from(["model", "messages", "prompt"]), max_size=1)):
        body.pop(name, None)   # a required field left out
    return json.dumps(body).encode()


def malformed_requests(model: str):
    """(method, path, body, content type) examples for a gateway serving `model`."""
    structured = st.sampled_from(ROUTES).flatmap(
        lambda route: _body(model, route).map(lambda body: ("POST", route, body, "application/json")))
    raw = st.tuples(st.just("POST"), st.sampled_from(ROUTES),
                    st.one_of(st.binary(max_size=64), _json_any.map(lambda v: json.dumps(v).encode()),
                              st.text(max_size=40).map(str.encode)),
                    st.sampled_from(["application/json", "text/plain", ""]))
    odd = st.tuples(st.sampled_from(["GET", "PUT", "DELETE", "POST"]),
                    st.sampled_from(["/v1/models", "/v1/models/x", "/v1/embeddings", "/", "/v1/chat/completions"]),
                    st.just(b""), st.just("application/json"))
    return st.one_of(structured, structured, raw, odd)
