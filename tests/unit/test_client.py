"""The Python client's argument checks (issue 45 item 14): rank takes the context first, as
recommend does, and a call in the other order says so instead of a TypeError about
'multiple values'."""

from __future__ import annotations

import pytest

from sampan.client import Client, _rank_arguments


def test_rank_takes_the_context_first_like_recommend() -> None:
    assert _rank_arguments({"user_id": "u1"}, ["i1", "i2"]) == ({"user_id": "u1"}, ["i1", "i2"])
    assert _rank_arguments(None, ("i1",)) == ({}, ["i1"])
    with pytest.raises(TypeError, match=r"the context comes first.*rank\(\{'user_id'"):
        _rank_arguments(["i1", "i2"], {"user_id": "u1"})
    with pytest.raises(TypeError, match="candidates must be a list of item ids, got str"):
        _rank_arguments({"user_id": "u1"}, "i1")
    with pytest.raises(TypeError, match="context must be a mapping"):
        _rank_arguments("u1", ["i1"])


def test_the_natural_keyword_call_binds() -> None:
    """``rank(context, candidates=...)`` (the call a new user tried first) binds; nothing
    is sent before the arguments are checked."""
    c = Client("http://127.0.0.1:9")  # nothing listens there: the check comes first
    with pytest.raises(TypeError, match="candidates must be a list"):
        c.rank({"user_id": "u1"}, candidates="i1")
