"""One source of defaults: what the config guide documents is what a run without a preset
saves."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
import yaml
from rich.console import Console

from sampan.config import ConfigError, load_config
from sampan.train.experiment import run_experiment
from tests.conftest import ROOT


def readme_reference() -> dict:
    """The first YAML block of the config guide (docs/guides/config.md)."""
    section = (ROOT / "docs" / "guides" / "config.md").read_text()
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))


def small_csv(path, rows=400, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 8, rows)
    x = rng.exponential(3.0, rows)
    y = (rng.random(rows) < 1 / (1 + np.exp(-(a % 3 - 1 + 0.2 * x - 0.6)))).astype(int)
    pacsv.write_csv(pa.table({"label": y, "a": [f"v{v}" for v in a], "b": rng.integers(0, 3, rows)
                              .astype(str), "x": x}), path)


def test_readme_defaults_are_what_a_run_without_preset_saves(tmp_path):
    small_csv(tmp_path / "d.csv")
    raw = {"name": "plain", "output_dir": str(tmp_path / "runs"),
           "data": {"train": str(tmp_path / "d.csv")},
           "features": {"categorical": ["a", "b"], "numeric": ["x"]}}
    run = tmp_path / "run"
    run_experiment(load_config(raw=raw), run_dir=run, console=Console(quiet=True))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    doc = readme_reference()
    assert saved["seed"] == doc["seed"]
    for key, value in doc["train"].items():
        assert saved["train"][key] == value, f"train.{key}"
    assert set(doc["train"]) == set(saved["train"]) - {
        "embedding_placement", "shard_min_bytes", "sync_batch_norm"}  # Distributed training
    for key, value in doc["data"].items():
        if key not in ("train",):
            assert saved["data"][key] == value, f"data.{key}"
    for key, value in doc["model"].items():
        assert saved["model"][key] == value, f"model.{key}"
    feats = saved["features"]
    for kind in ("categorical", "numeric"):
        assert feats[f"{kind}_defaults"] == doc["features"][f"{kind}_defaults"]
    # a plain name takes those defaults ...
    a = next(f for f in feats["categorical"] if f["name"] == "a")
    assert a["min_count"] == doc["features"]["categorical_defaults"]["min_count"]
    x = feats["numeric"][0]
    assert {k: x[k] for k in doc["features"]["numeric_defaults"]} == \
        doc["features"]["numeric_defaults"]
    # ... and its bucket twin is written out, so a reload does not add another
    assert [f["name"] for f in feats["categorical"]] == ["a", "b", "x_bucket"]
    again = load_config(run / "config.yaml")
    assert [f.name for f in again.features.categorical] == ["a", "b", "x_bucket"]
    # the schedule the run chose is saved next to the config, with its reasons
    plan = yaml.safe_load((run / "schedule.json").read_text())
    assert plan["chosen"]["batch_size"] == 64 and "sqrt" in plan["reasons"]["batch_size"]
    manifest = yaml.safe_load((run / "data" / "manifest.json").read_text())
    table = {f["feature"]: f for f in manifest["features"]}
    assert table["a"]["kind"] == "categorical" and table["a"]["min_count"] == 1
    assert 0.0 <= table["a"]["oov_share"] <= 1.0
    assert table["x"]["transform"] == "fill mean, log1p, standardize"
    assert table["x_bucket"]["transform"] == "16 quantile buckets"
    # the twin is marked binned in the saved schema (its own L2 in the warm start's LR)
    assert {f["name"]: f["binned"] for f in manifest["schema"]["sparse"]} == \
        {"a": False, "b": False, "x_bucket": True}


def test_user_defaults_add_to_the_package_defaults():
    base = {"data": {"train": "x.csv"}}
    cfg = load_config(raw={**base, "features": {
        "categorical_defaults": {"max_size": 10, "min_count": 2},
        "categorical": ["a", {"name": "b", "min_count": 1}],
        "numeric_defaults": {"fill": 0.0}, "numeric": ["x"]}})
    a, b = cfg.features.categorical[:2]
    assert (a.min_count, a.max_size, b.min_count, b.max_size) == (2, 10, 1, 10)
    x = cfg.features.numeric[0]
    assert (x.fill, x.log1p, x.standardize, x.buckets) == (0.0, True, True, 16)
    # the preset adds to them too
    crit = load_config(None)
    assert crit.features.numeric[0].clip == (0.0, None) and crit.features.numeric[0].log1p
    # a column already bucketized as a category gets no twin
    assert not any(f.name.endswith("_bucket") for f in crit.features.categorical)


def test_split_fractions_renormalise_when_test_has_its_own_file(tmp_path):
    for name, seed in (("train.csv", 0), ("test.csv", 1)):
        small_csv(tmp_path / name, seed=seed)
    raw = {"output_dir": str(tmp_path / "runs"),
           "data": {"train": str(tmp_path / "train.csv"), "test": str(tmp_path / "test.csv"),
                    "split": {"train": 0.9, "valid": 0.1}},
           "features": {"categorical": ["a"]}, "train": {"epochs": 1}}
    res = run_experiment(load_config(raw=raw), run_dir=tmp_path / "run",
                         console=Console(quiet=True))
    assert res["valid"]["rows"] == 40 and res["test"]["rows"] == 400
    raw["data"].pop("test")
    with pytest.raises(ConfigError, match=r"must add up to 1.0, got 1.1"):
        load_config(raw=raw)


def test_switching_the_model_from_the_command_line_drops_foreign_options():
    path = ROOT / "configs" / "criteo_deepfm.yaml"
    cfg = load_config(path, overrides=["model.name=lr"])
    assert cfg.model.name == "lr" and not hasattr(cfg.model, "mlp")
    assert cfg.notices == ["model.name is 'lr' (was 'deepfm' in the file): dropped the "
                           "options 'lr' does not have: model.mlp, model.dropout"]
    assert load_config(path).notices == []
    with pytest.raises(ConfigError, match="unknown key 'mlpp'"):
        load_config(path, overrides=["model.name=lr", "model.mlpp=[3]"])
    # options both models have are kept
    assert load_config(path, overrides=["model.name=dcn_v2"]).model.mlp == [128, 64]
