"""The defaults benchmark's fresh worlds: new shapes for every seed, the same for one."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from sampan.data.synthetic import iter_world

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_fresh_worlds_are_drawn_anew_per_seed_within_their_ranges():
    sys.path.insert(0, str(BENCH))
    try:
        fresh_worlds = importlib.import_module("defaults").fresh_worlds
    finally:
        sys.path.remove(str(BENCH))
    a, c = fresh_worlds(8, 1), fresh_worlds(8, 2)
    assert a == fresh_worlds(8, 1) and a != c
    assert len({w.name for w in a + c}) == 16
    for w in a + c:
        assert 10_000 <= w.rows <= 300_000 and 3 <= w.categorical <= 30
        assert 2 <= w.vocab[0] <= 50 < 100 <= w.vocab[1] <= 500_000
        assert 0.03 <= w.base_rate <= 0.4 and 0 <= w.numeric <= 12
        assert (w.pairs == 0) == (w.interaction == 0)
    # different shapes, not one shape drawn twice
    assert len({(w.categorical, w.pairs, w.numeric) for w in a}) > 4
    # each generates, with the true probabilities beside the labels
    t = next(iter_world(replace(a[0], rows=500)))
    p = t.column("oracle_p").to_numpy()
    assert t.num_rows == 500 and ((p > 0) & (p < 1)).all() and np.isfinite(p).all()


def test_what_a_worlds_interactions_are_worth():
    from sampan.data.synthetic import World, interaction_value

    base = dict(rows=20_000, categorical=6, vocab=(5, 60), seed=3)
    full, first = interaction_value(World("additive", pairs=0, interaction=0.0, **base), 20_000)
    assert full == first and 0.6 < full < 1.0
    strong = World("strong", pairs=6, interaction=0.9, **base)
    full, first = interaction_value(strong, 20_000)
    assert full - first > 0.05  # the pairs carry much of the signal
    assert interaction_value(strong, 20_000) == (full, first)  # a property of the world
    weak = interaction_value(World("weak", pairs=1, interaction=0.2, **base), 20_000)
    assert 0 <= weak[0] - weak[1] < full - first


def _bench(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def test_small_datasets_train_three_seeds_and_the_rest_one():
    seeds_for = _bench("defaults").seeds_for
    assert seeds_for(18_000, "auto") == [1, 2, 3]
    assert seeds_for(163_000, "auto") == [1]
    assert seeds_for(163_000, "2") == [1, 2]


def test_regenerating_the_accuracy_tables_keeps_every_other_benchmarks_block(tmp_path):
    """RESULTS.md holds the defaults and the fresh-worlds blocks below the accuracy tables;
    rewriting the tables must carry both (it once kept only the first)."""
    kept_sections = _bench("accuracy").kept_sections
    doc = tmp_path / "RESULTS.md"
    doc.write_text("# Results\n## criteo_10k\n| table |\n\n<!-- perf:defaults -->\n## defaults\n"
                   "A\n<!-- /perf:defaults -->\n\n<!-- perf:defaults_fresh -->\n## fresh\nB\n"
                   "<!-- /perf:defaults_fresh -->\n")
    kept = kept_sections(doc)
    assert "## criteo_10k" not in kept
    assert kept.index("<!-- perf:defaults -->") < kept.index("<!-- perf:defaults_fresh -->")
    assert "\nA\n" in kept and "\nB\n" in kept and kept.count("<!-- /perf:") == 2


def test_a_worlds_true_form_without_pairs_is_the_tuned_lr(tmp_path):
    """With no pairs the fitted objective is scikit-learn's own (its design, its C): the
    fit starts at the LR's optimum and stays there."""
    import pyarrow.parquet as pq
    import torch
    from sklearn.linear_model import LogisticRegression

    from sampan.data.synthetic import World

    bench, tf = _bench("defaults"), _bench("true_form")
    ds = bench.prep_world(World("w", rows=4_000, categorical=4, vocab=(5, 40), numeric=2,
                                pairs=0, interaction=0.0, seed=5), tmp_path,
                          test_rows=2_000)
    tables = {s: pq.read_table(p) for s, p in ds.files.items()}
    x = bench.lr_features(ds, tables)
    base = bench.tuned_lr(ds, tables, x)
    y = {s: t.column("label").to_numpy().astype(np.float64) for s, t in tables.items()}
    fit = tf.fit_true_form(x, y, base["coef"], base["intercept"], base["C"], tables, [])
    # the benchmark's LR stops at tol 1e-4 (logits up to 0.01 off its optimum); this one
    # is scikit-learn's solver run to the optimum
    exact = LogisticRegression(C=base["C"], tol=1e-10, max_iter=20_000).fit(x["train"],
                                                                            y["train"])
    assert torch.allclose(fit["test_logits"], torch.from_numpy(
        exact.decision_function(x["test"])), atol=1e-3)


def test_a_worlds_true_form_finds_pairs_its_rows_can_show(tmp_path):
    import pyarrow.parquet as pq

    from sampan.data.synthetic import World

    bench = _bench("defaults")
    strong = bench.prep_world(World("strong", rows=12_000, categorical=4, vocab=(5, 40),
                                    pairs=3, interaction=0.9, seed=3), tmp_path / "strong",
                             test_rows=5_000)
    assert strong.interactions and len(strong.pairs) == 3
    tables = {s: pq.read_table(p) for s, p in strong.files.items()}
    out = bench.true_form(strong, tables)
    assert out["learnable"] and out["vs_lr"] > 0.03
    assert out["l2"] in _bench("true_form").L2_PATH
    # the report's bar: "clearly above the LR" applies only where the true form is
    d = {"interactions": True, "true_form": {**out, "learnable": False},
         "rows": {"train": 9_600}, "models": {"fm": {"vs_lr": 0.0, "vs_lr_ci95": [-0.01, 0.01],
                                                     "divergences": 0}}}
    assert bench.verdicts("w", d) == []
    d["true_form"]["learnable"] = True
    assert bench.verdicts("w", d) == ["fm not clearly above LR"]
    assert "the rows cannot show" not in bench.true_form_note(d)


def test_rows_merged_from_another_machine_say_where_they_were_measured():
    note = _bench("defaults").machines_note
    report = {"machine": {"cpu": "B"}, "datasets": {
        "w1": {"machine": "A", "date": "2026-12-02"}, "w2": {"machine": "B"}, "w3": {}}}
    assert note(report) == " Measured on A (2026-12-02), with its own s: w1."
    del report["datasets"]["w1"]
    assert note(report) == ""


def test_a_small_worlds_test_rows_are_a_fresh_draw_from_the_same_world(tmp_path):
    """Train and valid are the world's own first 80 % / next 10 %; where its own last 10 %
    are too few to tell models apart, the test rows are drawn afresh: other rows, the same
    labelling model (its ids, its base rate)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from sampan.data.synthetic import World

    bench = _bench("defaults")
    w = World("w", rows=3_000, categorical=3, vocab=(5, 40), numeric=1, base_rate=0.3, seed=9)
    own = pa_concat(iter_world(w))
    ds = bench.prep_world(w, tmp_path, test_rows=20_000)
    t = {s: pq.read_table(p) for s, p in ds.files.items()}
    assert (t["train"].num_rows, t["valid"].num_rows, t["test"].num_rows) == (2_400, 300, 20_000)
    assert t["train"].equals(own.slice(0, 2_400)) and t["valid"].equals(own.slice(2_400, 300))
    assert "tested on 20,000 rows drawn afresh" in ds.about
    p_own, p_new = own.column("oracle_p").to_numpy(), t["test"].column("oracle_p").to_numpy()
    assert abs(p_new.mean() - 0.3) < 0.02 and abs(p_own.mean() - p_new.mean()) < 0.03
    assert np.isin(p_new, p_own).mean() < 0.2  # other rows (a few repeat: small vocabularies)
    # the same world: each id keeps its token, so the most frequent token of every field
    # is the same in both samples (another world's permutation would move it)
    def top(col):
        counts = pc.value_counts(col.drop_null().combine_chunks())
        return counts[int(np.argmax(counts.field("counts").to_numpy()))]["values"].as_py()

    for c in ("c1", "c2", "c3"):
        assert top(own.column(c)) == top(t["test"].column(c))
    # the draw is part of the world: the same every time, other for another draw number
    again = pa_concat(iter_world(w, draw=1, rows=20_000))
    assert again.equals(t["test"])
    assert not pa_concat(iter_world(w, draw=2, rows=500)).equals(again.slice(0, 500))
    # a large world keeps its own test split; an earlier run's files are rewritten
    assert bench.world_test(World("big", rows=1_000_000, categorical=3, vocab=(5, 40))) == \
        {"draw": 0, "rows": 100_000}
    bench.prep_world(w, tmp_path, test_rows=100)
    assert pq.read_table(tmp_path / "test.parquet").equals(own.slice(2_700, 300))


def pa_concat(tables):
    import pyarrow as pa

    return pa.concat_tables(list(tables))
