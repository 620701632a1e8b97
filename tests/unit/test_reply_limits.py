"""Replies never echo unbounded input (issue 45 item 11): error messages are cut, and a
context of thousands of unread keys gets a few warnings and a count."""

from __future__ import annotations

import json

from sampan.serving.http import MAX_ERROR_CHARS, error
from sampan.serving.service import MAX_WARNINGS, _short


def test_a_long_error_message_is_cut_saying_so() -> None:
    reply = error(422, "bundle: " + "x" * 100_000 + " does not exist", "b" * 1000)
    body = json.loads(reply.body)
    assert len(body["error"]) < MAX_ERROR_CHARS + 100
    assert body["error"].endswith(f"(message cut at {MAX_ERROR_CHARS:,} of 100,023 characters)")
    assert len(body["field"]) == 203
    short = json.loads(error(400, "user_id: missing", "user_id").body)
    assert short == {"error": "user_id: missing", "field": "user_id", "record": None}


def test_a_quoted_value_is_cut() -> None:
    assert _short("abc") == "abc"
    assert _short("k" * 1000) == "k" * 200 + "... (1,000 characters)"
    assert MAX_WARNINGS == 20
