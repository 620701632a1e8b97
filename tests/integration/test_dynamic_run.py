"""A run whose categorical features are dynamic tables (`dynamic:` in the config): no
vocabulary is fitted, it trains and evaluates like a fitted one, exports with its key -> row
maps frozen into the bundle (served scores equal `sampan predict`'s), the first-order warm
start hands its keys over, and a resumed run continues exactly through admissions and
evictions."""

import copy
import json

import numpy as np
import pyarrow as pa
import pytest

from sampan.config import ConfigError, load_config
from sampan.config.load import PRESETS
from sampan.train.experiment import run_experiment
from tests.conftest import tiny_config


def dynamic_config(tmp_path, capacity, rows=4000, **train):
    """The criteo preset's C1..C26 as dynamic tables of ``capacity`` rows each."""
    raw = tiny_config(tmp_path, rows=rows, **train)
    features = copy.deepcopy(PRESETS["criteo"]()["features"])
    features["categorical"] = [
        {"name": c, "dynamic": {"capacity": capacity, "evict": {"policy": "lru"}}}
        if isinstance(c, str) and c.startswith("C") else c
        for c in features["categorical"]]
    raw["features"] = features
    return raw


def test_a_dynamic_run_trains_evaluates_exports_and_serves(tmp_path):
    import pyarrow.parquet as pq

    from sampan import Experiment
    from sampan.config import SyntheticConfig
    from sampan.data.synthetic import iter_synthetic
    from sampan.export import export_run
    from sampan.serving import Predictor

    cfg = load_config(raw=dynamic_config(tmp_path, capacity=4000))
    assert cfg.features.categorical[0].dynamic.capacity == 4000
    assert cfg.features.categorical[0].min_count == 1  # the vocabulary defaults skip it
    results = run_experiment(cfg, run_dir=tmp_path / "run")
    assert results["test"]["auc"] > 0.65
    c1 = results["dynamic_tables"]["C1"]  # how full each table got, for sizing capacity
    assert c1["capacity"] == 4000 and 0 < c1["live"] <= 4000 and c1["evicted"] == 0
    from sampan import native  # the run header says what maps the keys

    why = json.loads((tmp_path / "run" / "schedule.json").read_text())["reasons"]
    assert why["dynamic_tables"] == ("key map on C kernels" if native.library() is not None
                                     else f"key map on tensor operations (C kernels "
                                          f"{native.status()})")
    report = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    c1 = next(f for f in report["features"] if f["feature"] == "C1")
    assert c1["ids"] == 4001 and c1["transform"].startswith("dynamic")
    again = Experiment.open(tmp_path / "run").evaluate("test")  # keys -> rows from the save
    assert again["auc"] == pytest.approx(results["test"]["auc"], abs=1e-9)
    # exported: the bundle's pipeline maps raw values to rows through the frozen maps, and
    # the served scores equal sampan predict's (which maps through the model's own tables)
    bundle = export_run(tmp_path / "run", tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["parity"]["max_abs_diff"] < 1e-5
    assert (bundle / "pipeline" / "dynamic_C1.keys.npy").exists()
    raw = tmp_path / "raw.parquet"
    table = next(iter_synthetic(SyntheticConfig(rows=300, seed=7)))
    pq.write_table(table, raw)
    want = Experiment.open(tmp_path / "run").predict(str(raw))
    records = [{k: v for k, v in r.items() if k not in ("label", "oracle_p")}
               for r in table.to_pylist()]
    served = Predictor(bundle).predict(records)
    assert np.abs(served - want).max() < 1e-5
    # keys the table never admitted: -1, which the graph reads as the default row (and
    # models do not take for padding, which is 0), as in training
    enc = next(e for e in Predictor(bundle).pipeline.categorical if e.spec.name == "C1")
    assert enc.transform(pa.array(["never-seen-value"])).tolist() == [-1]


def test_the_warm_start_hands_its_keys_to_the_model(tmp_path):
    raw = dynamic_config(tmp_path, capacity=4000, first_order_warm_start=True)
    results = run_experiment(load_config(raw=raw), run_dir=tmp_path / "run")
    assert results["first_order_warm_start"]["steps"] > 0
    # the step-0 evaluation of the warm-started model is the LR's, up to its small latent
    # vectors: the same keys have the same rows (rows given anew would score near 0.5)
    lr_auc = results["first_order_warm_start"]["valid"]["auc"]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    step0 = next(r for r in records if r["split"] == "valid" and r["step"] == 0)
    assert step0["auc"] == pytest.approx(lr_auc, abs=0.005) and lr_auc > 0.65


@pytest.mark.parametrize("warm_start", [False, True])
def test_min_count_counts_training_rows_not_epochs(tmp_path, warm_start):
    """min_count 2 over 3 epochs (and the LR warm start's passes before them): a table
    holds exactly the values that occur twice or more in the training split. Every epoch
    (every pass of the warm start) counted the same rows again, so every value got in."""

    from sampan.train.experiment import RunArtifacts

    raw = dynamic_config(tmp_path, capacity=4000, epochs=3,
                         first_order_warm_start=warm_start)
    for f in raw["features"]["categorical"]:
        if isinstance(f, dict) and f.get("dynamic"):
            f["dynamic"]["admit"] = {"min_count": 2}
    results = run_experiment(load_config(raw=raw), run_dir=tmp_path / "run")
    art = RunArtifacts(tmp_path / "run")
    keys = art.store.split("train").sparse  # the training split's values as keys
    names = [s.name for s in art.store.schema.sparse]
    for c in ("C3", "C4", "C10"):
        col = np.asarray(keys[:, names.index(c)])
        col = col[col != 0]  # padding: a missing value
        values, counts = np.unique(col, return_counts=True)
        want = int((counts >= 2).sum())
        assert results["dynamic_tables"][c]["live"] == want, c
        assert want < len(values)  # the column has values seen once


def test_a_resumed_dynamic_run_continues_exactly_through_evictions(tmp_path):
    def cfg(max_steps):  # 40 rows a table: full within the first steps, evicting after
        return load_config(raw=dynamic_config(
            tmp_path, capacity=40, rows=3000, max_steps=max_steps, epochs=3,
            log_every_steps=2, schedule="constant", warmup_steps=0,
            early_stopping={"enabled": False}))

    run_experiment(cfg(18), run_dir=tmp_path / "straight")
    run_experiment(cfg(9), run_dir=tmp_path / "resumed")
    run_experiment(cfg(18), run_dir=tmp_path / "resumed", resume=True)

    def losses(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}

    want, got = losses("straight"), losses("resumed")
    assert sorted(got) == sorted(want) and max(want) == 18
    res = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert res["dynamic_tables"]["C3"]["live"] == 40 and res["dynamic_tables"]["C3"]["evicted"] > 0
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), step


def test_dynamic_with_vocabulary_settings_is_a_config_error(tmp_path):
    raw = tiny_config(tmp_path)
    raw["features"] = {"categorical": [{"name": "C1", "hash_buckets": 10,
                                        "dynamic": {"capacity": 100}}]}
    with pytest.raises(ConfigError, match="hash_buckets cannot be set with dynamic"):
        load_config(raw=raw)
    raw["features"] = {"categorical": [{"name": "C1", "dynamic": {
        "capacity": 100, "evict": {"policy": "ttl"}}}]}
    with pytest.raises(ConfigError, match="ttl_steps"):
        load_config(raw=raw)
    raw["features"] = {"categorical": [{"name": "C1", "dynamic": {  # ttl_steps unread
        "capacity": 100, "evict": {"policy": "lru", "ttl_steps": 5}}}]}
    with pytest.raises(ConfigError, match="ttl_steps 5 is read only with policy ttl"):
        load_config(raw=raw)


def test_the_map_changes_only_in_the_training_thread_and_never_under_a_read_row(
        tmp_path, monkeypatch):
    """With the loader's prefetch thread running and every step evicting (30 rows a
    table), every KeyIndex call comes from the training thread, and no key that had a row
    before a lookup loses it, or sees it freed, in that lookup."""
    import threading

    import torch

    from sampan.embedding.dynamic import KeyIndex

    calls: list[tuple[str, str]] = []
    admit, find, free = KeyIndex.admit, KeyIndex.find, KeyIndex._free

    def spy_admit(self, keys, step, tables=None):
        calls.append(("admit", threading.current_thread().name))
        before = find(self, keys, tables)
        rows, freed = admit(self, keys, step, tables)
        held = before > 0
        assert torch.equal(rows[held], before[held]), "a key lost its row in its own lookup"
        index_rows = before if tables is None else before + self.starts[tables]  # as freed
        assert not bool(torch.isin(index_rows[held], freed).any()), "a row in use was freed"
        return rows, freed

    def spy(fn, kind):
        def wrapped(self, *args):
            calls.append((kind, threading.current_thread().name))
            return fn(self, *args)
        return wrapped

    monkeypatch.setattr(KeyIndex, "admit", spy_admit)
    monkeypatch.setattr(KeyIndex, "find", spy(find, "find"))
    monkeypatch.setattr(KeyIndex, "_free", spy(free, "free"))
    raw = dynamic_config(tmp_path, capacity=30, rows=3000, prefetch=2, epochs=1)
    run_experiment(load_config(raw=raw), run_dir=tmp_path / "run")
    kinds = {k for k, _ in calls}
    assert {"admit", "find", "free"} <= kinds
    assert {t for _, t in calls} == {threading.main_thread().name}


def test_a_bag_with_its_own_dynamic_table_trains_exports_and_serves(tmp_path):
    import pyarrow.parquet as pq

    from sampan import Experiment
    from sampan.data.synthetic import behaviour_samples
    from sampan.export import export_run
    from sampan.serving import Predictor

    table = behaviour_samples(2000)
    pq.write_table(table, tmp_path / "b.parquet")
    bag = {"name": "hist_category_id", "kind": "bag", "delimiter": "|", "max_len": 30,
           "dynamic": {"capacity": 500}}
    raw = {"name": "bag", "output_dir": str(tmp_path / "runs"),
           "data": {"train": str(tmp_path / "b.parquet")},
           "features": {"label": "label", "categorical": ["user_id", "category_id"],
                        "lists": [bag]},
           "model": {"name": "deepfm", "embedding_dim": 4, "mlp": [8]},
           "train": {"epochs": 1, "progress": False, "tensorboard": False,
                     "first_order_warm_start": False}}
    run_experiment(load_config(raw=raw), run_dir=tmp_path / "run")
    exp = Experiment.open(tmp_path / "run")
    table_rows = exp.artifacts.model.features.embedding.dynamic["hist_category_id"]
    assert len(table_rows) > 50  # the bag's values got rows of their own table
    bundle = export_run(tmp_path / "run", tmp_path / "bundle")
    served = Predictor(bundle)
    want = exp.predict(str(tmp_path / "b.parquet"))[:200]
    got = served.predict([{k: v for k, v in r.items() if k in served.columns}
                          for r in table.slice(0, 200).to_pylist()])
    assert np.abs(got - want).max() < 1e-5
    raw["features"]["lists"] = [{**bag, "share": "category_id"}]
    with pytest.raises(ConfigError, match="choose one"):
        load_config(raw=raw)


def test_a_two_tower_with_dynamic_tables_exports_and_retrieves_as_pytorch_does(tmp_path):
    """Dynamic tables on both towers (the user id, and the item's category; the item id
    itself keeps a vocabulary, which the corpus and log-Q correction index by): the bundle's
    item index holds the vectors the model gives its items, the exported user tower reads
    rows through the frozen maps, and the served search equals a brute-force search with
    the PyTorch user vector."""
    import faiss
    import pyarrow.parquet as pq
    import torch

    from sampan.batch import Batch
    from sampan.data.loader import BatchLoader
    from sampan.data.synthetic import interaction_samples
    from sampan.export import export_run
    from sampan.serving.retrieval import Retriever
    from sampan.tasks.retrieval import RetrievalTask
    from sampan.train.experiment import RunArtifacts

    pq.write_table(interaction_samples(users=200, items=300, per_user=10), tmp_path / "i.parquet")
    raw = {"name": "tt", "output_dir": str(tmp_path / "runs"),
           "data": {"train": str(tmp_path / "i.parquet"),
                    "split": {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}},
           "features": {"categorical": [
               {"name": "user_id", "dynamic": {"capacity": 150}},  # fewer rows than users
               "item_id", {"name": "category_id", "dynamic": {"capacity": 64}}]},
           "model": {"name": "two_tower", "item_features": ["item_id", "category_id"],
                     "embedding_dim": 8, "tower_mlp": [16], "k": 10},
           "train": {"epochs": 2, "batch_size": 64, "progress": False, "tensorboard": False}}
    res = run_experiment(load_config(raw=raw), run_dir=tmp_path / "run")
    bundle = export_run(tmp_path / "run", tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["retrieval"]["user_tower_max_abs_diff"] < 1e-5
    assert (bundle / "pipeline" / "dynamic_user_id.keys.npy").exists()
    assert (bundle / "pipeline" / "dynamic_category_id.keys.npy").exists()

    art = RunArtifacts(tmp_path / "run")  # its model maps keys to rows itself
    model = art.model.eval()
    train = art.store.split("train")
    # test users whose key lost its row (150 rows for 200 users) read the default row, like
    # an OOV id: not queries
    held = model.embedding.frozen_maps()["user_id"][0].numpy()
    test_users = np.asarray(art.store.split("test").sparse[:, 0])
    assert res["test"]["unknown_user_rows"] == (~np.isin(test_users, held)).sum() > 0
    assert res["test"]["queries"] == len(np.unique(test_users[np.isin(test_users, held)]))
    corpus = RetrievalTask(model, train).corpus_rows
    with torch.no_grad():
        want = torch.cat([model.item_vectors(b) for b in BatchLoader(
            corpus, 4096, shuffle="none", prefetch=0)]).numpy()
    index = faiss.read_index(str(bundle / "items.faiss"))
    vecs = index.reconstruct_n(0, index.ntotal)
    assert vecs.shape == want.shape
    np.testing.assert_allclose(vecs, want, atol=1e-5)

    names = pq.read_table(bundle / "items.parquet").column("item").to_pylist()
    # the store keeps a dynamic table's keys whole (64 bits, as the served pipeline gives
    # them), not cut to the int32 ids of fitted tables
    users = pq.read_table(tmp_path / "i.parquet").column("user_id").to_pylist()
    keys = np.asarray(art.pipeline.categorical[0].transform(pa.array(users)))
    assert train.sparse.dtype == np.int64 and np.isin(train.sparse[:, 0], keys).all()
    user_key = train.sparse[0, 0]
    user = next(u for u in dict.fromkeys(users)
                if art.pipeline.categorical[0].transform(pa.array([u])).tolist()[0] == user_key)
    with torch.no_grad():
        u = model.user_vectors(Batch(dense=torch.from_numpy(train.dense[:1]),
                                     sparse=torch.from_numpy(train.sparse[:1])))[0].numpy()
    got = Retriever(bundle).search({"user_id": user}, 10)
    brute = np.argsort(-(vecs @ u), kind="stable")[:10]
    assert [i for i, _ in got] == [names[i] for i in brute]
    assert all(abs(s - float(vecs[names.index(i)] @ u)) < 1e-4 for i, s in got)


def test_raw_rows_score_as_their_stored_rows_do(tmp_path):
    """`sampan predict` on a file maps each raw value to its key and through the trained
    map: the scores equal those of the same rows read from the training store (a key cut
    short in the store would miss its row at predict time and read the default row)."""
    import pyarrow.parquet as pq
    import torch

    from sampan import Experiment
    from sampan.config import SyntheticConfig
    from sampan.data.synthetic import iter_synthetic

    table = next(iter_synthetic(SyntheticConfig(rows=2000, seed=3)))
    pq.write_table(table, tmp_path / "rows.parquet")
    raw = dynamic_config(tmp_path, capacity=4000, rows=2000)
    raw["data"] = {"train": str(tmp_path / "rows.parquet"), "format": "parquet",
                   "split": {"method": "sequential", "train": 0.8, "valid": 0.1, "test": 0.1}}
    run_experiment(load_config(raw=raw), run_dir=tmp_path / "run")
    exp = Experiment.open(tmp_path / "run")
    art = exp.artifacts
    stored = torch.sigmoid(art.evaluator.predict_logits(art.store.split("train"))).numpy()
    scored = exp.predict(str(tmp_path / "rows.parquet"))[: len(stored)]
    assert np.abs(scored - stored).max() < 1e-5
