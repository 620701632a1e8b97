"""The data pipeline on the real datasets in ../shared/data (skipped when absent). Every
expected number is worked out here with plain Python over the raw files."""

import gzip
import json
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest

from sampan.config import load_config
from sampan.data.behaviour import BuildOptions, build_sequences
from sampan.data.store import Store, build_store
from sampan.train.experiment import run_experiment
from tests.conftest import ROOT

pytestmark = pytest.mark.realdata
FAST = ["train.epochs=1", "train.progress=false", "train.tensorboard=false"]


def test_movielens_100k_side_tables_genres_time_split(shared_data, tmp_path):
    ml = shared_data / "movielens" / "ml-100k"
    cfg = load_config(ROOT / "configs" / "movielens100k_deepfm.yaml", overrides=[
        f"data.train={ml / 'u.data'}", f"data.joins.0.path={ml / 'u.user'}",
        f"data.joins.1.path={ml / 'u.item'}", f"output_dir={tmp_path}", *FAST])
    results = run_experiment(cfg, run_dir=tmp_path / "run")
    store = Store.open(tmp_path / "run" / "data")
    m = store.manifest
    ratings = [line.split("\t") for line in (ml / "u.data").read_text().splitlines()]
    assert m["rejects"]["read"] == len(ratings) == 100_000
    assert sum(m["splits"][s]["rows"] for s in ("train", "valid", "test")) == 100_000
    # time split: train rows are exactly those before the first boundary
    b1, b2 = m["split"]["boundaries"]
    ts = np.array([float(r[3]) for r in ratings])
    assert m["splits"]["train"]["rows"] == int((ts < b1).sum())
    assert m["splits"]["test"]["rows"] == int((ts >= b2).sum())
    # labels: rating >= 4
    test_pos = sum(1 for r in ratings if float(r[3]) >= b2 and int(r[2]) >= 4)
    assert results["test"]["ctr"] == pytest.approx(test_pos / m["splits"]["test"]["rows"])
    # genres bag: ids set per row = genre flags of the row's movie (max_len 6)
    flags = {}
    for line in (ml / "u.item").read_bytes().decode("latin-1").splitlines():
        f = line.split("|")
        flags[f[0]] = sum(int(x) for x in f[5:24])
    want = sum(min(flags[r[1]], 6) for r in ratings if float(r[3]) < b1)
    genres = np.load(tmp_path / "run" / "data" / "train" / "seq_genres.npy")
    assert int((genres != 0).sum()) == want
    assert results["test"]["auc"] > 0.65


def test_taobao_behaviour_builder_histories(shared_data, tmp_path):
    path = shared_data / "taobao_userbehavior" / "UserBehavior_sample_96168.csv.gz"
    out = tmp_path / "samples.parquet"
    report = build_sequences(str(path), out, BuildOptions(
        columns=["user_id", "item_id", "category_id", "behavior", "timestamp"], header=False,
        max_len=5))
    with gzip.open(path, "rt") as f:
        events = [line.rstrip("\n").split(",") for line in f]
    assert report.events == report.samples == len(events) == 96_168
    by_user = defaultdict(list)
    for e in events:
        by_user[e[0]].append((int(e[4]), e[1]))
    t = pq.read_table(out).to_pydict()
    for user, item, ts, hist in zip(t["user_id"], t["item_id"], t["timestamp"],
                                    t["hist_item_id"], strict=True):
        # strictly before; equal timestamps keep file order (a stable sort)
        earlier = sorted(((s, i) for s, i in by_user[user] if s < ts), key=lambda e: e[0])
        assert hist == [i for _, i in earlier][-5:], (user, item, ts)
    assert report.users == len(by_user)


def _taobao_samples(shared_data, tmp_path):
    path = shared_data / "taobao_userbehavior" / "UserBehavior_sample_96168.csv.gz"
    out = tmp_path / "samples.parquet"
    report = build_sequences(str(path), out, BuildOptions(
        columns=["user_id", "item_id", "category_id", "behavior", "timestamp"], header=False,
        max_len=20, targets="positive", negatives=1))
    assert report.positives == report.negatives == 96_168
    return out


@pytest.mark.heavy  # DIN with dynamic tables below trains on the same samples by default
def test_taobao_din_with_vocabularies_trains_on_built_samples(shared_data, tmp_path):
    out = _taobao_samples(shared_data, tmp_path)
    cfg = load_config(ROOT / "configs" / "taobao_din.yaml", overrides=[
        f"data.train={out}", f"output_dir={tmp_path}", *FAST])
    results = run_experiment(cfg, run_dir=tmp_path / "run")
    assert results["test"]["gauc_groups"] > 0
    assert results["test"]["auc"] > 0.6


def test_taobao_din_trains_on_built_samples(shared_data, tmp_path):
    out = _taobao_samples(shared_data, tmp_path)
    # with dynamic tables: rows given while it trains, histories sharing them
    dyn = load_config(ROOT / "configs" / "taobao_din_dynamic.yaml", overrides=[
        f"data.train={out}", f"output_dir={tmp_path}", *FAST])
    assert dyn.features.categorical[1].dynamic.admit.min_count == 2
    results = run_experiment(dyn, run_dir=tmp_path / "dynamic")
    assert results["test"]["gauc_groups"] > 0 and results["test"]["auc"] > 0.6
    # exported with its frozen key -> row maps, histories included: served = predicted
    import numpy as np
    import pyarrow.parquet as pq

    from sampan import Experiment
    from sampan.export import export_run
    from sampan.serving import Predictor

    bundle = export_run(tmp_path / "dynamic", tmp_path / "bundle")
    part = pq.read_table(out).slice(150_000, 1000)
    pq.write_table(part, tmp_path / "part.parquet")
    want = Experiment.open(tmp_path / "dynamic").predict(str(tmp_path / "part.parquet"))
    served = Predictor(bundle)
    got = served.predict([{k: v for k, v in r.items() if k in served.columns}
                          for r in part.to_pylist()])
    assert np.abs(got - want).max() < 1e-5


def test_amazon_s3rec_sequences(shared_data, tmp_path):
    path = shared_data / "amazon_s3rec" / "Beauty.txt.gz"
    out = tmp_path / "beauty.parquet"
    report = build_sequences(str(path), out, BuildOptions(format="sequence_lines",
                                                          category=None, action=None,
                                                          max_len=10))
    with gzip.open(path, "rt") as f:
        lines = [line.split() for line in f]
    assert report.users == len(lines) == 22_363
    assert report.samples == sum(len(x) - 1 for x in lines) == 198_502
    t = pq.read_table(out).to_pydict()
    last = {}
    for user, hist, item in zip(t["user_id"], t["hist_item_id"], t["item_id"], strict=True):
        last[user] = (hist, item)
    for seq in lines[:2000]:
        hist, item = last[seq[0]]
        assert item == seq[-1] and hist == seq[1:-1][-10:]


def test_frappe_libfm_files(shared_data, tmp_path):
    fr = shared_data / "frappe"
    fields = ["user", "item", "daytime", "weekday", "isweekend", "homework", "cost",
              "weather", "country", "city"]
    cfg = load_config(raw={
        "name": "frappe", "output_dir": str(tmp_path),
        "data": {"train": str(fr / "frappe.validation.libfm.gz"),
                 "test": str(fr / "frappe.test.libfm.gz"), "format": "libsvm",
                 "columns": ["label", *fields],
                 "split": {"method": "random", "train": 0.9, "valid": 0.1, "test": 0.0}},
        "features": {"categorical": fields},
        "model": {"name": "fm", "embedding_dim": 8},
        "train": {"epochs": 2, "batch_size": 1024, "lr": 0.01, "progress": False,
                  "tensorboard": False}})
    results = run_experiment(cfg, run_dir=tmp_path / "run")
    m = Store.open(tmp_path / "run" / "data").manifest
    with gzip.open(fr / "frappe.test.libfm.gz", "rt") as f:
        test_labels = [line.split()[0] for line in f]
    assert m["splits"]["test"]["rows"] == len(test_labels) == 28_860
    assert m["rejects"]["read"] == 57_722 + 28_860
    assert results["test"]["ctr"] == pytest.approx(test_labels.count("1") / 28_860)
    assert results["test"]["auc"] > 0.9


def test_data_prepare_counts_match_manifest(shared_data, tmp_path):
    path = shared_data / "criteo" / "deepctr_criteo_sample.txt"
    cfg = load_config(raw={"preset": "criteo", "output_dir": str(tmp_path),
                           "data": {"train": str(path), "format": "csv", "header": True,
                                    "columns": None}})
    store = build_store(cfg, tmp_path / "data", echo=lambda *_: None)
    rows = path.read_text().splitlines()
    assert store.manifest["rejects"]["read"] == len(rows) - 1 == 200
    assert json.loads((tmp_path / "data" / "manifest.json").read_text())["fitted_on"]["rows"] \
        == store.manifest["splits"]["train"]["rows"]


def test_the_readme_example_prints_what_the_readme_shows(tmp_path):
    """configs/quickstart_ml100k.yaml as the README runs it: its test metrics match the
    table the README shows (within what threads and BLAS may change)."""
    import re

    if not (ROOT.parent / "shared" / "data" / "movielens" / "ml-100k").exists():
        pytest.skip("needs ../shared/data/movielens/ml-100k")
    cfg = load_config(ROOT / "configs" / "quickstart_ml100k.yaml",
                      overrides=["train.progress=false", "train.tensorboard=false"])
    results = run_experiment(cfg, run_dir=tmp_path / "run")
    shown = re.search(r"│ test  │ ([0-9.]+) │\s+([0-9.]+) │ ([0-9.]+) │",
                      (ROOT / "README.md").read_text())
    auc, logloss, gauc = (float(x) for x in shown.groups())
    assert results["test"]["auc"] == pytest.approx(auc, abs=0.005)
    assert results["test"]["logloss"] == pytest.approx(logloss, abs=0.005)
    assert results["test"]["gauc"] == pytest.approx(gauc, abs=0.005)
