"""The self-sizing training plan (train.* = auto) and the output-bias start."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampan.config import EarlyStoppingConfig, TrainConfig
from sampan.data.store import SplitArrays
from sampan.schema import DataSchema, SparseFeatureSpec
from sampan.tasks import BinaryTask
from sampan.train.plan import auto_batch_size, plan_training


@pytest.mark.parametrize("rows,batch", [(100, 64), (8_000, 64), (20_000, 128),
                                        (360_000, 512), (1_000_000, 1024),
                                        (10_000_000, 4096), (10 ** 9, 4096)])
def test_batch_is_the_power_of_two_nearest_sqrt_rows(rows, batch):
    assert auto_batch_size(rows) == batch
    assert plan_training(TrainConfig(), rows).train.batch_size == batch


def test_budget_follows_the_data():
    half = np.arange(1000)[:, None] % 2  # 500 positives
    small = plan_training(TrainConfig(), 8_000, half)
    steps = -(-8_000 // 64)  # 125 per epoch
    assert small.steps_per_epoch == steps
    assert small.train.epochs == 30  # capped: 30,000 / 125 = 240 epochs
    assert small.train.eval_every_steps is None  # once per epoch
    assert small.train.warmup_steps == 12
    assert small.train.embedding_l2 == pytest.approx(0.1 / 64)
    assert small.train.early_stopping.patience == 2  # two epochs, one evaluation each
    big = plan_training(TrainConfig(), 10_000_000, half)
    per_epoch = -(-10_000_000 // 4096)  # 2,442
    assert big.train.epochs == 13  # ceil(30,000 / 2,442)
    assert big.train.eval_every_steps == -(-per_epoch // 4)
    assert big.train.warmup_steps == 200
    assert big.train.embedding_l2 == pytest.approx(0.1 / 4096)
    assert big.train.early_stopping.patience == 8  # two epochs of four evaluations
    # a next-item task waits ten epochs: its ranking metric can stall for several
    nxt = plan_training(TrainConfig(), 8_000, half, "ndcg@10", patience_epochs=10)
    assert nxt.train.early_stopping.patience == 10
    assert "stall" in nxt.reasons["early_stopping.patience"]
    assert set(big.reasons) >= {"batch_size", "epochs", "eval_every_steps", "warmup_steps",
                                "embedding_l2"}


def test_without_validation_there_is_nothing_to_stop_on():
    p = plan_training(TrainConfig(), 50_000, None)
    assert p.train.epochs == 3 and "no validation" in p.reasons["epochs"]


def test_explicit_values_win():
    tc = TrainConfig(batch_size=100, epochs=2, warmup_steps=0, eval_every_steps=7,
                     embedding_l2=0.0, early_stopping=EarlyStoppingConfig(metric="auc",
                                                                          patience=3))
    p = plan_training(tc, 10_000_000, np.zeros((50, 1)))
    assert (p.train.batch_size, p.train.epochs, p.train.warmup_steps,
            p.train.eval_every_steps, p.train.embedding_l2) == (100, 2, 0, 7, 0.0)
    assert p.train.early_stopping.metric == "auc" and p.reasons == {}
    assert p.train.early_stopping.patience == 3


def test_few_validation_positives_steer_by_logloss():
    y = np.zeros((500, 1))
    y[:12] = 1  # 12 positives: AUC's sampling error is several hundredths
    p = plan_training(TrainConfig(), 5_000, y)
    assert p.train.early_stopping.metric == "logloss"
    assert "only 12 positives" in p.reasons["early_stopping.metric"]
    y[:250] = 1
    assert plan_training(TrainConfig(), 5_000, y).train.early_stopping.metric == "auc"
    # a retrieval task keeps its own metric
    assert plan_training(TrainConfig(), 5_000, y[:20],
                         default_metric="recall@50").train.early_stopping.metric == "recall@50"


def test_global_batch_gives_every_process_two_rows():
    assert plan_training(TrainConfig(), 100, world=64).train.batch_size == 128


def test_output_bias_starts_at_the_base_rate():
    from sampan.models import build_model, get_model_class

    schema = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 50),
                                             SparseFeatureSpec("b", 20)])
    rng = np.random.default_rng(0)
    n = 3000
    data = SplitArrays(dense=rng.normal(size=(n, 1)).astype(np.float32),
                       sparse=rng.integers(0, 20, size=(n, 2)),
                       labels=(rng.random((n, 1)) < 0.07).astype(np.float32))
    base = float(data.labels.mean())
    for name in ("lr", "fm", "deepfm", "dcn_v2", "autoint", "xdeepfm", "fibinet"):
        torch.manual_seed(0)
        model = build_model(get_model_class(name).Config(name=name, embedding_dim=4), schema)
        note = BinaryTask().init_output_bias(model, data, torch.device("cpu"))
        assert note is not None, name
        model.eval()
        with torch.no_grad():
            from sampan.data.loader import BatchLoader

            batch = next(iter(BatchLoader(data, n, shuffle="none", prefetch=0)))
            mean_logit = model(batch).mean().item()
        assert mean_logit == pytest.approx(np.log(base / (1 - base)), abs=1e-4), name
