"""Multi-task models train on two labels and report per-task metrics."""

import numpy as np
import pytest

from sampan.config import load_config
from sampan.train.experiment import run_experiment

MODELS = {"mmoe": {"expert_mlp": [16], "tower_mlp": [8]},
          "ple": {"expert_mlp": [16], "tower_mlp": [8]},
          # ESMM's labels: click, and click-and-buy over every impression (as here)
          "esmm": {"tower_mlp": [16, 8]}}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_two_labels_learn(tmp_path, model):
    rng = np.random.default_rng(0)
    n = 3000
    u = rng.integers(0, 30, n)
    i = rng.integers(0, 40, n)
    click = (rng.random(n) < np.where(u % 3 == 0, 0.7, 0.2)).astype(int)
    buy = (click & (rng.random(n) < np.where(i % 2 == 0, 0.6, 0.1))).astype(int)
    path = tmp_path / "d.csv"
    path.write_text("click,buy,u,i\n" + "".join(f"{c},{b},u{a},i{d}\n"
                                                  for c, b, a, d in zip(click, buy, u, i,
                                                                        strict=True)))
    cfg = load_config(raw={
        "output_dir": str(tmp_path), "data": {"train": str(path)},
        "features": {"label": ["click", "buy"], "categorical": ["u", "i"]},
        "model": {"name": model, "embedding_dim": 8, **MODELS[model]},
        "train": {"epochs": 3, "batch_size": 128, "lr": 0.01, "progress": False,
                  "tensorboard": False}})
    results = run_experiment(cfg, run_dir=tmp_path / "run")
    test = results["test"]
    # both tasks are learnable from the ids: well above chance
    assert test["auc_0"] > 0.6 and test["auc_1"] > 0.6
    assert test["auc"] == test["auc_0"]


def test_labels_derived_from_one_column(tmp_path):
    from sampan.data.store import build_store

    rng = np.random.default_rng(1)
    ratings = rng.integers(1, 6, 400)
    path = tmp_path / "r.csv"
    path.write_text("rating,u\n" + "".join(f"{r},u{i % 7}\n" for i, r in enumerate(ratings)))
    cfg = load_config(raw={
        "data": {"train": str(path), "split": {"train": 1.0, "valid": 0.0, "test": 0.0}},
        "features": {"label": [{"name": "liked", "column": "rating", "threshold": 4},
                               {"name": "loved", "column": "rating", "threshold": 5}],
                     "categorical": ["u"]}})
    store = build_store(cfg, tmp_path / "store", echo=lambda *_: None)
    assert store.schema.labels == ["liked", "loved"]
    y = store.split("train").labels
    assert y[:, 0].tolist() == [float(r >= 4) for r in ratings]
    assert y[:, 1].tolist() == [float(r == 5) for r in ratings]
    # without a threshold the same column is a label that must lie in [0, 1]
    with pytest.raises(Exception, match="rating"):
        bad = load_config(raw={"data": {"train": str(path)},
                               "features": {"label": "rating", "categorical": ["u"]}})
        build_store(bad, tmp_path / "bad", echo=lambda *_: None)
