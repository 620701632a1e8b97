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


def test_bf16_autocast_trains_on_cpu_and_evaluates_in_fp32_as_served(tmp_path):
    results, _ = run(tmp_path, amp="bf16", epochs=1)
    assert 0.5 < results["test"]["auc"] < 1.0
    plan = json.loads((tmp_path / "run" / "schedule.json").read_text())
    assert plan["reasons"]["amp"] == "bf16 (set)" and plan["chosen"]["amp"] == "bf16"
    # the saved model scored in fp32 gives the run's own test figures
    again = RunArtifacts(tmp_path / "run").evaluate("test")
    assert again["auc"] == results["test"]["auc"] and again["logloss"] == results["test"]["logloss"]


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
    raw = {
        "output_dir": str(tmp_path), "data": {"train": str(tmp_path / "d.parquet"),
                                              "split": {"method": "random"}},
        "features": {"categorical": ["user_id", "item_id"]},
        "model": {"name": "two_tower", "embedding_dim": 4, "k": 5},
        "train": {"epochs": 1, "progress": False, "tensorboard": False,
                  "early_stopping": {"metric": "auc"}}}
    # refused when the config loads, before any data is read
    with pytest.raises(ValueError, match=r"'auc', which model 'two_tower' \(task: "
                       r"retrieval\) does not report.*recall@5"):
        load_config(raw=raw)
    # a config changed past that check still fails at the first validation, with the list
    cfg = load_config(raw={**raw, "train": {**raw["train"], "early_stopping": {}}})
    cfg.train.early_stopping.metric = "auc"
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


@pytest.mark.parametrize("resumed", [False, True])
def test_field_pair_weights_take_the_l1_step_at_the_rate_of_the_moment(tmp_path, resumed):
    # one training step of the same FM with and without field_weights_l1: the weights differ
    # by l1 x the pair weights' current learning rate (warmup included), toward 0; a weight
    # the step would carry across 0 stops there. After an optimizer state is loaded (a
    # resume replaces its parameter groups) the step still reads the current rate.
    import numpy as np
    from rich.console import Console

    from sampan.batch import Batch
    from sampan.config import ExperimentConfig
    from sampan.data.store import SplitArrays
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SparseFeatureSpec
    from sampan.train.trainer import Trainer

    schema = DataSchema(sparse=[SparseFeatureSpec(c, 20) for c in "abcd"])
    rng = np.random.default_rng(0)
    rows = SplitArrays(dense=np.zeros((256, 0), np.float32),
                       sparse=rng.integers(0, 20, (256, 4)),
                       labels=(rng.random((256, 1)) < 0.3).astype(np.float32))
    batch = Batch(dense=torch.zeros(256, 0), sparse=torch.as_tensor(rows.sparse),
                  labels=torch.as_tensor(rows.labels))
    after = {}
    for l1 in (0.0, 0.25):
        torch.manual_seed(0)
        cfg = ExperimentConfig.model_validate({
            "features": {"categorical": list("abcd")},
            "model": {"name": "fm", "embedding_dim": 4, "field_weights_l1": l1},
            "train": {"batch_size": 256, "epochs": 1, "lr": 0.004, "warmup_steps": 10,
                      "progress": False, "tensorboard": False,
                      "first_order_warm_start": False}})
        model = build_model(get_model_class("fm").Config(**cfg.model.model_dump()), schema)
        with torch.no_grad():
            model.pairs.weight[1, 0] = 1e-4  # unused (below the diagonal): no Adam step
        trainer = Trainer(model, cfg, tmp_path / str(l1), rows, None,
                          console=Console(quiet=True))
        if resumed:
            trainer.dense_opt.load_state_dict(trainer.dense_opt.state_dict())
        trainer.state.step = 3
        trainer._train_step(batch)
        rate = next(g["lr"] for g in trainer.dense_opt.param_groups
                    if any(p is model.pairs.weight for p in g["params"]))
        after[l1] = model.pairs.weight.detach().clone()
    assert rate == pytest.approx(0.004 * 10 * 4 / 10)  # 10x the dense rate, warmup step 4
    free, shrunk = after[0.0], after[0.25]
    upper = torch.ones(4, 4).triu(1).bool()
    far = upper & (free.abs() > 0.01)
    torch.testing.assert_close(shrunk[far], free[far] - free[far].sign() * 0.25 * rate)
    assert shrunk[1, 0] == 0.0 and free[1, 0] == 1e-4  # the step would cross 0: it stops
