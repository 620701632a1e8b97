"""Export parity over the registry: raw records -> bundle pipeline -> ONNX Runtime give the
probabilities of PyTorch eager on the same raw rows (through the run's own read path)."""

import csv
import json

import numpy as np
import pytest
from rich.console import Console

from sampan.config import load_config
from sampan.export import Bundle, export_run
from sampan.models import get_model_class, model_names
from sampan.serving import Predictor, RequestError
from sampan.train.experiment import RunArtifacts, run_experiment

OPTIONS = {"two_tower": {"item_features": ["item_id", "category_id", "genres"]}}
COLUMNS = ["click", "buy", "user_id", "item_id", "category_id", "price", "age",
           "hist_item_id", "genres"]


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("raw") / "events.csv"
    n = 600
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for _ in range(n):
            click = int(rng.random() < 0.4)
            hist = "|".join(f"i{x}" for x in rng.integers(0, 30, rng.integers(0, 6)))
            genres = "|".join(rng.choice(["a", "b", "c", "d"], rng.integers(1, 3)))
            w.writerow([click, int(click and rng.random() < 0.5), f"u{rng.integers(0, 20)}",
                        f"i{rng.integers(0, 30)}", f"c{rng.integers(0, 5)}",
                        f"{rng.random() * 10:.3f}", "" if rng.random() < 0.1 else
                        str(int(rng.integers(18, 70))), hist, genres])
    return path


def train_run(tmp_path, raw, name, dynamic=False):
    """A tiny run of ``name``; ``dynamic``: the user id, the category and the genres bag as
    dynamic tables (fewer rows than values: keys are evicted and come back)."""
    tasks = getattr(get_model_class(name), "tasks", 1)

    def dyn(feature, capacity, **spec):
        return {"name": feature, **spec, "dynamic": {"capacity": capacity}} if dynamic \
            else ({"name": feature, **spec} if spec else feature)

    cfg = load_config(raw={
        "output_dir": str(tmp_path), "data": {"train": str(raw)},
        "features": {"label": ["click", "buy"][:tasks],
                     "categorical": [dyn("user_id", 15), "item_id", dyn("category_id", 4),
                                     {"name": "age_bin", "column": "age",
                                      "bucketize": "quantile", "buckets": 4}],
                     "numeric": [{"name": "price", "log1p": True, "standardize": True},
                                 {"name": "age", "fill": "mean", "standardize": True}],
                     "lists": [{"name": "hist_item_id", "share": "item_id", "delimiter": "|",
                                "max_len": 5},
                               dyn("genres", 3, kind="bag", delimiter="|", max_len=3)]},
        "model": {"name": name, "embedding_dim": 8, **OPTIONS.get(name, {})},
        "train": {"epochs": 1, "max_steps": 6, "batch_size": 64, "progress": False,
                  "tensorboard": False}})
    return run_experiment(cfg, run_dir=tmp_path / "run", console=Console(quiet=True))["run_dir"]


def records(raw):
    with open(raw, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        del r["click"], r["buy"]
        r["age"] = None if r["age"] == "" else r["age"]  # JSON null = missing value
    rows[0]["item_id"] = "never-seen"  # OOV, as in training
    rows[1]["price"] = 7.25  # numbers may come as JSON numbers
    return rows


# With vocabularies, every model but those whose graph's operations another case already
# holds (the first-order sum, FM and MLP of DeepFM; DCN's cross layer in DCNv2's; MMoE's and
# ESMM's gates and towers in PLE's; SASRec's two graphs are exported and served in
# test_next_item.py). With dynamic tables: a sequence model by default (DeepFM with dynamic
# fields and bags, and the two-tower, have their own tests in test_dynamic_run.py). Every
# model both ways with `pytest -m heavy` (two minutes more).
COVERED_ELSEWHERE = {"lr", "fm", "dnn", "wide_deep", "dcn", "mmoe", "esmm", "sasrec"}
DYNAMIC_BY_DEFAULT = {"din"}
CASES = [pytest.param(n, False, marks=pytest.mark.heavy if n in COVERED_ELSEWHERE else ())
         for n in model_names()] + [
    pytest.param(n, True, marks=() if n in DYNAMIC_BY_DEFAULT else pytest.mark.heavy)
    for n in model_names()]


@pytest.mark.parametrize(("name", "dynamic"), CASES,
                         ids=lambda v: {False: "vocab", True: "dynamic"}.get(v, v))
def test_onnx_parity(tmp_path, raw, name, dynamic):
    run = train_run(tmp_path, raw, name, dynamic)
    bundle = export_run(run, tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["parity"]["max_abs_diff"] <= 1e-5
    recs = records(raw)
    got = Predictor(bundle).predict(recs)
    chunked = Predictor(bundle, max_records=7).predict(recs)  # scored 7 records at a time
    np.testing.assert_allclose(chunked, got, rtol=0, atol=1e-6)
    # PyTorch eager on the same rows, read the way `sampan predict` reads files
    edited = tmp_path / "edited.csv"
    with open(edited, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in recs:
            w.writerow({**r, "age": "" if r["age"] is None else r["age"], "click": "",
                        "buy": ""})
    want = RunArtifacts(run).predict(str(edited))
    assert got.shape == want.shape == (len(recs), getattr(get_model_class(name), "tasks", 1))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_bundle_checks_and_request_errors(tmp_path, raw):
    run = train_run(tmp_path, raw, "deepfm")
    bundle = export_run(run, tmp_path / "bundle", fmt="torchscript")
    p = Predictor(bundle)
    recs = records(raw)[:5]
    want = RunArtifacts(run).predict(str(raw))[:5]
    np.testing.assert_allclose(Predictor(bundle).predict(records(raw)[2:5]), want[2:5],
                               atol=1e-5)
    with pytest.raises(RequestError, match="missing") as e:
        p.predict([{k: v for k, v in recs[0].items() if k != "price"}])
    assert e.value.field == "price"
    with pytest.raises(RequestError, match="unknown feature") as e:
        p.predict([{**recs[0], "prise": 1}])
    assert e.value.field == "prise"
    with pytest.raises(RequestError, match="'price': unparsable number") as e:
        p.predict([recs[0], {**recs[1], "price": "cheap"}])
    assert (e.value.field, e.value.record) == ("price", 1)
    with pytest.raises(RequestError, match="non-empty"):
        p.predict([])
    with pytest.raises(FileExistsError):
        export_run(run, tmp_path / "bundle")
    # an ONNX export from one example row (a stream's last window may hold one) still
    # takes any number of rows: torch.export would fix a batch dimension of size 1
    one = export_run(run, tmp_path / "one", parity_rows=1)
    np.testing.assert_allclose(Predictor(one).predict(records(raw)[:5]),
                               Predictor(export_run(run, tmp_path / "many")).predict(
                                   records(raw)[:5]), atol=1e-6)
    (bundle / "pipeline" / "pipeline.json").write_text("{}")
    with pytest.raises(ValueError, match="sha256"):
        Bundle(bundle)


def test_tampered_bundles_are_refused(tmp_path, raw):
    """Issue 13: a manifest naming a file outside the bundle, an edited file whose entry was
    removed, an added file, an edited manifest and an old format are all refused by name."""
    import shutil

    from sampan.errors import BundleError

    run = train_run(tmp_path, raw, "deepfm")
    good = export_run(run, tmp_path / "good")
    Bundle(good)

    def copy(name):
        out = tmp_path / name
        shutil.copytree(good, out)
        return out, json.loads((out / "manifest.json").read_text())

    def write(b, m, digest=True):
        from sampan.export.bundle import manifest_digest

        if digest:  # as an attacker who knows the format would
            m["manifest_sha256"] = manifest_digest(m)
        (b / "manifest.json").write_text(json.dumps(m))

    b, m = copy("outside")
    (tmp_path / "secret").write_text("x")
    m["files"]["../secret"] = m["files"].pop("pipeline/pipeline.json")
    write(b, m)
    with pytest.raises(BundleError, match="outside the bundle"):
        Bundle(b)
    b, m = copy("unlisted")  # pipeline.json edited and its entry removed
    (b / "pipeline" / "pipeline.json").write_text(
        (b / "pipeline" / "pipeline.json").read_text().replace('"min_count"', '"min_count" '))
    del m["files"]["pipeline/pipeline.json"]
    write(b, m)
    with pytest.raises(BundleError, match="not listed"):
        Bundle(b)
    b, m = copy("added")
    (b / "pipeline" / "extra.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(BundleError, match=r"\['pipeline/extra.npy'\] are not listed"):
        Bundle(b)
    b, m = copy("manifest-edited")  # the schema changed, the checksum not recomputed
    m["model"] = "lr"
    write(b, m, digest=False)
    with pytest.raises(BundleError, match="does not match its own sha256"):
        Bundle(b)
    b, m = copy("old-format")
    m["format_version"] = 1
    write(b, m)
    with pytest.raises(BundleError, match="format_version 1 is not supported"):
        Bundle(b)
    b, _ = copy("not-json")
    (b / "manifest.json").write_text("{")
    with pytest.raises(BundleError, match="not valid JSON"):
        Bundle(b)


def test_the_item_table_is_keyed_by_the_id_a_side_table_is_joined_by():
    """An item column not named item_id (MovieLens-1M's movie_id) keys the bundle's item
    table when it is the one other id feature a side table is joined by."""
    from sampan.export.tables import model_keys

    def keys(joins, categorical):
        cfg = load_config(raw={"data": {"train": "r.csv", "joins": joins}, "features": {
            "label": "y", "group": "user_id", "categorical": categorical},
            "model": {"name": "deepfm"}})
        return model_keys(cfg, object(), None)

    users = {"path": "u.csv", "by": "user_id"}
    movies = {"path": "m.csv", "by": "movie_id"}
    assert keys([users, movies], ["user_id", "movie_id"]) == ("user_id", "movie_id")
    assert keys([users], ["user_id", "movie_id"]) == ("user_id", None)  # nothing says so
    assert keys([users, movies, {"path": "c.csv", "by": "city"}],
                ["user_id", "movie_id", "city"]) == ("user_id", None)  # two: ambiguous
    assert keys([movies], ["user_id", "movie_id", "item_id"]) == ("user_id", "item_id")


def test_rank_puts_candidates_in_the_column_the_item_table_is_keyed_by(tmp_path):
    """A bundle whose item table is keyed by movie_id (joined to a movies side table) ranks
    candidates as movie ids with no item_key in the serve config; one set there wins."""
    from sampan.config import load_serve_config
    from sampan.serving.service import ServerState

    rng = np.random.default_rng(1)
    (tmp_path / "movies.csv").write_text("movie_id,genre\n" + "".join(
        f"m{i},g{i % 3}\n" for i in range(12)))
    u, m = rng.integers(0, 15, 500), rng.integers(0, 12, 500)
    y = (rng.random(500) < np.where(m % 3 == 0, 0.7, 0.2)).astype(int)
    (tmp_path / "ratings.csv").write_text("click,user_id,movie_id\n" + "".join(
        f"{a},u{b},m{c}\n" for a, b, c in zip(y, u, m, strict=True)))
    cfg = load_config(raw={
        "output_dir": str(tmp_path), "data": {"train": str(tmp_path / "ratings.csv"), "joins": [
            {"path": str(tmp_path / "movies.csv"), "by": "movie_id"}]},
        "features": {"label": "click", "group": "user_id",
                     "categorical": ["user_id", "movie_id", "genre"]},
        "model": {"name": "deepfm", "embedding_dim": 4},
        "train": {"epochs": 1, "max_steps": 4, "batch_size": 64, "progress": False,
                  "tensorboard": False}})
    run = run_experiment(cfg, run_dir=tmp_path / "run", console=Console(quiet=True))
    bundle = export_run(run["run_dir"], tmp_path / "bundle")
    assert Predictor(bundle).item_key == "movie_id"
    cands = ["m0", "m1", "m5"]
    state = ServerState(load_serve_config(raw={"bundle": str(bundle)}))
    try:
        assert state.item_key() == "movie_id"
        got = state.rank_future({"user_id": "u3"}, cands).future.result()[:, 0]
    finally:
        state.close()
    # the genre comes from the item table, keyed by the candidate's movie id
    want = Predictor(bundle).predict([{"user_id": "u3", "movie_id": c, "genre": f"g{i % 3}"}
                                      for c, i in zip(cands, (0, 1, 5), strict=True)])[:, 0]
    assert np.abs(got - want).max() < 1e-6
    state = ServerState(load_serve_config(raw={"bundle": str(bundle), "item_key": "genre"}))
    try:
        assert state.item_key() == "genre"
    finally:
        state.close()
