"""Reading raw files: formats, typing, bad-row quarantine and line numbers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sampan.config import DataConfig
from sampan.data.sources import LINE_COLUMN, ColumnRoles, DataError, RejectLog, iter_source

ROLES = ColumnRoles(numeric=["label", "x"], categorical=["c"], required=["label"])


def _read(cfg: DataConfig, path: Path, roles: ColumnRoles = ROLES,
          rejects: Path | None = None) -> tuple[pa.Table | None, RejectLog, list[pa.Table]]:
    log = RejectLog(rejects)
    tables = list(iter_source(cfg, [path], roles, log))
    log.close()
    return (pa.concat_tables(tables) if tables else None), log, tables


def _rejects(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ----------------------------------------------------------------------------- good files
GOOD_ROWS = [("1", "0.5", "a"), ("0", "", "b"), ("1", "-3e2", ""), ("0", "7", "日本")]
EXPECTED = {"label": [1.0, 0.0, 1.0, 0.0], "x": [0.5, None, -300.0, 7.0],
            "c": ["a", "b", None, "日本"]}


def _text(rows, delim: str, header: bool) -> str:
    lines = ([delim.join(["label", "x", "c"])] if header else []) + [delim.join(r) for r in rows]
    return "\n".join(lines) + "\n"


def _check_good(table: pa.Table, first_line: int) -> None:
    assert table.schema.field("label").type == pa.float64()
    assert table.schema.field("x").type == pa.float64()
    assert table.schema.field("c").type == pa.string()
    assert table.column_names == ["label", "x", "c", LINE_COLUMN]
    for k, v in EXPECTED.items():
        assert table.column(k).to_pylist() == v
    assert table.column(LINE_COLUMN).to_pylist() == list(range(first_line, first_line + 4))


def test_csv_with_header(tmp_path) -> None:
    p = tmp_path / "d.csv"
    p.write_text(_text(GOOD_ROWS, ",", True), encoding="utf-8")
    table, log, _ = _read(DataConfig(train=str(p)), p)
    _check_good(table, first_line=2)
    assert log.summary() == {"read": 4, "kept": 4, "rejected": 0, "reasons": {}, "blank_lines": 0}


def test_gzip_csv(tmp_path) -> None:
    p = tmp_path / "d.csv.gz"
    p.write_bytes(gzip.compress(_text(GOOD_ROWS, ",", True).encode("utf-8")))
    table, log, _ = _read(DataConfig(train=str(p)), p)
    _check_good(table, first_line=2)
    assert (log.read, log.kept) == (4, 4)


def test_plain_tsv_extension_detected(tmp_path) -> None:
    p = tmp_path / "d.tsv"
    p.write_text(_text(GOOD_ROWS, "\t", True), encoding="utf-8")
    table, _, _ = _read(DataConfig(train=str(p)), p)
    _check_good(table, first_line=2)


def test_headerless_tsv(tmp_path) -> None:
    p = tmp_path / "d.txt"
    p.write_text(_text(GOOD_ROWS, "\t", False), encoding="utf-8")
    cfg = DataConfig(train=str(p), columns=["label", "x", "c"], header=False, format="tsv")
    table, log, _ = _read(cfg, p)
    _check_good(table, first_line=1)
    assert (log.read, log.kept, log.rejected) == (4, 4, 0)


@pytest.mark.parametrize("header", [True, False])
def test_a_delimiter_of_several_characters(tmp_path, header) -> None:
    # MovieLens-1M's '::', gzipped; a single ':' inside a value stays in the value
    rows = [(*r[:2], "a:1") if r[2] == "a" else r for r in GOOD_ROWS]
    p = tmp_path / "ratings.dat.gz"
    p.write_bytes(gzip.compress(_text(rows, "::", header).encode("utf-8")))
    cols = {} if header else {"columns": ["label", "x", "c"]}
    table, log, _ = _read(DataConfig(train=str(p), format="csv", delimiter="::",
                                     header=header, **cols), p)
    assert table.column("c").to_pylist() == ["a:1", "b", None, "日本"]
    assert table.column("x").to_pylist() == EXPECTED["x"]
    assert table.column(LINE_COLUMN).to_pylist() == [k + header for k in range(1, 5)]
    assert (log.read, log.kept, log.rejected) == (4, 4, 0)


def test_a_delimiter_of_several_characters_rejects_by_line_as_written(tmp_path) -> None:
    p = tmp_path / "d.dat"
    p.write_text("1::2::a\n0::3\n1::x::b\n", encoding="utf-8")
    rej = tmp_path / "r.jsonl"
    cfg = DataConfig(train=str(p), format="csv", delimiter="::", header=False,
                     columns=["label", "x", "c"])
    table, log, _ = _read(cfg, p, rejects=rej)
    recs = {r["line"]: r for r in _rejects(rej)}
    assert {k: r["reason"] for k, r in recs.items()} == {
        2: "wrong_field_count", 3: "unparsable_number"}
    assert "0::3" in recs[2]["text"]  # the line as the file has it
    assert table.column("c").to_pylist() == ["a"]
    # a value holding the unit separator: the next free ASCII separator splits instead
    p.write_bytes(b"1::2::a\x1fb\n")
    assert _read(cfg, p)[0].column("c").to_pylist() == ["a\x1fb"]
    p.write_bytes(b"1::2::\x1c\x1d\x1e\x1f\n")
    with pytest.raises(DataError, match="every ASCII separator"):
        _read(cfg, p)
    # Latin-1 (MovieLens-1M's movies.dat), decoded before the delimiter is replaced
    p.write_bytes("1::2::Amélie\n".encode("latin-1"))
    latin = DataConfig(train=str(p), format="csv", delimiter="::", header=False,
                       columns=["label", "x", "c"], encoding="latin-1")
    assert _read(latin, p)[0].column("c").to_pylist() == ["Amélie"]
    with pytest.raises(ValueError, match="line break"):
        DataConfig(train=str(p), delimiter="\n")
    assert DataConfig(train=str(p), delimiter="\x1f").delimiter == "\x1f"


def test_extra_columns_are_not_read(tmp_path) -> None:
    p = tmp_path / "d.csv"
    p.write_text("id,label,junk,x,c\n1,1,zzz,2,a\n2,0,,3,b\n", encoding="utf-8")
    table, _, _ = _read(DataConfig(train=str(p)), p)
    assert table.column_names == ["label", "x", "c", LINE_COLUMN]
    assert table.column("x").to_pylist() == [2.0, 3.0]


def test_parquet(tmp_path) -> None:
    p = tmp_path / "d.parquet"
    t = pa.table({
        "label": pa.array([1, 0, None, 1, 0], pa.int64()),
        "x": pa.array([1.5, None, 2.0, 4.0, 1e-7], pa.float64()),
        "c": pa.array([3, 4, 5, None, 7], pa.int64()),
        "unused": ["p", "q", "r", "s", "t"],
    })
    pq.write_table(t, p, row_group_size=2)
    rej = tmp_path / "rej.jsonl"
    table, log, _ = _read(DataConfig(train=str(p)), p, rejects=rej)
    assert table.to_pydict() == {"label": [1.0, 0.0, 1.0, 0.0], "x": [1.5, None, 4.0, 1e-7],
                                 "c": ["3", "4", None, "7"], LINE_COLUMN: [1, 2, 4, 5]}
    assert log.summary() == {"read": 5, "kept": 4, "rejected": 1,
                             "reasons": {"missing_value": 1}, "blank_lines": 0}
    (r,) = _rejects(rej)
    assert (r["line"], r["reason"], r["column"]) == (3, "missing_value", "label")


# ----------------------------------------------------------------------------- bad rows
BAD_LINES = [
    b"label\tx\tc",            # 1 header
    b"1\t1.5\ta",              # 2 ok
    b"0\t2",                   # 3 too few fields
    b"1\t3\tb\textra",         # 4 too many fields
    b"0\tabc\tc",              # 5 unparsable number
    b"1\t4\t\xff\xfeq",        # 6 invalid UTF-8 in a categorical column
    b"\t5\td",                 # 7 missing label
    b"0\t\te",                 # 8 ok (x missing is fine)
    b"1\t-2.5e1\tf",           # 9 ok
    b"0\t1.2.3\tg",            # 10 unparsable number
    b"1\t8\th",                # 11 ok
]
BAD_EXPECTED = {3: "wrong_field_count", 4: "wrong_field_count", 5: "unparsable_number",
                6: "bad_encoding", 7: "missing_value", 10: "unparsable_number"}


def test_malformed_rows_counted_and_quarantined(tmp_path) -> None:
    p = tmp_path / "bad.tsv"
    p.write_bytes(b"\n".join(BAD_LINES) + b"\n")
    rej = tmp_path / "out" / "rejects.jsonl"
    table, log, _ = _read(DataConfig(train=str(p)), p, rejects=rej)
    assert dict(log.reasons) == {"wrong_field_count": 2, "unparsable_number": 2,
                                 "bad_encoding": 1, "missing_value": 1}
    assert log.read == 10 and log.kept == 4 and log.rejected == 6
    assert log.read == log.kept + log.rejected
    recs = _rejects(rej)
    assert {r["line"]: r["reason"] for r in recs} == BAD_EXPECTED
    assert len(recs) == len(BAD_EXPECTED)
    assert all(r["file"] == str(p) for r in recs)
    cols = {r["line"]: r["column"] for r in recs}
    assert (cols[5], cols[6], cols[7], cols[10]) == ("x", "c", "label", "x")
    assert table.column(LINE_COLUMN).to_pylist() == [2, 8, 9, 11]
    assert table.column("label").to_pylist() == [1.0, 0.0, 1.0, 1.0]
    assert table.column("x").to_pylist() == [1.5, None, -25.0, 8.0]
    assert table.column("c").to_pylist() == ["a", "e", "f", "h"]


def test_malformed_headerless_line_numbers(tmp_path) -> None:
    p = tmp_path / "bad.data"
    p.write_bytes(b"\n".join(BAD_LINES[1:]) + b"\n")
    rej = tmp_path / "r.jsonl"
    cfg = DataConfig(train=str(p), columns=["label", "x", "c"], header=False, format="tsv")
    table, log, _ = _read(cfg, p, rejects=rej)
    assert {r["line"]: r["reason"] for r in _rejects(rej)} == {
        k - 1: v for k, v in BAD_EXPECTED.items()}
    assert table.column(LINE_COLUMN).to_pylist() == [1, 7, 8, 10]
    assert log.read == log.kept + log.rejected == 10


def test_reject_log_without_path_still_counts(tmp_path) -> None:
    p = tmp_path / "bad.tsv"
    p.write_bytes(b"\n".join(BAD_LINES) + b"\n")
    _, log, _ = _read(DataConfig(train=str(p)), p, rejects=None)
    assert log.rejected == 6 and log.kept == 4


def test_max_bad_fraction_check(tmp_path) -> None:
    p = tmp_path / "d.csv"
    rows = [f"{i % 2},{i},c{i}" for i in range(19)] + ["1,notanumber,z"]
    p.write_text("label,x,c\n" + "\n".join(rows) + "\n")
    _, log, _ = _read(DataConfig(train=str(p)), p, rejects=tmp_path / "r.jsonl")
    assert (log.read, log.rejected) == (20, 1)  # 5 % bad
    log.check(0.05)  # exactly at the limit: allowed
    log.check(0.5)
    with pytest.raises(DataError, match="max_bad_fraction"):
        log.check(0.04)
    with pytest.raises(DataError, match="max_bad_fraction"):
        log.check(0.0)


def test_check_on_empty_log_passes() -> None:
    RejectLog(None).check(0.0)


# ----------------------------------------------------------------------- config errors
def test_missing_column_names_it(tmp_path) -> None:
    p = tmp_path / "d.csv"
    p.write_text("label,x\n1,2\n")
    with pytest.raises(DataError, match="'c'"):
        _read(DataConfig(train=str(p)), p)


def test_missing_column_parquet(tmp_path) -> None:
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"label": [1.0], "c": ["a"]}), p)
    with pytest.raises(DataError, match="'x'"):
        _read(DataConfig(train=str(p)), p)


def test_headerless_without_columns(tmp_path) -> None:
    p = tmp_path / "d.tsv"
    p.write_text("1\t2\ta\n")
    with pytest.raises(DataError, match="columns"):
        _read(DataConfig(train=str(p), header=False, format="tsv"), p)


# ---------------------------------------------------------------------- small blocks
@pytest.mark.parametrize("header", [True, False])
@pytest.mark.parametrize("gz", [False, True])
def test_small_blocks_keep_line_numbers(tmp_path, header, gz) -> None:
    rows, kept, bad = [], [], {}
    first = 2 if header else 1
    for i in range(400):
        line = first + i
        k = (i * 7919) % 23  # deterministic mix of good and bad rows
        if k == 0:
            rows.append(f"1\t{i}"); bad[line] = "wrong_field_count"  # noqa: E702
        elif k == 1:
            rows.append(f"1\t{i}\tc{i}\tz"); bad[line] = "wrong_field_count"  # noqa: E702
        elif k == 2:
            rows.append(f"1\tx{i}\tc{i}"); bad[line] = "unparsable_number"  # noqa: E702
        elif k == 3:
            rows.append(f"\t{i}\tc{i}"); bad[line] = "missing_value"  # noqa: E702
        else:
            rows.append(f"{i % 2}\t{i}\tc{i}")
            kept.append((line, i))
    text = ("label\tx\tc\n" if header else "") + "\n".join(rows) + "\n"
    p = tmp_path / ("d.tsv.gz" if gz else "d.tsv")
    p.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    cols = None if header else ["label", "x", "c"]
    cfg = DataConfig(train=str(p), header=header, columns=cols, format="tsv", block_size=64)
    rej = tmp_path / "r.jsonl"
    table, log, tables = _read(cfg, p, rejects=rej)
    assert len(tables) > 5  # several chunks were produced
    assert table.column(LINE_COLUMN).to_pylist() == [ln for ln, _ in kept]
    assert table.column("x").to_pylist() == [float(i) for _, i in kept]
    assert table.column("c").to_pylist() == [f"c{i}" for _, i in kept]
    assert {r["line"]: r["reason"] for r in _rejects(rej)} == bad
    assert log.read == 400 == log.kept + log.rejected
    assert log.kept == len(kept)


def test_utf8_bom_header(tmp_path) -> None:
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbflabel,x,c\n1,2,a\n")
    table, _, _ = _read(DataConfig(train=str(p)), p)
    assert table.column("label").to_pylist() == [1.0]


def test_parquet_typed_numbers_nan_is_missing_and_ints_are_read(tmp_path) -> None:
    path = tmp_path / "typed.parquet"
    pq.write_table(pa.table({"label": pa.array([1, 0, 1], pa.int8()),
                             "x": pa.array([1.5, float("nan"), None]),
                             "c": pa.array([7, 8, 7], pa.int64())}), path)
    log = RejectLog(None)
    roles = ColumnRoles(numeric=["label", "x"], categorical=["c"], required=["label"])
    t = pa.concat_tables(iter_source(DataConfig(train=str(path)), [path], roles, log))
    assert log.summary() == {"read": 3, "kept": 3, "rejected": 0, "reasons": {}, "blank_lines": 0}
    assert t.column("label").to_pylist() == [1.0, 0.0, 1.0]
    assert t.column("x").to_pylist() == [1.5, None, None]
    assert t.column("c").to_pylist() == ["7", "8", "7"]


# ---------------------------------------------------- every line accounted for (issue 13)
def _accounting_file(p: Path, n: int = 2013) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(3)
    rows = [f"{rng.integers(0, 2)},{rng.random():.3f},c{rng.integers(0, 40)}" for _ in range(n)]
    rows[100] = '1,"0.5,c3'  # an unbalanced quote: it used to swallow the lines after it
    rows[300] = '0,0.25,"c, quoted"'  # a quoted comma: one valid field
    rows[500] = rows[501] = ""  # blank lines
    rows[900] = '1,0.1,a"b"c'  # quotes inside an unquoted field are text
    rows[1200] = '1,0.7,"x""y"'  # an escaped quote
    rows[1500] = '0,0.2,"c5'  # another, with no closing quote anywhere after it
    p.write_text("label,x,c\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return rows


@pytest.mark.parametrize("block_size", [16 << 20, 4096])
def test_csv_every_line_is_accounted_for(tmp_path, block_size) -> None:
    p = tmp_path / "d.csv"
    rows = _accounting_file(p)
    rej = tmp_path / "rejects.jsonl"
    table, log, _ = _read(DataConfig(train=str(p), block_size=block_size), p, rejects=rej)
    assert log.read + log.blank == len(rows)  # the header aside, every line is counted
    assert log.summary() == {"read": 2011, "kept": 2009, "rejected": 2, "blank_lines": 2,
                             "reasons": {"unbalanced_quote": 2}}
    assert [(r["line"], r["reason"]) for r in _rejects(rej)] == [
        (102, "unbalanced_quote"), (1502, "unbalanced_quote")]
    lines = table.column(LINE_COLUMN).to_pylist()
    want = [i + 2 for i, r in enumerate(rows) if r and i not in (100, 1500)]
    assert lines == want  # each kept row carries its own physical line
    c = dict(zip(lines, table.column("c").to_pylist(), strict=True))
    assert (c[302], c[902], c[1202]) == ("c, quoted", 'a"b"c', 'x"y')


def test_a_line_longer_than_arrow_chunks_is_read_and_one_longer_than_the_block_rejected(
        tmp_path) -> None:
    p = tmp_path / "d.csv"
    p.write_text("label,x,c\n1,2,a\n0,3," + "y" * (5 << 20) + "\n1,4,b\n", encoding="utf-8")
    table, log, _ = _read(DataConfig(train=str(p)), p)  # 5 MB line, 16 MB blocks: read
    assert log.summary()["kept"] == 3 and len(table.column("c")[1].as_py()) == 5 << 20
    rej = tmp_path / "rejects.jsonl"
    table, log, _ = _read(DataConfig(train=str(p), block_size=1 << 20), p, rejects=rej)
    assert log.summary() == {"read": 3, "kept": 2, "rejected": 1, "blank_lines": 0,
                             "reasons": {"line_too_long": 1}}
    assert table.column(LINE_COLUMN).to_pylist() == [2, 4]
    bad = _rejects(rej)[0]
    assert bad["line"] == 3 and len(bad["text"]) < 1000 and "data.block_size" in bad["text"]
    p.write_text("".join(json.dumps({"label": i % 2, "x": i, "c": "y" * (
        (2 << 20) if i == 1 else 1)}) + "\n" for i in range(3)), encoding="utf-8")
    table, log, _ = _read(DataConfig(train=str(p), format="jsonl", block_size=1 << 20), p)
    assert log.summary()["reasons"] == {"line_too_long": 1}
    assert table.column(LINE_COLUMN).to_pylist() == [1, 3]
