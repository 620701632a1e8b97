"""Trainer behaviour driven by config flags, in-process on tiny synthetic data."""

import json

import pytest
import torch

from sampan.config import load_config
from sampan.train.experiment import RunArtifacts, run_experiment
from sampan.train.schedules import lr_factor
from tests.conftest import tiny_config


def run(tmp_path, name="run", rows=2000, **train):
    cfg = load_config(raw=tiny_config(tmp_path, rows=rows, **train))
    results = run_experiment(cfg, run_dir=tmp_path / name)
    records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return results, records


def test_max_steps_eval_every_steps_and_checkpoint_every_steps(tmp_path):
    results, records = run(tmp_path, max_steps=10, eval_every_steps=4, checkpoint_every_steps=3,
                           log_every_steps=2, early_stopping={"enabled": False})
    assert results["steps"] == 10
    assert [r["step"] for r in records if r["split"] == "valid"] == [4, 8]
    # 1,600 train rows / 256 = 7 batches an epoch: every 2nd step plus the end of epoch 0
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 4, 6, 7, 8, 10]
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["state"]["step"] == 10
    assert "deepfm" in state["config"]


def test_schedule_is_applied_to_both_optimizers(tmp_path):
    results, records = run(tmp_path, max_steps=12, warmup_steps=4, log_every_steps=1,
                           lr=0.01, early_stopping={"enabled": False})
    lrs = [r["lr"] for r in records if r["split"] == "train"]
    want = [0.01 * lr_factor(s, 12, 4, "cosine") for s in range(12)]
    assert lrs == pytest.approx(want)


def test_early_stopping_keeps_best_weights(tmp_path):
    # A huge learning rate makes validation AUC fall after the first epoch.
    results, records = run(tmp_path, epochs=6, lr=0.3, sparse_lr=0.3,
                           early_stopping={"patience": 1, "metric": "logloss"})
    valid = [r for r in records if r["split"] == "valid"]
    assert results["stopped_early"]
    assert len(valid) < 6
    best = min(valid, key=lambda r: r["logloss"])
    assert results["best_step"] == best["step"]
    # the final validation metrics are those of the restored best weights
    assert results["valid"]["logloss"] == pytest.approx(best["logloss"], abs=1e-9)
    art = RunArtifacts(tmp_path / "run")
    assert art.evaluate("valid")["logloss"] == pytest.approx(best["logloss"], abs=1e-9)


def test_bf16_autocast_trains_on_cpu(tmp_path):
    results, _ = run(tmp_path, amp="bf16", epochs=1)
    assert 0.5 < results["test"]["auc"] < 1.0


@pytest.mark.parametrize("opt", ["adagrad", "rowwise_adagrad"])
def test_other_sparse_optimizers_learn(tmp_path, opt):
    results, _ = run(tmp_path, sparse_optimizer=opt, sparse_lr=0.05, epochs=2)
    assert results["test"]["auc"] > 0.6


def test_tensorboard_scalars_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = tiny_config(tmp_path, rows=1000, epochs=1)
    cfg["train"]["tensorboard"] = True
    run_experiment(load_config(raw=cfg), run_dir=tmp_path / "tb")
    assert list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))


def test_early_stopping_on_a_metric_the_task_does_not_compute(tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sampan.config import load_config
    from sampan.train.experiment import run_experiment

    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"label": np.ones(400, np.int64),
                             "user_id": [f"u{x}" for x in rng.integers(0, 20, 400)],
                             "item_id": [f"i{x}" for x in rng.integers(0, 30, 400)]}),
                   tmp_path / "d.parquet")
    cfg = load_config(raw={
        "output_dir": str(tmp_path), "data": {"train": str(tmp_path / "d.parquet"),
                                              "split": {"method": "random"}},
        "features": {"categorical": ["user_id", "item_id"]},
        "model": {"name": "two_tower", "embedding_dim": 4, "k": 5},
        "train": {"epochs": 1, "progress": False, "tensorboard": False,
                  "early_stopping": {"metric": "auc"}}})
    with pytest.raises(ValueError, match=r"'auc' is not computed.*recall@5"):
        run_experiment(cfg, run_dir=tmp_path / "run")


def test_a_run_that_ends_before_its_first_evaluation_is_evaluated_once(tmp_path):
    # 1,600 train rows / 256 = 7 steps an epoch: max_steps 3 ends before the epoch-end eval
    results, records = run(tmp_path, max_steps=3, log_every_steps=1)
    assert [r["step"] for r in records if r["split"] == "valid"] == [3]
    assert results["best_step"] == 3
    assert (tmp_path / "run" / "checkpoints" / "best.pt").exists()


def test_a_resumed_run_continues_its_loss_window_and_its_training_time(tmp_path):
    def cfg(max_steps):
        return load_config(raw=tiny_config(
            tmp_path, rows=2000, max_steps=max_steps, epochs=3, log_every_steps=4,
            schedule="constant",
            warmup_steps=0, early_stopping={"enabled": False}))

    straight = run_experiment(cfg(20), run_dir=tmp_path / "straight")
    first = run_experiment(cfg(10), run_dir=tmp_path / "resumed")
    again = run_experiment(cfg(20), run_dir=tmp_path / "resumed", resume=True)

    def losses(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}

    want, got = losses("straight"), losses("resumed")
    assert sorted(got) == sorted(want) and 12 in got  # 12 averages steps 9-12
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert again["steps"] == straight["steps"] == 20
    assert again["train_seconds"] > first["train_seconds"] > 0
