"""Fuzzing the line formats (CSV, TSV, JSON lines, libSVM, slot files): whatever a file
holds, reading it either yields rows or raises DataError, and no line is lost: every line
after the header is a kept row, a rejected row or a blank line, and each kept row carries
its own line number.

``SAMPAN_FUZZ_EXAMPLES`` sets the bounded example count CI runs; the ``long_fuzz`` tests
(``pytest -m long_fuzz``) run 20 times as many."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sampan.config import DataConfig
from sampan.data.sources import LINE_COLUMN, ColumnRoles, DataError, RejectLog, iter_source
from tests.fuzz import EXAMPLES, fuzz

ROLES = ColumnRoles(numeric=["label", "x"], categorical=["c"], required=["label"])
SLOT_ROLES = ColumnRoles(numeric=["click"], categorical=["1", "2"], required=["click"])

# the characters that break parsers: delimiters, quotes, line breaks, escapes, non-ASCII
TRICKY = st.sampled_from(['"', "'", ",", "\t", " ", "\r", "\\", ":", "{", "}", "[", "]",
                          "é", "日", "\x00", "\ufeff", "0", "1", "-", ".", "e", "n", "i"])
field = st.one_of(st.text(TRICKY, max_size=6), st.sampled_from(
    ["", "0", "1", "0.5", "-3e2", "1e400", '"a,b"', '"x""y"', "null", "true"]),
    st.integers(-5, 5).map(str), st.floats(allow_nan=True).map(str))


def csv_lines(delimiter: str):  # type: ignore[no-untyped-def]
    row = st.lists(field, min_size=0, max_size=5).map(delimiter.join)
    return st.lists(st.one_of(row, st.just(""), st.just("1" + delimiter + "2" + delimiter +
                                                        "c")), max_size=40)


json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
              st.floats(allow_nan=False), st.text(TRICKY, max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["label", "x", "c", "k"]), inner,
                                            max_size=4)), max_leaves=8)
jsonl_line = st.one_of(json_value.map(json.dumps), st.text(TRICKY, max_size=10),
                       st.fixed_dictionaries({"label": st.sampled_from([0, 1, 0.5, 2, None]),
                                              "x": json_value, "c": json_value}).map(json.dumps))
token = st.one_of(st.text(TRICKY, max_size=5),
                  st.tuples(st.integers(0, 9), st.floats(allow_nan=True)).map(
                      lambda t: f"{t[0]}:{t[1]}"),
                  st.sampled_from(["1", "0", "1:1", "2:0.5", "click:1", "1:a", "2:b", ":"]))
token_line = st.lists(token, max_size=6).map(" ".join)


def read_all(fmt: str, text: bytes, roles: ColumnRoles, block_size: int, **cfg) -> None:
    """The invariants, on one file."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"f.{fmt}"
        path.write_bytes(text)
        log = RejectLog(Path(d) / "rejects.jsonl")
        config = DataConfig(train=str(path), format=fmt, block_size=block_size, **cfg)
        try:
            tables = list(iter_source(config, [path], roles, log))
        except DataError as e:
            assert str(e).strip()
            return
        finally:
            log.close()
        rejects = [json.loads(x) for x in (Path(d) / "rejects.jsonl").read_text(
            encoding="utf-8").splitlines()] if log.rejected else []
    lines = text.count(b"\n") + (bool(text) and not text.endswith(b"\n"))
    header = 1 if cfg.get("header") else 0
    kept = np.concatenate([t.column(LINE_COLUMN).to_numpy() for t in tables]) \
        if tables else np.array([], np.int64)
    assert log.kept == len(kept) and log.kept + log.rejected == log.read
    assert log.read + log.blank == max(lines - header, 0), (log.summary(), lines)
    assert len(rejects) == log.rejected
    used = np.concatenate([kept, [r["line"] for r in rejects]]).astype(np.int64)
    assert len(np.unique(used)) == len(used), "two rows claim the same line"
    assert ((used > header) & (used <= lines)).all()
    assert (np.diff(kept) > 0).all()


def check_csv(lines: list[str], delimiter: str, fmt: str, crlf: bool, block: int) -> None:
    end = "\r\n" if crlf else "\n"
    body = delimiter.join(["label", "x", "c"]) + end + end.join(lines) + (end if lines else "")
    read_all(fmt, body.encode("utf-8", "surrogatepass"), ROLES, block, header=True)


csv_case = dict(lines=csv_lines(","), crlf=st.booleans(), block=st.sampled_from([64, 4096]))
tsv_case = dict(lines=csv_lines("\t"), crlf=st.booleans(), block=st.sampled_from([64, 4096]))
jsonl_case = dict(lines=st.lists(jsonl_line, max_size=30), block=st.sampled_from([64, 4096]))
token_case = dict(lines=st.lists(token_line, max_size=30), block=st.sampled_from([64, 4096]))


def csv_body(lines, crlf, block):  # type: ignore[no-untyped-def]
    check_csv(lines, ",", "csv", crlf, block)


def tsv_body(lines, crlf, block):  # type: ignore[no-untyped-def]
    check_csv(lines, "\t", "tsv", crlf, block)


def jsonl_body(lines, block):  # type: ignore[no-untyped-def]
    read_all("jsonl", ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"), ROLES, block)


def libsvm_body(lines, block):  # type: ignore[no-untyped-def]
    roles = ColumnRoles(numeric=["label"], categorical=["f1", "f2"], required=["label"])
    read_all("libsvm", ("\n".join(lines) + "\n").encode(), roles, block,
             columns=["label", "f1", "f2"])


def slot_body(lines, block):  # type: ignore[no-untyped-def]
    read_all("slot", ("\n".join(lines) + "\n").encode(), SLOT_ROLES, block)


CASES = {"csv": (csv_body, csv_case), "tsv": (tsv_body, tsv_case),
         "jsonl": (jsonl_body, jsonl_case), "libsvm": (libsvm_body, token_case),
         "slot": (slot_body, token_case)}


@pytest.mark.parametrize("fmt", list(CASES))
def test_no_line_is_lost(fmt):
    body, case = CASES[fmt]
    fuzz(EXAMPLES)(given(**case)(body))()


@pytest.mark.long_fuzz
@pytest.mark.parametrize("fmt", list(CASES))
def test_no_line_is_lost_long(fmt):
    body, case = CASES[fmt]
    fuzz(EXAMPLES * 20)(given(**case)(body))()
