"""Checking a GenerateRequest (orchestrator/requests.py): each bound names its field."""
from __future__ import annotations

import pytest

from orchestrator.requests import MAX_STOP_CHARS, Limits, validate
from specmesh import wire
from specmesh.client import build_request
from specmesh.errors import InvalidArgument
from specmesh.v1 import sampling_pb2

LIMITS = Limits(max_context=512, vocab_size=50, max_k=8, default_k=4, default_max_new_tokens=64,
                drafters=frozenset({"ngram"}), default_drafter="ngram", max_prompt_tokens=100,
                max_total_tokens=200, max_stop_strings=3)


def _refused(request, prompt, limits=LIMITS) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        validate(request, prompt, limits)
    return info.value


def test_max_prompt_tokens():
    assert validate(build_request([1] * 100), [1] * 100, LIMITS).prompt_ids == [1] * 100
    error = _refused(build_request([1] * 101), [1] * 101)
    assert error.field == "prompt" and "max_prompt_tokens = 100" in error.message


def test_max_total_tokens_bounds_max_new_tokens_and_cuts_the_default():
    prompt = [1] * 90
    assert validate(build_request(prompt, max_new_tokens=110), prompt, LIMITS).max_new_tokens == 110
    error = _refused(build_request(prompt, max_new_tokens=111), prompt)
    assert error.field == "max_new_tokens" and "max_total_tokens = 200" in error.message
    prompt = [1] * 99
    unset = validate(build_request(prompt), prompt, Limits(**{**LIMITS.__dict__, "default_max_new_tokens": 500}))
    assert unset.max_new_tokens == 101
    # Unset limits leave only the context.
    free = Limits(**{**LIMITS.__dict__, "max_prompt_tokens": None, "max_total_tokens": None})
    assert validate(build_request([1] * 300, max_new_tokens=212), [1] * 300, free).max_new_tokens == 212


def test_stop_strings_are_bounded_in_number_and_length():
    assert validate(build_request("hi", stop=["a", "b", "c"]), [1], LIMITS).stop == ("a", "b", "c")
    assert _refused(build_request("hi", stop=["a"] * 4), [1]).field == "stop"
    assert _refused(build_request("hi", stop=[""]), [1]).field == "stop"
    assert _refused(build_request("hi", stop=["x" * (MAX_STOP_CHARS + 1)]), [1]).field == "stop"


def test_session_id_is_checked_and_optional():
    assert validate(build_request("hi", session_id="a:b-1"), [1], LIMITS).session_id == "a:b-1"
    assert len(validate(build_request("hi"), [1], LIMITS).session_id) == 32   # a random one
    assert _refused(build_request("hi", session_id="a\nb"), [1]).field == "session_id"
    assert _refused(build_request("hi", session_id="x" * 1_000_000), [1]).field == "session_id"


def test_a_prompt_that_encodes_to_nothing():
    assert _refused(build_request("\u200b"), []).field == "prompt"


def test_an_unknown_drafter_is_echoed_short():
    error = _refused(build_request("hi", drafter="m" * 100_000), [1])
    assert error.field == "drafter" and len(error.message) < 200


@pytest.mark.parametrize("fields, field", [
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": float("nan")}, "sampling.temperature"),
    ({"temperature": float("inf")}, "sampling.temperature"),
    ({"top_k": -1}, "sampling.top_k"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": float("nan")}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
])
def test_sampling_is_checked_where_every_tier_reads_it(fields, field):
    with pytest.raises(InvalidArgument) as info:
        wire.sampling_from_pb(sampling_pb2.SamplingParams(**fields))
    assert info.value.field == field


def test_extreme_but_finite_sampling_passes():
    for temperature in (1e-40, 1e-45, 3e38):
        assert wire.sampling_from_pb(sampling_pb2.SamplingParams(temperature=temperature)).temperature > 0
    assert wire.sampling_from_pb(sampling_pb2.SamplingParams(top_k=2**31 - 1, top_p=1e-45)).top_k == 2**31 - 1
