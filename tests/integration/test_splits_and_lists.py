"""End to end: time and group splits, and list features (DIN history, DeepFM bag).

The expected splits and ids are recomputed here with numpy from the generated rows; the
stored arrays are read back from ``<run>/data``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sampan.config import load_config
from sampan.data.sources import DataError
from sampan.data.store import build_store
from sampan.train.experiment import run_experiment

SPLITS = ("train", "valid", "test")
HEADER = "label,ts,user,uid_num,item,hist_item,genres,x\n"
GENRES = ["action", "comedy", "drama", "horror", "sci-fi", "romance"]


def make_rows(n: int, seed: int, ts: np.ndarray | None = None, users: int = 40,
              items: int = 50) -> dict[str, list]:
    """Rows with a timestamp, a user (also as a number), an item, a history of items (some
    only ever seen in histories: ``h0`` .. ``h9``) and a bag of genres."""
    rng = np.random.default_rng(seed)
    if ts is None:
        ts = rng.integers(0, 200, n)  # many ties
    uid = rng.integers(0, users, n)
    item = rng.integers(0, items, n)
    hist, genres = [], []
    for _ in range(n):
        k = int(rng.integers(0, 9))
        pool = [f"i{j}" for j in rng.integers(0, items, k)]
        if k and rng.random() < 0.3:
            pool[int(rng.integers(0, k))] = f"h{int(rng.integers(0, 10))}"
        hist.append(pool)
        g = rng.choice(len(GENRES), size=int(rng.integers(0, 5)), replace=False)
        genres.append([GENRES[j] for j in g])
    label = (rng.random(n) < 0.2 + 0.5 * (item % 2)).astype(int)
    return {"label": label.tolist(), "ts": [int(t) for t in ts], "user": [f"u{u}" for u in uid],
            "uid_num": uid.tolist(), "item": [f"i{j}" for j in item], "hist": hist,
            "genres": genres, "x": rng.normal(size=n).round(3).tolist()}


def write_csv(path: Path, rows: dict[str, list]) -> Path:
    lines = [HEADER]
    for k in range(len(rows["label"])):
        lines.append(f"{rows['label'][k]},{rows['ts'][k]},{rows['user'][k]},"
                     f"{rows['uid_num'][k]},{rows['item'][k]},{'|'.join(rows['hist'][k])},"
                     f"{'|'.join(rows['genres'][k])},{rows['x'][k]}\n")
    path.write_text("".join(lines))
    return path


def base_config(tmp_path: Path, train: Path, split: dict, model: dict | None = None,
                **data) -> dict:
    return {
        "output_dir": str(tmp_path / "runs"),
        "data": {"train": str(train), "split": split, **data},
        # raw numbers (no transform, no bucket twin): the tests read splits back from them
        "features": {"numeric": ["x"], "categorical": ["item"],
                     "numeric_defaults": {"log1p": False, "standardize": False, "buckets": 0}},
        "model": model or {"name": "lr"},
        "train": {"epochs": 1, "batch_size": 128, "progress": False, "tensorboard": False,
                  "prefetch": 1},
    }


def manifest(run: Path) -> dict:
    return json.loads((run / "data" / "manifest.json").read_text())


def split_array(run: Path, split: str, name: str) -> np.ndarray | None:
    p = run / "data" / split / f"{name}.npy"
    return np.load(p) if p.exists() else None


def load_vocab(run: Path, name: str) -> list[str]:
    """A fitted vocabulary straight from its .npy files (id = 2 + position)."""
    d = run / "data" / "pipeline"
    offsets = np.load(d / f"vocab_{name}.offsets.npy")
    data = np.load(d / f"vocab_{name}.bytes.npy").tobytes()
    return [data[a:b].decode("utf-8") for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def expected_ids(values: list[list[str]], vocab: list[str], max_len: int) -> np.ndarray:
    index = {v: k + 2 for k, v in enumerate(vocab)}
    out = np.zeros((len(values), max_len), dtype=np.int64)
    for r, row in enumerate(values):
        ids = [index.get(v, 1) for v in row][-max_len:]
        if ids:
            out[r, max_len - len(ids):] = ids
    return out


# ------------------------------------------------------------------------------ time split
def test_time_split_orders_rows_by_timestamp(tmp_path) -> None:
    n = 600
    rows = make_rows(n, seed=1)
    train = write_csv(tmp_path / "t.csv", rows)
    raw = base_config(tmp_path, train, {"method": "time", "column": "ts", "train": 0.7,
                                        "valid": 0.15, "test": 0.15})
    # the timestamp is also a feature, so the split's rows can be read back from dense.npy
    raw["features"]["numeric"] = [{"name": "ts_num", "column": "ts"}, "x"]
    run = tmp_path / "r"
    results = run_experiment(load_config(raw=raw), run_dir=run)
    assert results["steps"] > 0

    ts = np.asarray(rows["ts"], dtype=np.float64)
    b1, b2 = np.quantile(ts, [0.7, 0.85])
    expected = {"train": ts[ts < b1], "valid": ts[(ts >= b1) & (ts < b2)], "test": ts[ts >= b2]}
    m = manifest(run)
    assert m["split"]["method"] == "time" and m["split"]["column"] == "ts"
    assert m["split"]["boundaries"] == pytest.approx([b1, b2])
    got = {}
    for s in SPLITS:
        assert m["splits"][s]["rows"] == len(expected[s]) > 0
        dense = split_array(run, s, "dense")
        assert dense.shape == (len(expected[s]), 2)
        got[s] = dense[:, 0].astype(np.float64)
        np.testing.assert_array_equal(np.sort(got[s]), np.sort(expected[s]))
    assert got["train"].max() < got["valid"].min()
    assert got["valid"].max() < got["test"].min()
    assert sum(m["splits"][s]["rows"] for s in SPLITS) == n
    assert m["fitted_on"]["rows"] == len(expected["train"])


def test_time_split_explicit_boundaries(tmp_path) -> None:
    rows = make_rows(400, seed=2)
    train = write_csv(tmp_path / "t.csv", rows)
    raw = base_config(tmp_path, train, {"method": "time", "column": "ts",
                                        "boundaries": [50, 150]})
    raw["features"]["numeric"] = [{"name": "ts_num", "column": "ts"}]
    store = build_store(load_config(raw=raw), tmp_path / "data", echo=lambda *a: None)
    ts = np.asarray(rows["ts"])
    expected = {"train": ts[ts < 50], "valid": ts[(ts >= 50) & (ts < 150)],
                "test": ts[ts >= 150]}
    assert store.manifest["split"]["boundaries"] == [50.0, 150.0]
    for s in SPLITS:
        assert store.manifest["splits"][s]["rows"] == len(expected[s])
        np.testing.assert_array_equal(np.sort(store.split(s).dense[:, 0]),
                                      np.sort(expected[s]).astype(np.float32))


def test_time_split_overlapping_files_fail(tmp_path) -> None:
    train = write_csv(tmp_path / "t.csv", make_rows(200, seed=3, ts=np.arange(0, 200)))
    valid = write_csv(tmp_path / "v.csv", make_rows(50, seed=4, ts=np.arange(150, 200)))
    raw = base_config(tmp_path, train, {"method": "time", "column": "ts"}, valid=str(valid))
    with pytest.raises(DataError, match="strictly before"):
        run_experiment(load_config(raw=raw), run_dir=tmp_path / "r")
    # touching is overlapping too: train ends at 199, valid starts at 199
    valid.unlink()
    write_csv(valid, make_rows(50, seed=4, ts=np.arange(199, 249)))
    with pytest.raises(DataError, match="train must be strictly before valid"):
        build_store(load_config(raw=raw), tmp_path / "d", echo=lambda *a: None)


def test_time_split_ordered_files_train_valid(tmp_path) -> None:
    train = write_csv(tmp_path / "t.csv", make_rows(200, seed=3, ts=np.arange(0, 200)))
    valid = write_csv(tmp_path / "v.csv", make_rows(50, seed=4, ts=np.arange(200, 250)))
    test = write_csv(tmp_path / "e.csv", make_rows(50, seed=5, ts=np.arange(250, 300)))
    raw = base_config(tmp_path, train, {"method": "time", "column": "ts"}, valid=str(valid),
                      test=str(test))
    store = build_store(load_config(raw=raw), tmp_path / "d", echo=lambda *a: None)
    assert store.manifest["splits"]["valid"]["rows"] == 50
    assert store.manifest["splits"]["test"]["rows"] == 50


def test_time_split_explicit_files_keep_every_train_row(tmp_path) -> None:
    ts = np.array([1, 2, 3, 3, 4, 5, 5, 5] * 10)
    train = write_csv(tmp_path / "t.csv", make_rows(len(ts), seed=3, ts=ts))
    valid = write_csv(tmp_path / "v.csv", make_rows(20, seed=4, ts=np.full(20, 6)))
    test = write_csv(tmp_path / "e.csv", make_rows(20, seed=5, ts=np.full(20, 7)))
    raw = base_config(tmp_path, train, {"method": "time", "column": "ts"}, valid=str(valid),
                      test=str(test))
    store = build_store(load_config(raw=raw), tmp_path / "d", echo=lambda *a: None)
    assert store.manifest["splits"]["train"]["rows"] == len(ts)


def test_time_split_valid_file_with_carved_test_is_refused(tmp_path) -> None:
    train = write_csv(tmp_path / "t.csv", make_rows(200, seed=3, ts=np.arange(0, 200)))
    valid = write_csv(tmp_path / "v.csv", make_rows(50, seed=4, ts=np.arange(200, 250)))
    raw = base_config(tmp_path, train, {"method": "time", "column": "ts"}, valid=str(valid))
    raw["features"]["numeric"] = [{"name": "ts_num", "column": "ts"}]
    # carving test from the train source would put it before validation: refused
    with pytest.raises(DataError, match="give data.test"):
        build_store(load_config(raw=raw), tmp_path / "d", echo=lambda *a: None)


# ----------------------------------------------------------------------------- group split
def test_group_split_keeps_each_user_in_one_split(tmp_path) -> None:
    n = 800
    rows = make_rows(n, seed=6, users=40)
    train = write_csv(tmp_path / "t.csv", rows)
    raw = base_config(tmp_path, train, {"method": "group", "column": "user", "train": 0.6,
                                        "valid": 0.2, "test": 0.2})
    raw["features"]["numeric"] = [{"name": "uid_f", "column": "uid_num"}, "x"]
    raw["features"]["group"] = "user"
    run = tmp_path / "r"
    results = run_experiment(load_config(raw=raw), run_dir=run)
    assert results["steps"] > 0 and "gauc" in results["test"]

    uid = np.asarray(rows["uid_num"])
    total = np.bincount(uid, minlength=40)
    m = manifest(run)
    assert m["split"]["method"] == "group"
    seen: dict[str, set[int]] = {}
    groups: dict[str, set[int]] = {}
    for s in SPLITS:
        dense = split_array(run, s, "dense")
        assert dense.shape[0] == m["splits"][s]["rows"] > 0
        u = dense[:, 0].astype(np.int64)
        np.testing.assert_array_equal(dense[:, 0], u)  # standardize is off: raw user numbers
        seen[s] = set(u.tolist())
        # every row of each of its users is there
        np.testing.assert_array_equal(np.bincount(u, minlength=40)[sorted(seen[s])],
                                      total[sorted(seen[s])])
        g = split_array(run, s, "group")
        assert g.shape == (dense.shape[0],)
        groups[s] = set(g.tolist())
        assert len(groups[s]) == len(seen[s])
    assert sum(m["splits"][s]["rows"] for s in SPLITS) == n
    assert seen["train"] | seen["valid"] | seen["test"] == set(range(40))
    for a, b in (("train", "valid"), ("train", "test"), ("valid", "test")):
        assert not seen[a] & seen[b], (a, b)
        assert not groups[a] & groups[b], (a, b)


def test_group_split_independent_of_chunking_and_seeded(tmp_path) -> None:
    rows = make_rows(500, seed=7, users=30)
    train = write_csv(tmp_path / "t.csv", rows)

    def users_per_split(block_size: int, seed: int) -> dict[str, set[int]]:
        raw = base_config(tmp_path, train, {"method": "group", "column": "user", "seed": seed},
                          block_size=block_size)
        raw["features"]["numeric"] = [{"name": "uid_f", "column": "uid_num"}]
        store = build_store(load_config(raw=raw), tmp_path / f"d{block_size}_{seed}",
                            echo=lambda *a: None)
        return {s: (set() if store.split(s) is None
                    else set(store.split(s).dense[:, 0].astype(int).tolist())) for s in SPLITS}

    a, b = users_per_split(1 << 20, 0), users_per_split(2048, 0)
    assert a == b
    assert users_per_split(1 << 20, 1) != a


# ---------------------------------------------------------------------------- list features
def _check_sequences(run: Path, name: str, table: str, max_len: int,
                     raw_lists: list[list[str]], own: bool) -> None:
    m = manifest(run)
    schema = m["schema"]
    tables = {t["name"]: t["cardinality"] for t in schema["sparse"] + schema["own_tables"]}
    spec = {s["name"]: s for s in schema["sequences"]}[name]
    assert spec["max_len"] == max_len and spec["table"] == table
    assert (name in {t["name"] for t in schema["own_tables"]}) == own
    vocab = load_vocab(run, table)
    assert tables[table] == 2 + len(vocab)
    start = 0
    for s in SPLITS:
        nrows = m["splits"][s]["rows"]
        seq = split_array(run, s, f"seq_{name}")
        assert seq.shape == (nrows, max_len) and seq.dtype in (np.int32, np.int64)  # int32 on disk
        assert seq.min() >= 0 and seq.max() < tables[table]
        # sequential split: the splits are consecutive slices of the file
        np.testing.assert_array_equal(seq, expected_ids(raw_lists[start:start + nrows], vocab,
                                                        max_len))
        start += nrows
    assert start == len(raw_lists)


def test_din_with_shared_history(tmp_path) -> None:
    rows = make_rows(600, seed=8)
    train = write_csv(tmp_path / "t.csv", rows)
    raw = base_config(tmp_path, train, {"train": 0.8, "valid": 0.1, "test": 0.1},
                      model={"name": "din", "embedding_dim": 4, "mlp": [8],
                             "attention_mlp": [8]})
    raw["features"]["categorical"] = ["user", "item"]
    raw["features"]["lists"] = [{"name": "hist", "column": "hist_item", "share": "item",
                                 "delimiter": "|", "max_len": 5}]
    run = tmp_path / "r"
    results = run_experiment(load_config(raw=raw), run_dir=run)
    assert results["steps"] > 0 and np.isfinite(results["test"]["logloss"])
    _check_sequences(run, "hist", "item", 5, rows["hist"], own=False)
    # the shared vocabulary was fitted on train items AND train histories only
    n_train = manifest(run)["splits"]["train"]["rows"]
    train_values = set(rows["item"][:n_train]) | {v for h in rows["hist"][:n_train] for v in h}
    vocab = load_vocab(run, "item")
    assert set(vocab) == train_values
    assert any(v.startswith("h") for v in vocab)  # seen only in histories, still has an id
    assert not (run / "data" / "pipeline" / "vocab_hist.offsets.npy").exists()


def test_deepfm_with_genre_bag(tmp_path) -> None:
    rows = make_rows(500, seed=9)
    train = write_csv(tmp_path / "t.csv", rows)
    raw = base_config(tmp_path, train, {"train": 0.8, "valid": 0.1, "test": 0.1},
                      model={"name": "deepfm", "embedding_dim": 4, "mlp": [8]})
    raw["features"]["categorical"] = ["user", "item"]
    raw["features"]["lists"] = [{"name": "genres", "kind": "bag", "delimiter": "|",
                                 "max_len": 3}]
    run = tmp_path / "r"
    results = run_experiment(load_config(raw=raw), run_dir=run)
    assert results["steps"] > 0 and np.isfinite(results["test"]["logloss"])
    _check_sequences(run, "genres", "genres", 3, rows["genres"], own=True)
    spec = manifest(run)["schema"]["sequences"][0]
    assert spec["pooling"] == "mean"
    n_train = manifest(run)["splits"]["train"]["rows"]
    assert set(load_vocab(run, "genres")) == {g for r in rows["genres"][:n_train] for g in r}


# ------------------------------------------------------------------------ leave one out
def _loo_expected(users: list[str], ts: list[int] | None) -> dict[str, set[int]]:
    """Plain Python: each user's rows by (time, file order); with 3 or more, the last is
    test and the one before it valid."""
    by_user: dict[str, list[int]] = {}
    for r, u in enumerate(users):
        by_user.setdefault(u, []).append(r)
    out: dict[str, set[int]] = {"train": set(), "valid": set(), "test": set()}
    for rows in by_user.values():
        rows = sorted(rows, key=lambda r: (ts[r] if ts else 0, r))
        if len(rows) >= 3:
            out["test"].add(rows[-1])
            out["valid"].add(rows[-2])
            rows = rows[:-2]
        out["train"].update(rows)
    return out


@pytest.mark.parametrize("order", ["ts", None])
def test_leave_one_out_takes_each_users_last_rows(tmp_path, order) -> None:
    rows = make_rows(700, seed=11, users=120)  # some users with 1 or 2 rows, many ties
    rows["x"] = list(range(700))  # the row index, read back from each split
    train = write_csv(tmp_path / "t.csv", rows)
    split = {"method": "leave_one_out", "column": "user", **({"order": order} if order else {})}
    raw = base_config(tmp_path, train, split, block_size=2000)  # many chunks
    store = build_store(load_config(raw=raw), tmp_path / "d", echo=lambda *a: None)
    want = _loo_expected(rows["user"], rows["ts"] if order else None)
    assert len(want["test"]) < 120 and len(want["train"]) > 3 * len(want["test"])
    for s in SPLITS:
        got = store.split(s).dense[:, 0].astype(int).tolist()
        assert sorted(got) == sorted(want[s]), s
    assert store.manifest["split"]["method"] == "leave_one_out"
    assert store.manifest["split"]["order"] == order


def test_leave_one_out_is_refused_with_own_files_and_needs_users_with_three_rows(tmp_path):
    rows = make_rows(50, seed=1)
    train = write_csv(tmp_path / "t.csv", rows)
    with pytest.raises(Exception, match="leave_one_out takes valid and test rows from data"):
        load_config(raw=base_config(tmp_path, train, {"method": "leave_one_out",
                                                      "column": "user"}, test=str(train)))
    with pytest.raises(Exception, match="needs split.column \\(the user column\\)"):
        load_config(raw=base_config(tmp_path, train, {"method": "leave_one_out"}))
    with pytest.raises(Exception, match="split.order orders each user's rows"):
        load_config(raw=base_config(tmp_path, train, {"method": "time", "column": "ts",
                                                      "order": "ts"}))
    one_each = make_rows(30, seed=2, users=40)
    one_each["user"] = [f"u{i}" for i in range(30)]
    few = write_csv(tmp_path / "f.csv", one_each)
    with pytest.raises(DataError, match="no value of 'user' has 3 rows or more"):
        build_store(load_config(raw=base_config(tmp_path, few, {
            "method": "leave_one_out", "column": "user"})), tmp_path / "d",
            echo=lambda *a: None)
