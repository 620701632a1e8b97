"""The Python API: Experiment.from_yaml(...).run() and the object form for notebooks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from sampan import Experiment
from sampan.config import ConfigError
from sampan.errors import MissingPathError
from tests.conftest import tiny_config


def test_from_yaml_with_overrides_runs_and_returns_the_results(tmp_path):
    cfg = tiny_config(tmp_path, rows=2000)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    exp = Experiment.from_yaml(path, overrides=["train.lr=0.01", "model.mlp=[8]"])
    assert exp.config.train.lr == 0.01 and exp.config.model.mlp == [8]
    results = exp.run(run_dir=tmp_path / "run", quiet=True)
    assert exp.run_dir == tmp_path / "run"
    saved = json.loads((exp.run_dir / "results.json").read_text())
    assert results["test"] == saved["test"]
    # the object evaluates and predicts with the run's best model
    assert exp.evaluate("test")["auc"] == pytest.approx(saved["test"]["auc"], abs=1e-9)
    again = Experiment.open(exp.run_dir)
    assert again.evaluate("test")["auc"] == pytest.approx(saved["test"]["auc"], abs=1e-9)
    assert yaml.safe_load(again.to_yaml())["train"]["lr"] == 0.01


def test_object_form_predicts_raw_rows(tmp_path):
    rng = np.random.default_rng(0)
    n = 1500
    a = rng.integers(0, 6, n)
    y = (rng.random(n) < np.where(a < 3, 0.7, 0.2)).astype(int)
    lines = ["label,a,x"] + [f"{y[i]},k{a[i]},{rng.random():.3f}" for i in range(n)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    exp = Experiment(name="nb", output_dir=str(tmp_path / "runs"),
                     data={"train": str(tmp_path / "d.csv")},
                     features={"categorical": ["a"], "numeric": ["x"]},
                     model={"name": "fm", "embedding_dim": 4},
                     train={"progress": False, "tensorboard": False})
    assert repr(exp) == "Experiment(name='nb', model='fm')"
    exp.run(quiet=True)
    probs = exp.predict([str(tmp_path / "d.csv")])
    assert probs.shape == (n, 1)
    # what the data says: ids k0-k2 click far more often than k3-k5
    assert probs[a < 3].mean() > probs[a >= 3].mean() + 0.2


def test_a_misspelt_model_key_fails_from_python_as_from_the_cli(tmp_path):
    base = {"data": {"train": "x.csv"}, "features": {"categorical": ["a"]}}
    with pytest.raises(ConfigError, match=r"unknown key 'mlpp' in model: did you mean 'mlp'"):
        Experiment(base, model={"name": "deepfm", "mlpp": [8]})
    with pytest.raises(ConfigError, match="did you mean 'epochs'"):
        Experiment(base, overrides=["train.epochz=3"])


def test_nothing_to_evaluate_before_run_and_no_run_dir_to_open(tmp_path):
    exp = Experiment({"data": {"train": "x.csv"}, "features": {"categorical": ["a"]}})
    with pytest.raises(MissingPathError, match="has not run yet"):
        exp.evaluate()
    with pytest.raises(MissingPathError, match="not a Sampan run directory"):
        Experiment.open(tmp_path)
    # a config's output folder holds timestamped runs: the error names them, newest first
    for n, name in enumerate(["20261201-100000", "20261202-100000"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("{}")
        os.utime(tmp_path / name / "config.yaml", (n, n))
    with pytest.raises(MissingPathError, match="runs under it, newest first: "
                       f"{tmp_path / '20261202-100000'}, {tmp_path / '20261201-100000'}"):
        Experiment.open(tmp_path)
