"""Defaults benchmark: Sampan with no options beyond the data description, against a tuned
scikit-learn logistic regression on the same rows, on every CTR-shaped dataset in
``../shared/data`` and on synthetic worlds of different shapes with a known oracle.

Nothing here is tuned per dataset: each config names the files, the label and which columns
are categorical / numeric / sequences, and the model name. Everything else (batch size,
epochs, warmup, evaluation cadence, embedding L2, early-stopping metric, output bias, feature
encoding) is the package default.

The baseline is ``sklearn.linear_model.LogisticRegression`` on one-hot categoricals (every
training value; unseen values get no column), multi-hot histories, and signed-log1p,
standardised numerics with missing indicators, its ``C`` picked on the validation rows. Each
model's test AUC is compared with it by the paired bootstrap of ``sampan compare``
(:func:`sampan.metrics.paired_auc_comparison`, 1,000 resamples of the test rows).
On datasets with fewer than 50,000 training rows (``--seeds auto``) each model trains with
seeds 1, 2 and 3: there one run's AUC moves with its seed by about as much as the interval
(DeepFM on a 22k-row world: 0.8141 / 0.8239 / 0.8301), so the row reports the mean of the
three runs, and its interval pools the three runs' bootstrap draws (as
``benchmarks/accuracy.py`` does), so it holds the seeds' spread as well as the rows'.
Lift efficiency is ``(AUC - 0.5) / (oracle AUC - 0.5)`` where the true probabilities are known.
A synthetic world trains on its first 80 % of rows and validates on the next 10 %; its test
rows are its last 10 % where those are at least ``TEST_ROWS`` (100,000), else that many rows
drawn afresh from the same world (:func:`world_test`): a small world's own test split (2,900
rows, 180 clicks) gives intervals of +-0.02 AUC, wider than most interactions are worth.

The six named worlds are fixed, so a default could in time be fitted to them. ``--fresh N``
draws N new worlds instead, their shapes (rows, fields, vocabularies, Zipf skew, interacting
pairs and their strength, numeric features and non-linearity, base rate, missing values)
from ranges around the named ones, with a seed that is new on every run unless given
(``--seed``): nobody saw those worlds before the defaults were chosen. They are reported in
their own RESULTS.md section ("defaults, fresh worlds") and JSON file.

Usage (from the repository root)::

    python benchmarks/defaults.py                     # everything -> RESULTS.md section
    python benchmarks/defaults.py --only world_small_mixed criteo_10k --models fm
    python benchmarks/defaults.py --fresh 4           # four worlds nobody tuned on
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))

from _readme import update_block  # noqa: E402
from accuracy import machine  # noqa: E402

from sampan.data.synthetic import World, interaction_value, iter_world, true_pairs  # noqa: E402,E501

CTR_MODELS = ["lr", "fm", "deepfm", "dcn_v2"]
# a world "has interactions" for the bars when learning them can be worth this much test AUC
# (the oracle's over the oracle without its pair terms): weaker ones are within the noise
# of a test split of 10k-100k rows, and FM cannot be asked to show them
INTERACTION_WORTH = 0.01
RESAMPLES = 1000
# below this many training rows a model trains with seeds 1-3 (--seeds auto)
FEW_ROWS = 50_000
# a synthetic world's test rows at least: where its own last 10 % are fewer, it is tested on
# this many rows drawn afresh from the same world. A 2,900-row test split with 180 clicks
# gives an interval of +-0.02 AUC, wider than what most worlds' interactions are worth, so
# the bars could not tell; real datasets keep their own test split.
TEST_ROWS = 100_000

# Worlds of different shapes; none of them was used to choose a default. Rows are before the
# 80/10/10 split.
WORLDS = [
    World("world_small_mixed", rows=12_000, categorical=10, vocab=(5, 500), numeric=4,
          pairs=6, interaction=0.7, seed=11),
    World("world_catonly_strong", rows=80_000, categorical=16, vocab=(20, 5_000), numeric=0,
          pairs=12, interaction=0.8, first_order=0.4, base_rate=0.1, seed=12),
    World("world_numeric_heavy", rows=150_000, categorical=3, vocab=(10, 100), numeric=16,
          pairs=2, interaction=0.3, numeric_effect=0.4, nonlinear=1.0, base_rate=0.3,
          seed=13),
    World("world_additive", rows=100_000, categorical=12, vocab=(10, 20_000), numeric=4,
          interaction=0.0, pairs=0, seed=14),
    World("world_criteo_like", rows=400_000, categorical=26, vocab=(3, 50_000), numeric=13,
          pairs=8, interaction=0.5, zipf_a=1.2, missing_rate=0.1, base_rate=0.2, seed=15),
    World("world_wide_huge_vocab", rows=1_000_000, categorical=40, vocab=(10, 2_000_000),
          numeric=2, pairs=10, interaction=0.4, first_order=0.5, zipf_a=1.05,
          base_rate=0.05, seed=16),
]


def fresh_worlds(n: int, seed: int) -> list[World]:
    """``n`` worlds of shapes drawn with ``seed`` (see the module docstring): rows 10k-300k
    (log-uniform), 3-30 categorical fields, vocabularies from 2-50 up to 100-500k, Zipf
    1.05-1.4, 0-12 interacting pairs (a quarter of the worlds additive) of scale 0.2-0.8,
    0-12 numeric features (half of the worlds with non-linear effects), base rate 0.03-0.4."""
    rng = np.random.default_rng(seed)
    worlds = []
    for k in range(n):
        numeric = int(rng.integers(0, 13))
        pairs = 0 if rng.random() < 0.25 else int(rng.integers(1, 13))
        worlds.append(World(
            f"fresh_{seed}_{k + 1}", rows=int(np.exp(rng.uniform(np.log(1e4), np.log(3e5)))),
            categorical=int(rng.integers(3, 31)),
            vocab=(int(rng.integers(2, 51)), int(np.exp(rng.uniform(np.log(100),
                                                                    np.log(5e5))))),
            numeric=numeric, zipf_a=round(float(rng.uniform(1.05, 1.4)), 2),
            first_order=round(float(rng.uniform(0.3, 0.8)), 2), pairs=pairs,
            interaction=round(float(rng.uniform(0.2, 0.8)), 2) if pairs else 0.0,
            numeric_effect=round(float(rng.uniform(0.1, 0.5)), 2),
            nonlinear=round(float(rng.uniform(0.5, 1.0)), 2) if numeric and rng.random() < 0.5
            else 0.0,
            base_rate=round(float(np.exp(rng.uniform(np.log(0.03), np.log(0.4)))), 3),
            missing_rate=round(float(rng.uniform(0.0, 0.15)), 2),
            seed=int(rng.integers(1 << 30))))
    return worlds


@dataclass
class Dataset:
    name: str
    about: str
    files: dict[str, str]
    categorical: list[str]
    numeric: list[str] = field(default_factory=list)
    lists: list[dict[str, Any]] = field(default_factory=list)
    oracle: str | None = None
    models: list[str] = field(default_factory=lambda: list(CTR_MODELS))
    interactions: bool | None = None  # known for worlds: FM/DeepFM should beat LR
    interaction_value: float | None = None  # oracle AUC - the oracle's without its pairs
    pairs: list[tuple[int, int]] = field(default_factory=list)  # a world's true pairs


# ------------------------------------------------------------------------ preparing data
def write_splits(table: pa.Table, out: Path, how: str, seed: int = 0,
                 order_by: str | None = None) -> dict[str, str]:
    """80/10/10 by file order (``sequential``), by ``order_by`` (time) or seeded ``random``."""
    out.mkdir(parents=True, exist_ok=True)
    n = table.num_rows
    if order_by:
        table = table.take(pc.sort_indices(table, [(order_by, "ascending")]))
    if how == "random":
        role = np.random.default_rng(seed).choice(3, n, p=[0.8, 0.1, 0.1])
    else:
        role = np.zeros(n, np.int64)
        role[int(0.8 * n):] = 1
        role[int(0.9 * n):] = 2
    files = {}
    for k, name in enumerate(("train", "valid", "test")):
        path = out / f"{name}.parquet"
        pq.write_table(table.filter(pa.array(role == k)), path)
        files[name] = str(path)
    return files


def world_test(w: World, test_rows: int = TEST_ROWS) -> dict[str, int]:
    """Where ``w``'s test rows come from: its own last 10 % (``draw`` 0) where they are at
    least ``test_rows``, else ``test_rows`` rows drawn afresh from the world (``draw`` 1 of
    :func:`sampan.data.synthetic.iter_world`: other rows, the same labelling model)."""
    own = w.rows - int(0.9 * w.rows)
    return {"draw": 0, "rows": own} if own >= test_rows else {"draw": 1, "rows": test_rows}


def prep_world(w: World, out: Path, test_rows: int = TEST_ROWS) -> Dataset:
    """``w``'s files: train and valid its first 80 % and next 10 %, test per
    :func:`world_test` (rewritten when an earlier run wrote them otherwise)."""
    test = world_test(w, test_rows)
    marker = out / "test_source.json"
    if not marker.exists() or json.loads(marker.read_text()) != test:
        files = write_splits(pa.concat_tables(iter_world(w)), out, "sequential")
        if test["draw"]:
            pq.write_table(pa.concat_tables(iter_world(w, draw=test["draw"],
                                                       rows=test["rows"])), files["test"])
        marker.write_text(json.dumps(test))
    files = {s: str(out / f"{s}.parquet") for s in ("train", "valid", "test")}
    worth = world_interaction_value(w)
    return Dataset(w.name, world_about(w, worth, test), files,
                   [f"c{i + 1}" for i in range(w.categorical)],
                   [f"n{i + 1}" for i in range(w.numeric)], oracle="oracle_p",
                   interactions=worth >= INTERACTION_WORTH, interaction_value=worth,
                   pairs=true_pairs(w) if worth > 0 else [])


def world_about(w: World, worth: float, test: dict[str, int] | None = None) -> str:
    """The world's line in the report's list of datasets."""
    tested = "" if test is None else (
        f", tested on {test['rows']:,} rows drawn afresh from it" if test["draw"]
        else f", tested on its own last {test['rows']:,} rows")
    return (f"{w.rows:,} rows, {w.categorical} categorical (vocab {w.vocab[0]:,}-"
            f"{w.vocab[1]:,}), {w.numeric} numeric, {w.pairs if w.interaction else 0} "
            f"interacting pairs (scale {w.interaction}, worth {worth:+.4f} AUC), base rate "
            f"{w.base_rate}{tested}")


def world_interaction_value(w: World) -> float:
    """What learning ``w``'s pair terms can be worth: the oracle's AUC over that of the
    oracle without them (:func:`sampan.data.synthetic.interaction_value`); 0 without pairs."""
    if not (w.interaction > 0 and w.pairs > 0):
        return 0.0
    full, first = interaction_value(w)
    return full - first


def _criteo_columns() -> tuple[list[str], list[str]]:
    return [f"I{i}" for i in range(1, 14)], [f"C{i}" for i in range(1, 27)]


def prep_criteo_10k(out: Path) -> Dataset:
    ints, cats = _criteo_columns()
    if not (out / "test.parquet").exists():
        rows = [line.rstrip("\n").split("\t") for line in
                gzip.open(DATA / "criteo/criteo_kaggle_train_sample_10k.txt.gz", "rt")]
        cols = {"label": pa.array([int(r[0]) for r in rows])}
        for j, c in enumerate(ints):
            cols[c] = pa.array([float(r[1 + j]) if r[1 + j] else None for r in rows])
        for j, c in enumerate(cats):
            cols[c] = pa.array([r[14 + j] or None for r in rows])
        write_splits(pa.table(cols), out, "sequential")
    return Dataset("criteo_10k", "Criteo Kaggle 10k-line sample, file order 80/10/10",
                   _files(out), cats, ints)


def prep_criteo_4584(out: Path) -> Dataset:
    import pyarrow.csv as pacsv

    ints, cats = _criteo_columns()
    if not (out / "test.parquet").exists():
        t = pacsv.read_csv(DATA / "criteo/criteo_kaggle_train_random_sample_4584.csv.gz",
                           convert_options=pacsv.ConvertOptions(
                               column_types={c: pa.string() for c in cats}))
        t = t.drop(["Id"]).rename_columns(["label" if c == "Label" else c
                                           for c in t.drop(["Id"]).column_names])
        write_splits(t, out, "random", seed=1)
    return Dataset("criteo_4584", "Criteo random 4,584-row sample (CSV with header), random "
                   "80/10/10", _files(out), cats, ints)


def prep_frappe(out: Path) -> Dataset:
    names = ["user", "item", "daytime", "weekday", "isweekend", "homework", "cost", "weather",
             "country", "city"]
    if not (out / "test.parquet").exists():
        rows = []
        for f in ("frappe.validation.libfm.gz", "frappe.test.libfm.gz"):
            rows += [line.split() for line in gzip.open(DATA / "frappe" / f, "rt")]
        cols = {"label": pa.array([int(float(r[0]) > 0) for r in rows])}
        for j, c in enumerate(names):
            cols[c] = pa.array([r[1 + j].split(":")[0] for r in rows])
        write_splits(pa.table(cols), out, "random", seed=2)
    return Dataset("frappe", "Frappe app usage (its published validation + test splits, "
                   "86k rows, 10 fields), random 80/10/10", _files(out), names)


def prep_movielens_100k(out: Path) -> Dataset:
    if not (out / "test.parquet").exists():
        base = DATA / "movielens/ml-100k"
        r = np.loadtxt(base / "u.data", dtype=np.int64)
        users = {int(x[0]): x for x in (line.split("|") for line in
                                        open(base / "u.user", encoding="latin-1"))}
        items = {int(x[0]): x for x in (line.rstrip("\n").split("|") for line in
                                        open(base / "u.item", encoding="latin-1"))}
        genre = [next((g for g, f in enumerate(items[i][5:24]) if f == "1"), 0)
                 for i in r[:, 1]]
        t = pa.table({"label": (r[:, 2] >= 4).astype(np.int64),
                      "user_id": pa.array(r[:, 0].astype(str)),
                      "item_id": pa.array(r[:, 1].astype(str)),
                      "age": pa.array([float(users[u][1]) for u in r[:, 0]]),
                      "gender": pa.array([users[u][2] for u in r[:, 0]]),
                      "occupation": pa.array([users[u][3] for u in r[:, 0]]),
                      "genre": pa.array([str(g) for g in genre]),
                      "timestamp": r[:, 3]})
        write_splits(t, out, "time", order_by="timestamp")
    return Dataset("movielens_100k", "MovieLens-100k, rating >= 4 as click, user and item "
                   "side features, time order 80/10/10", _files(out),
                   ["user_id", "item_id", "gender", "occupation", "genre"], ["age"])


def prep_movielens_1m(out: Path) -> Dataset:
    if not (out / "test.parquet").exists():
        base = DATA / "movielens/ml-1m-partial"
        r = np.array([line.split("::") for line in
                      gzip.open(base / "ratings.partial_users1-2999.dat.gz", "rt")],
                     dtype=np.int64)
        users = {int(x[0]): x for x in (line.strip().split("::") for line in
                                        open(base / "users.dat", encoding="latin-1"))}
        movies = {int(x[0]): x for x in (line.strip().split("::") for line in
                                         open(base / "movies.dat", encoding="latin-1"))}
        t = pa.table({"label": (r[:, 2] >= 4).astype(np.int64),
                      "user_id": pa.array(r[:, 0].astype(str)),
                      "movie_id": pa.array(r[:, 1].astype(str)),
                      "gender": pa.array([users[u][1] for u in r[:, 0]]),
                      "age": pa.array([users[u][2] for u in r[:, 0]]),
                      "occupation": pa.array([users[u][3] for u in r[:, 0]]),
                      "genre": pa.array([movies[m][2].split("|")[0] for m in r[:, 1]]),
                      "timestamp": r[:, 3]})
        write_splits(t, out, "time", order_by="timestamp")
    return Dataset("movielens_1m_partial", "MovieLens-1M ratings of users 1-2999 (488k), "
                   "rating >= 4 as click, user and movie side features, time order 80/10/10",
                   _files(out), ["user_id", "movie_id", "gender", "age", "occupation", "genre"])


def prep_taobao(out: Path) -> Dataset:
    import pyarrow.csv as pacsv

    if not (out / "test.parquet").exists():
        t = pacsv.read_csv(DATA / "taobao_userbehavior/UserBehavior_sample_96168.csv.gz",
                           read_options=pacsv.ReadOptions(column_names=[
                               "user_id", "item_id", "category_id", "behavior", "ts"]),
                           convert_options=pacsv.ConvertOptions(column_types={
                               "user_id": pa.string(), "item_id": pa.string(),
                               "category_id": pa.string()}))
        label = pc.cast(pc.not_equal(t.column("behavior"), "pv"), pa.int64())
        minute = pc.cast(pc.divide(pc.subtract(t.column("ts"), 1511658000), 600), pa.string())
        t = pa.table({"label": label, "user_id": t.column("user_id"),
                      "item_id": t.column("item_id"), "category_id": t.column("category_id"),
                      "slot": minute, "ts": t.column("ts")})
        write_splits(t, out, "time", order_by="ts")
    return Dataset("taobao_ctr", "Taobao UserBehavior sample (96k events, 2 hours): cart / "
                   "fav / buy as click against page views, time order 80/10/10", _files(out),
                   ["user_id", "item_id", "category_id", "slot"])


def prep_amazon(out: Path) -> Dataset:
    from sampan.data.behaviour import BuildOptions, build_sequences

    if not (out / "test.parquet").exists():
        samples = out / "samples.parquet"
        out.mkdir(parents=True, exist_ok=True)
        build_sequences(str(DATA / "amazon_s3rec/Beauty.txt.gz"), samples,
                        BuildOptions(format="sequence_lines", category=None, action=None,
                                     max_len=20, negatives=1))
        write_splits(pq.read_table(samples), out, "random", seed=3)
    return Dataset("amazon_beauty_ctr", "Amazon Beauty (S3-Rec): every event with its last "
                   "20 items plus one sampled negative (397k samples), random 80/10/10",
                   _files(out), ["user_id", "item_id"],
                   lists=[{"name": "hist_item_id", "share": "item_id", "kind": "sequence",
                           "max_len": 20}], models=[*CTR_MODELS, "din"])


def _files(out: Path) -> dict[str, str]:
    return {s: str(out / f"{s}.parquet") for s in ("train", "valid", "test")}


REAL = {"criteo_10k": prep_criteo_10k, "criteo_4584": prep_criteo_4584,
        "frappe": prep_frappe, "movielens_100k": prep_movielens_100k,
        "movielens_1m_partial": prep_movielens_1m, "taobao_ctr": prep_taobao,
        "amazon_beauty_ctr": prep_amazon}


# ----------------------------------------------------------------------- the LR baseline
def lr_features(ds: Dataset, tables: dict[str, pa.Table]) -> dict[str, Any]:
    """One-hot / multi-hot / standardised numeric design matrices (scipy CSR) per split."""
    import scipy.sparse as sp

    train = tables["train"]
    blocks: dict[str, list[Any]] = {s: [] for s in tables}
    for c in ds.categorical:
        vocab = pc.unique(pc.fill_null(train.column(c).cast(pa.string()), "\x00")
                          .combine_chunks())
        for s, t in tables.items():
            v = pc.fill_null(t.column(c).cast(pa.string()), "\x00")
            idx = pc.fill_null(pc.index_in(v, value_set=vocab), -1).to_numpy()
            ok = idx >= 0
            rows = np.arange(t.num_rows)[ok]
            blocks[s].append(sp.csr_matrix((np.ones(ok.sum()), (rows, idx[ok])),
                                           shape=(t.num_rows, len(vocab))))
    for spec in ds.lists:
        col = spec.get("column", spec["name"])
        vocab = pc.unique(pc.list_flatten(train.column(col).combine_chunks()).cast(pa.string()))
        for s, t in tables.items():
            lists = t.column(col).combine_chunks()
            lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy()
            ids = pc.index_in(pc.list_flatten(lists).cast(pa.string()), value_set=vocab)
            ids = pc.fill_null(ids, -1).to_numpy()
            rows = np.repeat(np.arange(t.num_rows), lengths)
            keep = ids >= 0
            w = 1.0 / np.maximum(lengths[rows[keep]], 1)
            blocks[s].append(sp.csr_matrix((w, (rows[keep], ids[keep])),
                                           shape=(t.num_rows, len(vocab))))
    for c in ds.numeric:
        x = pc.cast(train.column(c), pa.float64()).to_numpy(zero_copy_only=False)
        lx = np.sign(x) * np.log1p(np.abs(x))
        mu, sd = np.nanmean(lx), np.nanstd(lx) or 1.0
        for s, t in tables.items():
            v = pc.cast(t.column(c), pa.float64()).to_numpy(zero_copy_only=False)
            miss = np.isnan(v)
            z = np.where(miss, 0.0, (np.sign(v) * np.log1p(np.abs(v)) - mu) / sd)
            blocks[s].append(sp.csr_matrix(np.stack([z, miss.astype(float)], axis=1)))
    return {s: sp.hstack(b, format="csr") for s, b in blocks.items()}


def tuned_lr(ds: Dataset, tables: dict[str, pa.Table], x: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """scikit-learn's LR on :func:`lr_features` (``x`` when given), ``C`` picked on the
    validation rows: its test logits, ``C`` and coefficients."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    t0 = time.perf_counter()
    x = lr_features(ds, tables) if x is None else x
    y = {s: t.column("label").to_numpy().astype(np.int64) for s, t in tables.items()}
    results = {}
    grid = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0]
    k = 0
    while k < len(grid):
        c = grid[k]
        m = LogisticRegression(C=c, max_iter=400, tol=1e-4)
        m.fit(x["train"], y["train"])
        results[c] = (roc_auc_score(y["valid"], m.decision_function(x["valid"])), m)
        best = max(results, key=lambda key: results[key][0])
        if k == len(grid) - 1 and best == grid[-1] and len(grid) < 9:
            grid.append(grid[-1] * 3)  # the best C is at the edge: look one step further
        k += 1
    best = max(results, key=lambda key: results[key][0])
    m = results[best][1]
    return {"C": best, "valid_auc": results[best][0], "test_logits": m.decision_function(
        x["test"]), "coef": m.coef_[0], "intercept": float(m.intercept_[0]),
        "features": x["train"].shape[1], "seconds": time.perf_counter() - t0}


def true_form(ds: Dataset, tables: dict[str, pa.Table], base: dict[str, Any] | None = None,
              x: dict[str, Any] | None = None) -> dict[str, Any]:
    """The world's own form fitted on its training rows (``benchmarks/true_form.py``),
    against the tuned LR (``base``, fitted here when not given; ``x`` its design matrices):
    its test AUC, the paired interval over the LR, and whether it is above the LR beyond it
    (``learnable``)."""
    import torch
    from true_form import fit_true_form

    from sampan.metrics import auc, paired_auc_comparison

    x = lr_features(ds, tables) if x is None else x
    base = tuned_lr(ds, tables, x) if base is None else base
    y = {s: t.column("label").to_numpy().astype(np.float64) for s, t in tables.items()}
    fit = fit_true_form(x, y, base["coef"], base["intercept"], base["C"], tables, ds.pairs)
    yt = torch.from_numpy(y["test"])
    cmp = paired_auc_comparison(torch.from_numpy(base["test_logits"]), fit["test_logits"], yt,
                                resamples=RESAMPLES)
    out = {"auc": auc(fit["test_logits"], yt), "vs_lr": cmp["diff"],
           "vs_lr_ci95": cmp["diff_ci95"], "learnable": cmp["diff_ci95"][0] > 0,
           "l2": fit["l2"], "path": fit["path"], "seconds": round(fit["seconds"], 1)}
    print(f"   true form fitted on the training rows (vector L2 {fit['l2']:g}): test AUC "
          f"{out['auc']:.4f}, vs LR {out['vs_lr']:+.4f} [{out['vs_lr_ci95'][0]:+.4f}, "
          f"{out['vs_lr_ci95'][1]:+.4f}] ({fit['seconds']:.0f} s)", flush=True)
    return out


# ----------------------------------------------------------------------- Sampan runs
def config_for(ds: Dataset, model: str, run_root: Path, seed: int = 1) -> dict[str, Any]:
    """The whole config: the data description and the model name, nothing else (progress
    and tensorboard only change what is displayed)."""
    return {"name": f"{ds.name}-{model}", "output_dir": str(run_root), "seed": seed,
            "data": {**ds.files, "format": "parquet", "oracle_column": ds.oracle},
            "features": {"label": "label", "categorical": ds.categorical,
                         "numeric": ds.numeric, "lists": ds.lists},
            "model": {"name": model},
            "train": {"progress": False, "tensorboard": False}}


def run_sampan(ds: Dataset, model: str, run_root: Path, seed: int = 1,
               overrides: list[str] | None = None) -> dict[str, Any]:
    import shutil

    import torch
    from rich.console import Console

    from sampan.config import load_config
    from sampan.train.experiment import RunArtifacts, run_experiment

    cfg = load_config(raw=config_for(ds, model, run_root, seed), overrides=overrides)
    run_dir = run_root / ds.name / (model if seed == 1 else f"{model}-seed{seed}")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    res = run_experiment(cfg, run_dir=run_dir, console=Console(quiet=True))
    art = RunArtifacts(run_dir)
    test = art.store.split("test")
    logits = art.evaluator.predict_logits(test)[:, 0]
    plan = json.loads((run_dir / "schedule.json").read_text())
    diverged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                if '"divergence"' in x]
    return {"test": res["test"], "steps": res["steps"], "best_step": res["best_step"],
            "seconds": time.perf_counter() - t0, "plan": plan["chosen"],
            "metric": plan["early_stopping_metric"], "divergences": len(diverged),
            "logits": torch.as_tensor(logits, dtype=torch.float64),
            "labels": np.asarray(test.labels[:, 0])}


def seeds_arg(value: str) -> str:
    """``--seeds``: ``auto`` or a positive count."""
    if value != "auto" and not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"expected auto or a positive number of seeds, "
                                         f"got {value!r}")
    return value


def seeds_for(train_rows: int, seeds: str) -> list[int]:
    """``auto``: seeds 1-3 below :data:`FEW_ROWS` training rows, else seed 1; ``N``: 1..N."""
    n = (3 if train_rows < FEW_ROWS else 1) if seeds == "auto" else int(seeds)
    return list(range(1, n + 1))


def evaluate_dataset(ds: Dataset, run_root: Path, models: list[str] | None,
                     seeds: str = "auto", overrides: list[str] | None = None) -> dict[str, Any]:
    import torch

    from sampan.metrics import auc, paired_auc_comparison

    tables = {s: pq.read_table(p) for s, p in ds.files.items()}
    print(f"== {ds.name}: {ds.about}", flush=True)
    design = lr_features(ds, tables)
    base = tuned_lr(ds, tables, design)
    y_test = tables["test"].column("label").to_numpy().astype(np.float32)
    yt = torch.from_numpy(y_test)
    lr_auc = auc(torch.from_numpy(base["test_logits"]), yt)
    out: dict[str, Any] = {"about": ds.about, "rows": {s: t.num_rows for s, t in tables.items()},
                           "sklearn_lr": {"auc": lr_auc, "C": base["C"],
                                          "features": base["features"],
                                          "seconds": round(base["seconds"], 1)},
                           "interactions": ds.interactions,
                           "interaction_value": ds.interaction_value, "models": {}}
    print(f"   sklearn LR (C={base['C']}, {base['features']:,} columns): test AUC "
          f"{lr_auc:.4f} ({base['seconds']:.0f} s)", flush=True)
    if ds.oracle:
        out["oracle_auc"] = auc(torch.from_numpy(
            tables["test"].column(ds.oracle).to_numpy().copy()), yt)
    if ds.interactions and ds.pairs:  # can these rows show the interactions at all?
        out["true_form"] = true_form(ds, tables, base, design)
    for model in ds.models:
        if models and model not in models:
            continue
        runs = [run_sampan(ds, model, run_root, seed, overrides)
                for seed in seeds_for(out["rows"]["train"], seeds)]
        for r in runs:
            if len(r["labels"]) != len(y_test) or not np.array_equal(r["labels"], y_test):
                raise SystemExit(f"{ds.name}/{model}: the run's test rows differ from the "
                                 "file's (rejected rows?); a paired comparison needs the same "
                                 "rows")
        r = runs[0]
        cmp = paired_auc_comparison(torch.from_numpy(base["test_logits"]),
                                    [x["logits"] for x in runs], yt, RESAMPLES)
        entry = {"auc": cmp["auc_b"], "logloss": float(np.mean([x["test"]["logloss"]
                                                                 for x in runs])),
                 "vs_lr": cmp["diff"], "vs_lr_ci95": cmp["diff_ci95"],
                 "p_better": cmp["p_b_better"], "seeds": len(runs),
                 "seed_aucs": cmp["auc_b_runs"],
                 "steps": r["steps"], "best_step": r["best_step"],
                 "seconds": round(float(np.mean([x["seconds"] for x in runs])), 1),
                 "plan": r["plan"], "metric": r["metric"],
                 "divergences": sum(x["divergences"] for x in runs)}
        if ds.oracle:
            entry["lift_efficiency"] = (cmp["auc_b"] - 0.5) / (out["oracle_auc"] - 0.5)
        out["models"][model] = entry
        each = "" if len(runs) == 1 else \
            f" (mean of seeds 1-{len(runs)}: {' / '.join(f'{a:.4f}' for a in cmp['auc_b_runs'])})"
        print(f"   {model:<8} test AUC {cmp['auc_b']:.4f}{each}  vs LR {cmp['diff']:+.4f} "
              f"[{cmp['diff_ci95'][0]:+.4f}, {cmp['diff_ci95'][1]:+.4f}]"
              + (f"  lift eff {entry['lift_efficiency']:.3f}" if ds.oracle else "")
              + f"  batch {r['plan']['batch_size']} steps {r['steps']} (best "
              f"{r['best_step']}) {entry['seconds']:.0f} s"
              + (f"  DIVERGED x{entry['divergences']}" if entry["divergences"] else ""),
              flush=True)
    return out


# ---------------------------------------------------------------------------- report
def learnable(d: dict[str, Any]) -> bool:
    """Whether the world's own form, fitted on its training rows, beats the tuned LR beyond
    the interval (true where it was not fitted: the bar then applies)."""
    return d.get("true_form", {}).get("learnable", True)


def verdicts(name: str, d: dict[str, Any]) -> list[str]:
    """The issue's bars, checked row by row."""
    notes = []
    for m in ("fm", "deepfm"):
        e = d["models"].get(m)
        if e is None:
            continue
        if e["vs_lr_ci95"][1] < 0:
            notes.append(f"{m} below LR")
        if d.get("interactions") and learnable(d) and e["vs_lr_ci95"][0] <= 0:
            notes.append(f"{m} not clearly above LR")
    e = d["models"].get("deepfm")
    if e and "lift_efficiency" in e and d["rows"]["train"] >= 300_000 \
            and e["lift_efficiency"] < 0.80:
        notes.append("deepfm lift efficiency < 0.80")
    if any(e["divergences"] for e in d["models"].values()):
        notes.append("a run diverged")
    return notes


def machines_note(report: dict[str, Any]) -> str:
    """Where rows merged from earlier runs were measured, when that is not the header's
    machine (each row's s column is wall seconds on its own)."""
    others: dict[tuple[str, str], list[str]] = {}
    for name, d in report["datasets"].items():
        cpu = d.get("machine", report["machine"]["cpu"])
        if cpu != report["machine"]["cpu"]:
            others.setdefault((cpu, d.get("date", "?")), []).append(name)
    return "".join(f" Measured on {cpu} ({date}), with its own s: {', '.join(names)}."
                   for (cpu, date), names in others.items())


def markdown(report: dict[str, Any], title: str = "defaults") -> str:
    m = report["machine"]
    lines = [f"## {title}", "",
             f"Generated by `{report['command']}` on {report['date']} ({m['cpu']}, "
             f"{', '.join(m.get('isa', [])) or 'no AVX2'}, {m['cores']} cores, torch "
             f"{m['torch']}; the s column is wall seconds there); see the script's "
             "docstring. Every Sampan run uses the package defaults: the config names the "
             "files, the label, the feature columns and the model. Baseline: scikit-learn "
             "LogisticRegression, C tuned on the validation rows. Δ = Sampan - LR test AUC, "
             "paired bootstrap "
             "95 % interval (1,000 resamples, as `sampan compare`); on datasets under "
             f"{FEW_ROWS:,} training rows the mean of seeds 1-3, the interval pooling the "
             "three runs' draws (batch, steps and s: seed 1's run). Lift = (AUC - 0.5) / "
             "(oracle - 0.5) where the true probabilities are known. A synthetic world "
             "trains and validates on its first 80 % and next 10 % of rows; where its last "
             f"10 % are fewer than {TEST_ROWS:,} rows, it is tested on {TEST_ROWS:,} rows "
             "drawn afresh from the same world (the datasets list says which)."
             + machines_note(report),
             "", "| dataset | train rows | oracle | sklearn LR | model | test AUC | Δ vs LR [95 %] "
             "| lift | batch | steps (best) | s |", "|" + "---|" * 11]
    for name, d in report["datasets"].items():
        first = True
        for model, e in d["models"].items():
            head = [name, f"{d['rows']['train']:,}",
                    f"{d['oracle_auc']:.4f}" if "oracle_auc" in d else "-",
                    f"{d['sklearn_lr']['auc']:.4f}"] if first else ["", "", "", ""]
            first = False
            lines.append("| " + " | ".join(head + [
                model, f"{e['auc']:.4f}" + (f" ({e['seeds']} seeds)" if e.get("seeds", 1) > 1
                                            else ""),
                f"{e['vs_lr']:+.4f} [{e['vs_lr_ci95'][0]:+.4f}, {e['vs_lr_ci95'][1]:+.4f}]",
                f"{e['lift_efficiency']:.3f}" if "lift_efficiency" in e else "-",
                str(e["plan"]["batch_size"]), f"{e['steps']:,} ({e['best_step']:,})",
                f"{e['seconds']:.0f}"]) + " |")
    lines += ["", "Datasets:", ""]
    lines += [f"- `{n}`: {d['about']}{true_form_note(d)}"
              for n, d in report["datasets"].items()]
    misses = {n: v for n, d in report["datasets"].items() if (v := verdicts(n, d))}
    lines += ["", "Bars (FM and DeepFM at least LR or within the interval; above LR beyond "
              f"the interval on worlds whose interactions are worth {INTERACTION_WORTH} AUC or "
              "more and whose true form, fitted on the training rows, is itself above LR "
              "beyond the interval; DeepFM lift >= 0.80 on worlds with "
              "300k+ training rows; no divergence): "
              + ("all met." if not misses else "missed: " + "; ".join(
                  f"{n}: {', '.join(v)}" for n, v in misses.items()) + "."), ""]
    below = [f"{model} on {n} ({e['vs_lr']:+.4f})" for n, d in report["datasets"].items()
             for model, e in d["models"].items()
             if model not in ("fm", "deepfm") and e["vs_lr_ci95"][1] < 0]
    lines += ["Other models below the tuned LR beyond the interval: "
              + ("; ".join(below) if below else "none") + ".", ""]
    return "\n".join(lines)


def true_form_note(d: dict[str, Any]) -> str:
    """The datasets list's words on the world's true form fitted on its training rows."""
    tf = d.get("true_form")
    if tf is None:
        return ""
    lo, hi = tf["vs_lr_ci95"]
    return (f"; its true form fitted on the training rows: {tf['auc']:.4f}, {tf['vs_lr']:+.4f} "
            f"[{lo:+.4f}, {hi:+.4f}] over the LR" + ("" if tf["learnable"] else
                                                     " (the rows cannot show the pairs)"))


def refresh(path: Path, out: Path, block: str, title: str, run_root: Path,
            only: list[str] | None = None, command: str | None = None) -> None:
    """Recompute what belongs to each world (or to those in ``only``) in the report at
    ``path``: its interaction value and its true form fitted on its training rows (and so
    whether the "clearly above the LR" bar applies); rewrite its section of ``out``."""
    report = json.loads(path.read_text())
    if command:
        report["command"] += f"; then {command}"
    for name, d in report["datasets"].items():
        if name not in report.get("worlds", {}) or (only and name not in only):
            continue
        params = dict(report["worlds"][name])
        params["vocab"] = tuple(params["vocab"])
        w = World(**params)
        ds = prep_world(w, run_root / "data" / name)
        d["interaction_value"], d["interactions"] = ds.interaction_value, ds.interactions
        d["about"] = ds.about
        print(f"{name}: interactions worth {ds.interaction_value:+.4f} AUC", flush=True)
        d.pop("true_form", None)
        if ds.interactions and ds.pairs:
            d["true_form"] = true_form(ds, {s: pq.read_table(p) for s, p in ds.files.items()})
    path.write_text(json.dumps(report, indent=1))
    update_block(out, block, markdown(report, title), after="<!-- /perf:defaults")
    bad = {n: v for n, d in report["datasets"].items() if (v := verdicts(n, d))}
    print("bars: all met" if not bad else f"bars missed: {bad}")


def dataset_args(ap: argparse.ArgumentParser, seeds_help: str, set_help: str) -> list[str]:
    """``--only``, ``--models``, ``--seeds`` and ``--set`` (as ``overrides``), the options
    that choose what a benchmark over these datasets runs; returns every dataset's name."""
    names = [w.name for w in WORLDS] + list(REAL)
    ap.add_argument("--only", nargs="*", default=None,
                    help=f"some of the datasets: {', '.join(names)}")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--seeds", default="auto", type=seeds_arg, help=seeds_help)
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help=set_help)
    return names


def prepared(todo: list[str], worlds: list[World], run_root: Path,
             real: bool = True) -> Iterator[tuple[str, Dataset]]:
    """``(name, Dataset)`` of each of ``todo``: the worlds, then (with ``real``) the
    datasets of ``../shared/data``, skipped with a message where that folder is absent."""
    for w in worlds:
        if w.name in todo:
            yield w.name, prep_world(w, run_root / "data" / w.name)
    for name, prep in REAL.items():
        if name in todo and real:
            if not DATA.exists():
                print(f"skipping {name}: {DATA} is not present")
                continue
            yield name, prep(run_root / "data" / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = dataset_args(
        ap, f"runs per model, seeds 1..N (auto: 3 below {FEW_ROWS:,} training rows, else 1)",
        "a config override for every run, as `sampan train --set` (an ablation: e.g. "
        "model.field_weights_l1=0); write its results elsewhere with --json and --out")
    ap.add_argument("--runs", default=str(ROOT / "runs/bench_defaults"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/defaults.json"))
    ap.add_argument("--out", default=str(ROOT / "RESULTS.md"))
    ap.add_argument("--merge", action="store_true", help="keep the other datasets of --json "
                    "(and, with --models, the other models of each dataset)")
    ap.add_argument("--fresh", type=int, default=0, metavar="N",
                    help="instead of the named datasets, N worlds drawn at random (their own "
                    "JSON file and RESULTS.md section)")
    ap.add_argument("--seed", type=int, default=None,
                    help="the --fresh worlds' seed (default: a new one, printed)")
    ap.add_argument("--refresh", action="store_true",
                    help="train nothing: recompute what belongs to the worlds (what their "
                    "interactions are worth, their true form fitted on their training rows, "
                    "which bars apply; --only some of them) in --json and rewrite its "
                    "section (with --fresh 0 the named datasets', with --fresh 1 the fresh "
                    "worlds')")
    args = ap.parse_args()
    run_root = Path(args.runs).resolve()
    worlds, block, title = WORLDS, "defaults", "defaults"
    command = " ".join(["python benchmarks/defaults.py", *sys.argv[1:]])
    if args.refresh:
        refresh(Path(args.json) if args.json != ap.get_default("json") or not args.fresh
                else ROOT / "benchmarks/results/defaults_fresh.json", Path(args.out),
                "defaults_fresh" if args.fresh else "defaults",
                "defaults, fresh worlds" if args.fresh else "defaults", run_root, args.only,
                command)
        return
    if args.fresh:
        if args.seed is None:
            args.seed = int(time.time()) % 100_000
            command += f" --seed {args.seed}"
        worlds, block, title = fresh_worlds(args.fresh, args.seed), "defaults_fresh", \
            "defaults, fresh worlds"
        names = [w.name for w in worlds]
        if args.json == ap.get_default("json"):
            args.json = str(ROOT / "benchmarks/results/defaults_fresh.json")
        print(f"fresh worlds, seed {args.seed}", flush=True)
    report: dict[str, Any] = {"command": command,
                              "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                              "worlds": {w.name: asdict(w) for w in worlds}, "datasets": {}}
    if args.merge and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        report["datasets"] = old["datasets"]
        report["worlds"] = {**old.get("worlds", {}), **report["worlds"]}
        report["command"] = old["command"] + "; then " + report["command"]
        for d in report["datasets"].values():  # rows measured before: where and when
            d.setdefault("machine", old["machine"]["cpu"])
            d.setdefault("date", old["date"])
    todo = args.only or names
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)

    def evaluate(name: str, ds: Dataset) -> None:
        new = evaluate_dataset(ds, run_root, args.models, args.seeds, args.overrides)
        old = report["datasets"].get(name)
        if args.models and old:  # --merge --models: the other models' rows stay
            models = {**old["models"], **new["models"]}
            new["models"] = {m: models[m] for m in ds.models if m in models}
        new["machine"], new["date"] = report["machine"]["cpu"], report["date"]
        report["datasets"][name] = new
        save()

    def save() -> None:  # after every dataset: a crash later loses nothing
        Path(args.json).write_text(json.dumps(report, indent=1))
        update_block(Path(args.out), block, markdown(report, title), after="<!-- /perf:defaults")

    for name, ds in prepared(todo, worlds, run_root, real=not args.fresh):
        evaluate(name, ds)
    bad = {n: v for n, d in report["datasets"].items() if (v := verdicts(n, d))}
    print("bars: all met" if not bad else f"bars missed: {bad}")
    print(f"wrote {args.json} and the defaults section of {args.out}")


if __name__ == "__main__":
    main()
