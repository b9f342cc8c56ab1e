"""What any caller may send: session ids and message sizes."""
from __future__ import annotations

import pytest

from specmesh.bounds import MAX_SESSION_ID_CHARS, check_session_id, message_size_options, shown
from specmesh.errors import InvalidArgument


@pytest.mark.parametrize("session_id", ["a", "0f8fad5b-d9cb-469f-a165-70867728950e", "tenant:req.7_x",
                                        "x" * MAX_SESSION_ID_CHARS])
def test_session_ids_of_the_charset_pass(session_id):
    check_session_id(session_id)


@pytest.mark.parametrize("session_id, why", [
    ("", "must not be empty"),
    ("x" * (MAX_SESSION_ID_CHARS + 1), "129 characters"),
    ("x" * 1_000_000, "1000000 characters"),
    ("ok\n12:00:00 orchestrator INFO forged line", "characters of"),
    ("with space", "characters of"),
    ("naïve", "characters of"),
    ("a/b", "characters of"),
])
def test_other_session_ids_are_refused_naming_the_field(session_id, why):
    with pytest.raises(InvalidArgument) as info:
        check_session_id(session_id)
    assert info.value.field == "session_id" and why in info.value.message
    assert len(info.value.message) < 200          # a 1 MB id is not echoed back
    assert "\n" not in info.value.message         # nor is a newline


def test_shown_quotes_escapes_and_cuts():
    assert shown("a\nb") == "'a\\nb'"
    assert shown("x" * 100, limit=5) == "'xxxxx'..."


def test_message_size_options_cap_both_directions():
    assert dict(message_size_options(1234)) == {"grpc.max_receive_message_length": 1234,
                                                "grpc.max_send_message_length": 1234}
