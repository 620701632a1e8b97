"""Edge cases of the data pipeline found in review: each fails clearly or is handled."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sampan.config import DataConfig, load_config
from sampan.data.behaviour import BuildOptions, build_from_table
from sampan.data.sources import ColumnRoles, DataError, RejectLog, iter_source, read_source
from sampan.data.store import build_store


def test_prepare_refuses_a_folder_that_is_not_processed_data(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    cfg = load_config(raw={"preset": "criteo", "data": {"format": "synthetic",
                                                         "synthetic": {"rows": 500}}})
    with pytest.raises(DataError, match="refusing to overwrite"):
        build_store(cfg, tmp_path / "out", echo=lambda *_: None)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    build_store(cfg, tmp_path / "store", echo=lambda *_: None)
    build_store(cfg, tmp_path / "store", echo=lambda *_: None)  # a store may be rebuilt


def test_join_keys_are_normalised_and_missing_keys_match_nothing(tmp_path):
    main = tmp_path / "m.csv"
    main.write_text("label,uid\n1,1\n0, 2\n1,\n")
    side = tmp_path / "s.csv"
    side.write_text("uid,age\n1.0,30\n2,40\n,99\n")
    cfg = DataConfig(train=str(main), joins=[{"path": str(side), "by": "uid"}])
    roles = ColumnRoles(numeric=["label", "age"], categorical=["uid"], required=["label"])
    t = pa.concat_tables(read_source(cfg, str(main), roles, RejectLog(None)))
    assert t.column("age").to_pylist() == [30.0, 40.0, None]


def test_join_column_clashes_and_labels_from_side_tables_fail(tmp_path):
    main = tmp_path / "m.csv"
    main.write_text("label,uid,age\n1,1,5\n")
    side = tmp_path / "s.csv"
    side.write_text("uid,age,label\n1,30,0\n")
    cfg = DataConfig(train=str(main), joins=[{"path": str(side), "by": "uid"}])
    with pytest.raises(DataError, match="both in the main data and in a side table"):
        list(read_source(cfg, str(main), ColumnRoles(numeric=["label", "age"],
                                                     categorical=["uid"]), RejectLog(None)))
    main.write_text("uid\n1\n")
    with pytest.raises(DataError, match="labels must come from the main data"):
        list(read_source(cfg, str(main), ColumnRoles(numeric=["label"], categorical=["uid"],
                                                     labels=["label"]), RejectLog(None)))


def test_json_map_side_table_joins_list_values(tmp_path):
    """S3-Rec's item2attributes.json: one object {item: [attributes]}, gzipped or not,
    joined as a list column (a parquet side table's list column too)."""
    import gzip

    main = tmp_path / "m.csv"
    main.write_text("label,item\n1,4\n0,83\n1,999\n")
    side = tmp_path / "attrs.json.gz"
    with gzip.open(side, "wt") as f:
        json.dump({"4": [1, 2, 3], "83": [4], "165": []}, f)
    roles = ColumnRoles(numeric=["label"], categorical=["item"], lists=["attrs"],
                        required=["label"])
    join = {"path": str(side), "by": "item", "format": "json_map", "columns": ["item", "attrs"]}
    cfg = DataConfig(train=str(main), joins=[join])
    t = pa.concat_tables(read_source(cfg, str(main), roles, RejectLog(None)))
    assert t.column("attrs").to_pylist() == [["1", "2", "3"], ["4"], None]
    pq.write_table(pa.table({"item": ["4", "83"], "attrs": [["a", "b"], ["c"]]}),
                   tmp_path / "attrs.parquet")
    cfg = DataConfig(train=str(main), joins=[{"path": str(tmp_path / "attrs.parquet"),
                                              "by": "item"}])
    t = pa.concat_tables(read_source(cfg, str(main), roles, RejectLog(None)))
    assert t.column("attrs").to_pylist() == [["a", "b"], ["c"], None]
    bad = tmp_path / "list.json"
    bad.write_text("[1, 2]")
    cfg = DataConfig(train=str(main), joins=[{**join, "path": str(bad)}])
    with pytest.raises(DataError, match=r"holds a JSON list; format json_map expects one "
                       r"object \{key: value or \[values\]\}"):
        list(read_source(cfg, str(main), roles, RejectLog(None)))
    cfg = DataConfig(train=str(main), joins=[{**join, "columns": ["item"]}])
    with pytest.raises(DataError, match=r"has two columns \(the key and its values\); "
                       r"columns \['item'\] names 1"):
        list(read_source(cfg, str(main), roles, RejectLog(None)))


def test_jsonl_optional_keys_across_blocks(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"label": 1, "u": "a"}] * 50 + [{"label": 0, "u": "b", "price": 2.5}] * 50
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    roles = ColumnRoles(numeric=["label", "price"], categorical=["u"])
    t = pa.concat_tables(iter_source(DataConfig(train=str(p), block_size=500), [p], roles,
                                     RejectLog(None)))
    assert t.num_rows == 100
    assert t.column("price").to_pylist() == [None] * 50 + [2.5] * 50
    with pytest.raises(DataError, match="not found"):
        list(iter_source(DataConfig(train=str(p)), [p],
                         ColumnRoles(numeric=["label", "nope"]), RejectLog(None)))


def test_zstd_extension_and_spark_markers(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    with pa.output_stream(str(d / "part-0.csv.zstd"), compression="zstd") as f:
        f.write(b"label,c\n1,a\n0,b\n")
    (d / "_SUCCESS").write_text("")
    cfg = DataConfig(train=str(d), format="csv")
    t = pa.concat_tables(read_source(cfg, str(d), ColumnRoles(numeric=["label"],
                                                               categorical=["c"]),
                                     RejectLog(None)))
    assert t.column("c").to_pylist() == ["a", "b"]


def test_parquet_timestamps_as_time_numbers_and_nan_categories(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"label": [1, 0], "ts": pa.array([0, 60], pa.timestamp("s")),
                             "c": [1.5, float("nan")]}), p)
    roles = ColumnRoles(numeric=["label", "ts"], categorical=["c"])
    log = RejectLog(None)
    t = pa.concat_tables(iter_source(DataConfig(train=str(p)), [p], roles, log))
    assert log.rejected == 0
    assert t.column("ts").to_pylist() == [0.0, 60.0]
    assert t.column("c").to_pylist() == ["1.5", None]


def test_negatives_need_two_items():
    events = pa.table({"user_id": ["u", "u"], "item_id": ["A", "A"], "category_id": ["c", "c"],
                       "timestamp": [1.0, 2.0], "behavior": ["pv", "pv"]})
    with pytest.raises(DataError, match="at least two"):
        build_from_table(events, BuildOptions(negatives=1, targets="positive"))


def test_explicit_boundaries_with_separate_files_fail(tmp_path):
    for name in ("t", "v"):
        (tmp_path / f"{name}.csv").write_text("label,ts,c\n1,1,a\n0,2,b\n")
    cfg = load_config(raw={
        "data": {"train": str(tmp_path / "t.csv"), "valid": str(tmp_path / "v.csv"),
                 "split": {"method": "time", "column": "ts", "boundaries": [1, 2]}},
        "features": {"categorical": ["c"]}})
    with pytest.raises(DataError, match="leave boundaries out"):
        build_store(cfg, tmp_path / "s", echo=lambda *_: None)
