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
