"""The divergence guard: a loss that explodes is caught, recovered from or reported."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from sampan.config import load_config
from sampan.errors import DivergenceError
from sampan.train import checkpoint as ckpt
from sampan.train.experiment import run_experiment
from tests.conftest import tiny_config


def dcn_config(tmp_path, lr: float, **train) -> dict:
    raw = tiny_config(tmp_path, rows=3000, lr=lr, epochs=3, **train)
    raw["model"] = {"name": "dcn_v2", "embedding_dim": 4, "mlp": [16]}
    return raw


def records(run, split):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_recovers_with_a_lower_learning_rate(tmp_path):
    # lr 0.3 blows the validation LogLoss up in the first epoch; at 0.15 it trains
    run = tmp_path / "run"
    res = run_experiment(load_config(raw=dcn_config(tmp_path, 0.3)), run_dir=run,
                         console=Console(quiet=True))
    events = records(run, "divergence")
    assert len(events) == 1 and events[0]["lr_scale"] == 0.5
    assert events[0]["action"] == "recover"
    assert "validation LogLoss" in events[0]["reason"]
    assert math.isfinite(res["test"]["logloss"]) and res["test"]["auc"] > 0.55
    saved = json.loads((run / "results.json").read_text())  # valid JSON, no NaN
    assert saved["test"]["logloss"] == pytest.approx(res["test"]["logloss"])
    last = ckpt.load(run / "checkpoints" / "last.pt")
    assert last["state"]["recoveries"] == 1 and last["state"]["lr_scale"] == 0.5
    assert not (run / "checkpoints" / "start.pt").exists()  # gone with the first last.pt
    # every validation after the recovery is below the guard's bar
    after = [r for r in records(run, "valid") if r["step"] > events[0]["step"]]
    assert after and all(r["logloss"] < 3.4 for r in after)  # 5 x the base rate 0.69


def test_gives_up_after_three_recoveries_and_keeps_a_finite_checkpoint(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(DivergenceError, match=r"training diverged at step \d+: .*3 "
                       "recoveries with halved learning rates did not help.*start.pt"):
        run_experiment(load_config(raw=dcn_config(tmp_path, 1e4)), run_dir=run,
                       console=Console(quiet=True))
    assert [r["action"] for r in records(run, "divergence")] == ["recover"] * 3 + ["stop"]
    assert not (run / "results.json").exists()
    # it diverged in its first epoch: the state kept is the one before the first step
    assert not (run / "checkpoints" / "last.pt").exists()
    start = ckpt.load(run / "checkpoints" / "start.pt")
    assert start["state"]["step"] == 0
    assert all(torch.isfinite(v).all() for v in start["model"].values()
               if v.is_floating_point())


def test_stop_mode_stops_at_the_first_divergence(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(DivergenceError, match="train.on_divergence is 'stop'"):
        run_experiment(load_config(raw=dcn_config(tmp_path, 1e4, on_divergence="stop")),
                       run_dir=run, console=Console(quiet=True))
    assert [r["action"] for r in records(run, "divergence")] == ["stop"]


def test_cli_exits_non_zero_with_one_line(tmp_path):
    cfg = tmp_path / "cfg.json"  # JSON is YAML
    cfg.write_text(json.dumps(dcn_config(tmp_path, 1e4, on_divergence="stop")))
    p = subprocess.run([sys.executable, "-m", "sampan", "train", str(cfg)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "error: training diverged at step" in " ".join(p.stderr.split())
    assert "Traceback" not in p.stderr


def test_a_learning_rate_that_is_not_a_number_is_refused_at_load_time():
    from sampan.config import ConfigError

    for value in (".inf", ".nan"):
        with pytest.raises(ConfigError, match="train.lr: Input should be a finite number"):
            load_config(None, overrides=[f"train.lr={value}"])


def test_memorising_the_training_rows_stops_early_instead_of_diverging(tmp_path):
    # the validation rows are the training rows with every label flipped: a model that
    # memorises its rows (training loss near 0) has a validation LogLoss far above 5 x the
    # base rate's without being broken. That is overfitting: the run stops early and keeps
    # its best step; a halved learning rate would only memorise more slowly
    from sampan.data.store import SplitArrays
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SparseFeatureSpec
    from sampan.train.trainer import Trainer

    n = 512
    rng = torch.Generator().manual_seed(0)
    ids = torch.arange(n).numpy()[:, None]
    y = (torch.rand(n, 1, generator=rng) < 0.5).float().numpy()
    train = SplitArrays(dense=torch.zeros(n, 0).numpy(), sparse=ids, labels=y)
    valid = SplitArrays(dense=torch.zeros(n, 0).numpy(), sparse=ids, labels=1.0 - y)
    cfg = load_config(raw={
        "features": {"categorical": ["id"]}, "model": {"name": "lr"},
        "train": {"batch_size": 64, "epochs": 30, "lr": 0.5, "embedding_l2": 0.0,
                  "first_order_warm_start": False, "progress": False, "tensorboard": False,
                  "early_stopping": {"metric": "auc", "patience": 100}}})
    schema = DataSchema(dense=[], sparse=[SparseFeatureSpec("id", n)])
    torch.manual_seed(0)
    model = build_model(get_model_class("lr").Config(name="lr"), schema)
    trainer = Trainer(model, cfg, tmp_path, train, valid, console=Console(quiet=True))
    state = trainer.fit()  # no DivergenceError
    assert state.stopped_early and state.recoveries == 0
    assert trainer.stopped_by.startswith("overfitting: the validation LogLoss is")
    last = state.history[-1]
    assert last["logloss"] > 5 * math.log(2) and trainer.last_train_loss < 0.1
    assert state.step < 30 * n // 64
    assert not records(tmp_path, "divergence")
