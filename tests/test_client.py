"""specmesh.client.Stream's resume decisions, against a scripted stub (the real
orchestrator side is in tests/test_resume.py and tests/test_soak.py)."""
from __future__ import annotations

import grpc
import pytest

from specmesh.client import Client, build_request
from specmesh.v1 import orchestrator_pb2

UNAVAILABLE, NOT_FOUND = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND


class _Error(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return self._code.name


class _Stub:
    """Each Generate call plays the next script: chunks, then an error code or a clean end."""

    def __init__(self, *scripts):
        self.scripts, self.calls = list(scripts), []

    def Generate(self, request, **kwargs):
        self.calls.append((request, kwargs))
        chunks, end = self.scripts.pop(0)

        def play():
            yield from chunks
            if end is not None:
                raise _Error(end)
        return play()


def _chunk(offset, tokens, finish=""):
    return orchestrator_pb2.GenerateChunk(session_id="s", offset=offset, token_ids=tokens, finish_reason=finish)


def _stream(stub):
    client = Client("localhost:1")   # never connects: the stub answers
    client.stub = stub
    return client.stream(build_request("hi", session_id="s"))


def test_broken_before_the_session_existed_it_is_started_again():
    stub = _Stub(([], UNAVAILABLE), ([], NOT_FOUND), ([_chunk(0, [1, 2], "length")], None))
    stream = _stream(stub)
    assert [list(c.token_ids) for c in stream] == [[1, 2]]
    requests = [r for r, _ in stub.calls]
    assert requests[1].HasField("resume_offset") and requests[1].resume_offset == 0
    assert requests[2] == requests[0] and stream.resumes == 1


def test_broken_before_its_first_chunk_it_resumes_from_0():
    stub = _Stub(([], UNAVAILABLE), ([_chunk(0, [1]), _chunk(1, [2], "stop")], None))
    assert [t for c in _stream(stub) for t in c.token_ids] == [1, 2]
    assert stub.calls[1][0].resume_offset == 0


def test_a_stream_that_never_starts_is_tried_twice_without_waiting_for_a_server():
    stub = _Stub(([], UNAVAILABLE), ([], UNAVAILABLE))
    with pytest.raises(grpc.RpcError) as error:
        list(_stream(stub))
    assert error.value.code() == UNAVAILABLE
    assert [kwargs["wait_for_ready"] for _, kwargs in stub.calls] == [False, False]


def test_losing_the_end_of_a_call_after_its_last_chunk_costs_nothing():
    stub = _Stub(([_chunk(0, [1, 2], "length")], UNAVAILABLE))
    stream = _stream(stub)
    assert [list(c.token_ids) for c in stream] == [[1, 2]]
    assert len(stub.calls) == 1 and stream.resumes == 0


def test_broken_mid_stream_it_resumes_at_its_offset_waiting_for_an_orchestrator():
    stub = _Stub(([_chunk(0, [1, 2])], UNAVAILABLE), ([_chunk(2, [3], "length")], None))
    assert [t for c in _stream(stub) for t in c.token_ids] == [1, 2, 3]
    request, kwargs = stub.calls[1]
    assert request.resume_offset == 2 and kwargs["wait_for_ready"]
