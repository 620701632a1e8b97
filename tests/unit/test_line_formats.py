"""Line formats: JSON lines, libSVM / libFM and PaddleRec slot text.

Every test checks the typed values, the physical line numbers and that
``rows read = rows kept + rows rejected``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from sampan.config import DataConfig
from sampan.data.sources import LINE_COLUMN, ColumnRoles, DataError, RejectLog, iter_source

JSON_ROLES = ColumnRoles(numeric=["label", "x"], categorical=["c"], required=["label"],
                         labels=["label"], lists=["h"])


def _read(cfg: DataConfig, path: Path, roles: ColumnRoles,
          rejects: Path | None = None) -> tuple[pa.Table | None, RejectLog]:
    log = RejectLog(rejects)
    tables = list(iter_source(cfg, [path], roles, log))
    log.close()
    assert log.read == log.kept + log.rejected
    table = pa.concat_tables(tables) if tables else None
    assert (table.num_rows if table is not None else 0) == log.kept
    return table, log


def _rejects(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _lines(table: pa.Table) -> list[int]:
    return table.column(LINE_COLUMN).to_pylist()


# ------------------------------------------------------------------------------ JSON lines
JSON_GOOD = [
    {"label": 1, "x": 0.5, "c": "a", "h": ["i1", "i2"]},
    {"label": 0, "x": None, "c": "b", "h": []},
    {"label": 1, "x": 3, "c": None, "h": None},
    {"label": 0, "x": -2.25, "c": "日本", "h": ["i3"]},
]


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _check_json_good(table: pa.Table) -> None:
    assert table.schema.field("label").type == pa.float64()
    assert table.schema.field("x").type == pa.float64()
    assert table.schema.field("c").type == pa.string()
    assert table.column_names == ["label", "x", "c", "h", LINE_COLUMN]
    assert table.column("label").to_pylist() == [1.0, 0.0, 1.0, 0.0]
    assert table.column("x").to_pylist() == [0.5, None, 3.0, -2.25]
    assert table.column("c").to_pylist() == ["a", "b", None, "日本"]
    h = table.column("h").to_pylist()
    assert h[0] == ["i1", "i2"] and h[1] == [] and not h[2] and h[3] == ["i3"]


@pytest.mark.parametrize("name", ["d.jsonl", "d.ndjson", "d.json"])
def test_jsonl_typed_fields_and_lists(tmp_path, name) -> None:
    p = tmp_path / name
    p.write_text(_jsonl(JSON_GOOD), encoding="utf-8")
    table, log = _read(DataConfig(train=str(p)), p, JSON_ROLES)
    _check_json_good(table)
    assert _lines(table) == [1, 2, 3, 4]
    assert log.summary() == {"read": 4, "kept": 4, "rejected": 0, "reasons": {}, "blank_lines": 0}


def test_jsonl_explicit_format_any_extension(tmp_path) -> None:
    p = tmp_path / "d.log"
    p.write_text(_jsonl(JSON_GOOD), encoding="utf-8")
    table, _ = _read(DataConfig(train=str(p), format="jsonl"), p, JSON_ROLES)
    _check_json_good(table)


def test_jsonl_bad_lines_rejected_with_line_numbers(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    body = (json.dumps(JSON_GOOD[0]) + "\n"       # 1
            + "not json\n"                         # 2
            + json.dumps(JSON_GOOD[1]) + "\n"      # 3
            + "[1, 2]\n"                           # 4: JSON, but not an object
            + "\n"                                 # 5: empty, skipped
            + json.dumps(JSON_GOOD[3]) + "\n")     # 6
    p.write_text(body, encoding="utf-8")
    rej = tmp_path / "rejects.jsonl"
    table, log = _read(DataConfig(train=str(p)), p, JSON_ROLES, rej)
    assert _lines(table) == [1, 3, 6]
    assert table.column("c").to_pylist() == ["a", "b", "日本"]
    assert table.column("x").to_pylist() == [0.5, None, -2.25]
    assert log.summary() == {"read": 5, "kept": 3, "rejected": 2, "reasons": {"bad_json": 2},
                             "blank_lines": 1}
    recs = _rejects(rej)
    assert [(r["line"], r["reason"], r["text"]) for r in recs] == [
        (2, "bad_json", "not json"), (4, "bad_json", "[1, 2]")]
    assert all(r["file"] == str(p) for r in recs)


def test_jsonl_field_type_changes_between_lines(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"label": 1, "x": 1, "c": "a", "h": ["i1"]}\n'
                 '{"label": 0, "x": "2.5", "c": 5, "h": "i2"}\n'
                 '{"label": 1, "x": 7, "c": true, "h": ["i3", 4]}\n', encoding="utf-8")
    table, log = _read(DataConfig(train=str(p)), p, JSON_ROLES)
    assert log.summary()["kept"] == 3
    assert table.schema.field("x").type == pa.float64()
    assert table.schema.field("c").type == pa.string()
    assert table.column("x").to_pylist() == [1.0, 2.5, 7.0]
    c = table.column("c").to_pylist()
    assert c[:2] == ["a", "5"] and c[2] is not None
    assert table.column("h").to_pylist() == [["i1"], ["i2"], ["i3", "4"]]
    assert _lines(table) == [1, 2, 3]


def test_jsonl_bad_values_validated_like_text(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"label": 1, "x": 1, "c": "a", "h": []}\n'
                 '{"label": 2, "x": 1, "c": "b", "h": []}\n'
                 '{"label": 0, "x": "abc", "c": "b", "h": []}\n'
                 '{"label": null, "x": 1, "c": "b", "h": []}\n', encoding="utf-8")
    rej = tmp_path / "r.jsonl"
    table, log = _read(DataConfig(train=str(p)), p, JSON_ROLES, rej)
    assert _lines(table) == [1]
    assert log.reasons == {"label_out_of_range": 1, "unparsable_number": 1, "missing_value": 1}
    assert [(r["line"], r["reason"], r["column"]) for r in _rejects(rej)] == [
        (2, "label_out_of_range", "label"), (3, "unparsable_number", "x"),
        (4, "missing_value", "label")]
    # each written as its line is (a Kafka message, say), not as its fields joined
    assert [r["text"] for r in _rejects(rej)] == p.read_text().splitlines()[1:]
    # ... also when a block is parsed line by line (a field whose type changes)
    p.write_text('{"label": 1, "x": 1, "c": "a", "h": []}\n'
                 '{"label": 0, "x": "abc", "c": 5, "h": "i2"}\n', encoding="utf-8")
    _read(DataConfig(train=str(p)), p, JSON_ROLES, tmp_path / "r2.jsonl")
    assert [r["text"] for r in _rejects(tmp_path / "r2.jsonl")] == [
        '{"label": 0, "x": "abc", "c": 5, "h": "i2"}']


def test_jsonl_missing_column_names_it(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"label": 1, "x": 1, "h": []}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"\['c'\] not found"):
        _read(DataConfig(train=str(p)), p, JSON_ROLES)


@pytest.mark.parametrize("suffix,compression", [(".gz", "gzip"), (".zst", "zstd")])
def test_jsonl_compressed(tmp_path, suffix, compression) -> None:
    p = tmp_path / f"d.jsonl{suffix}"
    with pa.output_stream(str(p), compression=compression) as f:
        f.write(_jsonl(JSON_GOOD).encode("utf-8"))
    assert p.read_bytes()[:2] != b'{"'  # really compressed
    table, log = _read(DataConfig(train=str(p)), p, JSON_ROLES)
    _check_json_good(table)
    assert _lines(table) == [1, 2, 3, 4]
    assert log.summary()["read"] == 4


def test_jsonl_crlf_and_empty_lines(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    body = "\r\n".join(json.dumps(r) for r in JSON_GOOD[:2]) + "\r\n\r\n" \
        + json.dumps(JSON_GOOD[2]) + "\r\n\n" + json.dumps(JSON_GOOD[3])  # no final newline
    p.write_bytes(body.encode("utf-8"))
    table, log = _read(DataConfig(train=str(p)), p, JSON_ROLES)
    _check_json_good(table)
    assert _lines(table) == [1, 2, 4, 6]
    assert log.summary() == {"read": 4, "kept": 4, "rejected": 0, "reasons": {}, "blank_lines": 2}


def test_jsonl_whitespace_only_line(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(JSON_GOOD[0]) + "\n   \n" + json.dumps(JSON_GOOD[1]) + "\n")
    table, log = _read(DataConfig(train=str(p)), p, JSON_ROLES)
    assert table.column("c").to_pylist() == ["a", "b"]
    assert _lines(table) == [1, 3]


def test_jsonl_two_objects_on_one_line(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(JSON_GOOD[0]) + " " + json.dumps(JSON_GOOD[1]) + "\n"
                 + json.dumps(JSON_GOOD[3]) + "\n")
    table, log = _read(DataConfig(train=str(p)), p, JSON_ROLES)
    assert table.column("c").to_pylist()[-1] == "日本"
    assert _lines(table)[-1] == 2


def test_jsonl_small_blocks_keep_line_numbers(tmp_path) -> None:
    rows = [{"label": i % 2, "x": i, "c": f"c{i}", "h": [f"i{i}"]} for i in range(300)]
    text = [json.dumps(r) for r in rows]
    text[57] = "{broken"
    text[200] = ""
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(text) + "\n", encoding="utf-8")
    rej = tmp_path / "r.jsonl"
    table, log = _read(DataConfig(train=str(p), block_size=256), p, JSON_ROLES, rej)
    kept = [i for i in range(300) if i not in (57, 200)]
    assert _lines(table) == [i + 1 for i in kept]
    assert table.column("x").to_pylist() == [float(i) for i in kept]
    assert log.summary() == {"read": 299, "kept": 298, "rejected": 1, "reasons": {"bad_json": 1},
                             "blank_lines": 1}
    assert [r["line"] for r in _rejects(rej)] == [58]


# --------------------------------------------------------------------------------- libSVM
SVM_ROLES = ColumnRoles(numeric=["label"], categorical=["user", "item"], required=["label"],
                        labels=["label"], lists=["features", "values"])


def test_libsvm_labels_pairs_and_positional_columns(tmp_path) -> None:
    p = tmp_path / "d.libsvm"
    p.write_text("-1 3:0.5 7:1\n+1 2:1 9\n0 5:2.5\n1 1:1 4:1 6:1\n", encoding="utf-8")
    cfg = DataConfig(train=str(p), columns=["label", "user", "item"])
    table, log = _read(cfg, p, SVM_ROLES)
    assert table.schema.field("label").type == pa.float64()
    assert table.column("label").to_pylist() == [0.0, 1.0, 0.0, 1.0]
    assert table.column("features").to_pylist() == [["3", "7"], ["2", "9"], ["5"],
                                                    ["1", "4", "6"]]
    # "9" has no ":val": value 1
    assert table.column("values").to_pylist() == [["0.5", "1"], ["1", "1"], ["2.5"],
                                                  ["1", "1", "1"]]
    assert table.column("user").to_pylist() == ["3", "2", "5", "1"]
    assert table.column("item").to_pylist() == ["7", "9", None, "4"]
    assert _lines(table) == [1, 2, 3, 4]
    assert log.summary() == {"read": 4, "kept": 4, "rejected": 0, "reasons": {}, "blank_lines": 0}


def test_libsvm_default_label_column_and_label_only_line(tmp_path) -> None:
    p = tmp_path / "d.svm"
    p.write_text("1\n-1 3:1\n", encoding="utf-8")
    roles = ColumnRoles(numeric=["label"], required=["label"], labels=["label"],
                        lists=["features"])
    table, _ = _read(DataConfig(train=str(p)), p, roles)
    assert table.column("label").to_pylist() == [1.0, 0.0]
    assert table.column("features").to_pylist() == [[], ["3"]]


def test_libsvm_bad_labels_rejected(tmp_path) -> None:
    p = tmp_path / "d.libsvm"
    p.write_text("2 3:1\nabc 3:1\n0 3:1\n", encoding="utf-8")
    rej = tmp_path / "r.jsonl"
    table, log = _read(DataConfig(train=str(p), columns=["label", "user", "item"]), p,
                       SVM_ROLES, rej)
    assert _lines(table) == [3]
    assert log.reasons == {"label_out_of_range": 1, "unparsable_number": 1}
    assert [(r["line"], r["reason"], r["text"]) for r in _rejects(rej)] == [
        (1, "label_out_of_range", "2 3:1"), (2, "unparsable_number", "abc 3:1")]


def test_libsvm_crlf_empty_lines_and_extra_spaces(tmp_path) -> None:
    p = tmp_path / "d.libfm"
    p.write_bytes(b"1 3:1  8:2\r\n\r\n0\t4:1 \r\n\n1 5:1")
    table, log = _read(DataConfig(train=str(p), columns=["label", "user", "item"]), p,
                       SVM_ROLES)
    assert table.column("label").to_pylist() == [1.0, 0.0, 1.0]
    assert table.column("features").to_pylist() == [["3", "8"], ["4"], ["5"]]
    assert table.column("values").to_pylist() == [["1", "2"], ["1"], ["1"]]
    assert table.column("item").to_pylist() == ["8", None, None]
    assert _lines(table) == [1, 3, 5]
    assert log.summary() == {"read": 3, "kept": 3, "rejected": 0, "reasons": {}, "blank_lines": 2}


@pytest.mark.parametrize("suffix,compression", [(".gz", "gzip"), (".zst", "zstd")])
def test_libsvm_compressed(tmp_path, suffix, compression) -> None:
    p = tmp_path / f"d.libsvm{suffix}"
    with pa.output_stream(str(p), compression=compression) as f:
        f.write(b"-1 3:0.5 7:1\n+1 2:1 9\n")
    table, _ = _read(DataConfig(train=str(p), columns=["label", "user", "item"]), p, SVM_ROLES)
    assert table.column("label").to_pylist() == [0.0, 1.0]
    assert table.column("item").to_pylist() == ["7", "9"]


# ------------------------------------------------------------------------------ slot text
SLOT_TEXT = ("click:0 dense_feature:0.1 dense_feature:0.2 1:7 2:9\n"
             "click:1 dense_feature:0.3 1:8\n")


def test_slot_scalars_positional_and_missing(tmp_path) -> None:
    p = tmp_path / "d.txt"
    p.write_text(SLOT_TEXT, encoding="utf-8")
    roles = ColumnRoles(numeric=["click", "dense_feature_1", "dense_feature_2",
                                 "dense_feature_3"], categorical=["1", "2", "3"],
                        required=["click"], labels=["click"])
    table, log = _read(DataConfig(train=str(p), format="slot"), p, roles)
    assert table.column("click").to_pylist() == [0.0, 1.0]
    assert table.column("dense_feature_1").to_pylist() == [0.1, 0.3]
    assert table.column("dense_feature_2").to_pylist() == [0.2, None]
    assert table.column("dense_feature_3").to_pylist() == [None, None]
    assert table.schema.field("1").type == pa.string()
    assert table.column("1").to_pylist() == ["7", "8"]
    assert table.column("2").to_pylist() == ["9", None]  # missing slot -> null
    assert table.column("3").to_pylist() == [None, None]  # slot never present -> null
    assert _lines(table) == [1, 2]
    assert log.summary() == {"read": 2, "kept": 2, "rejected": 0, "reasons": {}, "blank_lines": 0}


def test_slot_scalar_is_first_value(tmp_path) -> None:
    p = tmp_path / "d.txt"
    p.write_text(SLOT_TEXT, encoding="utf-8")
    roles = ColumnRoles(numeric=["click", "dense_feature"], categorical=["1"],
                        required=["click"], labels=["click"])
    table, _ = _read(DataConfig(train=str(p), format="slot"), p, roles)
    assert table.column("dense_feature").to_pylist() == [0.1, 0.3]


def test_slot_list_column(tmp_path) -> None:
    p = tmp_path / "d.txt"
    p.write_text(SLOT_TEXT, encoding="utf-8")
    roles = ColumnRoles(numeric=["click", "dense_feature_2"], categorical=["1", "2"],
                        required=["click"], labels=["click"], lists=["dense_feature"])
    table, _ = _read(DataConfig(train=str(p), format="slot"), p, roles)
    assert table.column("dense_feature").to_pylist() == [["0.1", "0.2"], ["0.3"]]
    assert table.column("dense_feature_2").to_pylist() == [0.2, None]
    assert table.column("1").to_pylist() == ["7", "8"]


def test_slot_crlf_empty_lines_and_bad_rows(tmp_path) -> None:
    p = tmp_path / "d.slot"
    p.write_bytes(b"click:1 1:5\r\n\r\n1:6\r\nclick:x 1:7\r\nclick:0  1:8 \r\n\r\n")
    rej = tmp_path / "r.jsonl"
    roles = ColumnRoles(numeric=["click"], categorical=["1"], required=["click"],
                        labels=["click"])
    table, log = _read(DataConfig(train=str(p), format="slot"), p, roles, rej)
    assert table.column("click").to_pylist() == [1.0, 0.0]
    assert table.column("1").to_pylist() == ["5", "8"]
    assert _lines(table) == [1, 5]
    assert log.summary() == {"read": 4, "kept": 2, "rejected": 2,
                             "reasons": {"missing_value": 1, "unparsable_number": 1},
                             "blank_lines": 2}
    assert [(r["line"], r["reason"], r["column"]) for r in _rejects(rej)] == [
        (3, "missing_value", "click"), (4, "unparsable_number", "click")]


@pytest.mark.parametrize("suffix,compression", [(".gz", "gzip"), (".zst", "zstd")])
def test_slot_compressed_small_blocks(tmp_path, suffix, compression) -> None:
    rows = [f"click:{i % 2} 1:{i} 2:{i * 3}" for i in range(500)]
    p = tmp_path / f"d.slot{suffix}"
    with pa.output_stream(str(p), compression=compression) as f:
        f.write(("\n".join(rows) + "\n").encode())
    roles = ColumnRoles(numeric=["click"], categorical=["1", "2"], required=["click"],
                        labels=["click"])
    table, log = _read(DataConfig(train=str(p), format="slot", block_size=300), p, roles)
    assert table.column("1").to_pylist() == [str(i) for i in range(500)]
    assert table.column("2").to_pylist() == [str(3 * i) for i in range(500)]
    assert _lines(table) == list(range(1, 501))
    assert (log.read, log.kept) == (500, 500)


def test_slot_positional_values_first_and_another_delimiter(tmp_path) -> None:
    """Ali-CCP as PaddleRec's ESMM reads it: id, click, conversion, one skipped value, then
    field:feature pairs; a repeated field is a bag; "127_14" is a field of its own, not the
    14th value of field 127."""
    p = tmp_path / "d.txt"
    p.write_text("7,1,0,210:1,101:5,127:8,127:9,150_14:3,150_14:4\n"
                 "8,0,0,101:7,101:6, 127_14:2 ,bare,205:\n", encoding="utf-8")
    roles = ColumnRoles(numeric=["click", "ctcvr"], categorical=["sample_id"],
                        lists=["101", "127", "127_14", "150_14", "205"],
                        required=["click"], labels=["click", "ctcvr"])
    cfg = DataConfig(train=str(p), format="slot", delimiter=",",
                     columns=["sample_id", "click", "ctcvr", "skipped"])
    table, log = _read(cfg, p, roles)
    assert table.column("sample_id").to_pylist() == ["7", "8"]
    assert table.column("click").to_pylist() == [1.0, 0.0]
    assert table.column("ctcvr").to_pylist() == [0.0, 0.0]
    assert table.column("101").to_pylist() == [["5"], ["6"]]  # 101:7 is the skipped value
    assert table.column("127").to_pylist() == [["8", "9"], []]
    assert table.column("127_14").to_pylist() == [[], ["2"]]  # never value 14 of "127"
    assert table.column("150_14").to_pylist() == [["3", "4"], []]
    assert table.column("205").to_pylist() == [[], []]  # "205:" has no value
    assert "210" not in table.column_names  # the fourth value is positional, not read
    assert log.rejected == 0


def test_slot_empty_value_is_missing(tmp_path) -> None:
    p = tmp_path / "d.txt"
    p.write_text("click:1 1: 2:5\n", encoding="utf-8")
    roles = ColumnRoles(numeric=["click"], categorical=["1", "2"], required=["click"],
                        labels=["click"])
    table, _ = _read(DataConfig(train=str(p), format="slot"), p, roles)
    assert table.column("1").to_pylist() == [None] and table.column("2").to_pylist() == ["5"]
