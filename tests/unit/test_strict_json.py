"""The serving body parser: what JSON the server takes, and what it says about the rest."""

from __future__ import annotations

import pytest

from sampan.serving.http import BodyError, strict_json

JSON = "application/json"


def test_plain_json_is_taken_as_json() -> None:
    assert strict_json(b'{"a": [1, 2.5, "x", null, true]}', "application/json") == \
        {"a": [1, 2.5, "x", None, True]}
    assert strict_json(b'{"a": 1}', "application/json; charset=UTF-8") == {"a": 1}
    assert strict_json(b'{"a": 1}', "application/vnd.api+json") == {"a": 1}
    assert strict_json(b'{"s": "[[[[{{{{"}', "application/json") == {"s": "[[[[{{{{"}
    deep = b"[" * 64 + b"]" * 64
    assert strict_json(deep, JSON) is not None  # 64 deep is allowed
    assert strict_json(b'["' + b"[" * 100 + b'"]', JSON) == ["[" * 100]  # in a string


@pytest.mark.parametrize("body,content_type,status,words", [
    (b'{"a": 1, "a": 2}', JSON, 422, "repeats the key 'a'"),
    (b'{"a": NaN}', JSON, 422, "holds NaN"),
    (b'{"a": Infinity}', JSON, 422, "holds Infinity"),
    (b'{"a": -1e999}', JSON, 422, "the number -1e999"),
    (b"[" * 65 + b"]" * 65, JSON, 422, "more than 64 deep"),
    (b'{"a": ' + b"1" * 4400 + b"}", JSON, 422, "more than 4,300 digits"),
    (b'{"a": 1', JSON, 422, "not valid JSON: Expecting ',' delimiter at character 7"),
    (b'{"a": "\xff"}', JSON, 422, "UTF-8 text expected"),
    (b'\xef\xbb\xbf{"a": 1}', JSON, 422, "byte-order mark"),
    (b'{"a": 1}', None, 415, "the request had no content-type"),
    (b'{"a": 1}', "text/plain", 415, "content-type 'text/plain'"),
    (b'{"a": 1}', "application/json; charset=utf-16", 415, "charset 'utf-16'"),
])
def test_the_rest_is_refused_saying_why(body, content_type, status, words) -> None:
    with pytest.raises(BodyError, match=words.replace("(", r"\(")) as e:
        strict_json(body, content_type)
    assert e.value.status == status
