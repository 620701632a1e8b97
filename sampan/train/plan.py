"""A training budget that sizes itself to the data: the ``auto`` values of ``TrainConfig``.

The rules, each a pure function of the training rows (so a resumed run plans the same):

* ``batch_size``: the power of two nearest ``sqrt(rows)``, 64 to 4096 (8k rows: 64, 360k:
  512, 1M: 1024, 10M: 4096), so small data still gets hundreds of optimizer steps per epoch
  and large data keeps the throughput of large batches.
* ``embedding_l2``: ``0.1 / batch_size``. The lazy L2 is added once per batch a row appears
  in, while the data gradient of a row shrinks with the batch, so the same regularisation per
  example needs ``l2 * batch`` constant (``1e-4`` at batch 1024).
* ``epochs``: until validation stops improving (early stopping), at most the epochs that give
  30,000 steps, 3 to 30. Without a validation split there is nothing to stop on: 3 epochs.
* ``eval_every_steps``: once per epoch, or four times per epoch (at least 100 steps apart)
  when an epoch is longer than 400 steps: CTR models with large tables often peak inside the
  first epoch.
* ``warmup_steps``: a tenth of an epoch, 10 to 200 steps.
* ``early_stopping.patience``: two epochs' worth of evaluations without improvement (on the
  best so far; while a warm-started model is still below its LR start, also on its own best
  evaluation: see ``Trainer._evaluate_and_track``).
* ``first_order_warm_start``: on for models that can start from an LR (those with
  first-order terms: LR, whose whole model it is, FM, DeepFM, ...; and DCN / DCN-V2, through
  their field vectors) when there is a validation split; see :mod:`sampan.train.warm_start`.
* ``early_stopping.metric``: AUC, or LogLoss when the validation split has under 100
  positives or negatives: there AUC's sampling error (about 0.04) is larger than the changes
  early stopping has to see.

>>> from sampan.config import TrainConfig
>>> p = plan_training(TrainConfig(), n_train=8000, valid_labels=None)
>>> p.train.batch_size, p.train.epochs, p.train.warmup_steps, p.train.eval_every_steps
(64, 3, 12, None)
>>> plan_training(TrainConfig(batch_size=256), n_train=8000).train.batch_size   # explicit wins
256
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sampan.config import ConfigError, TrainConfig

MIN_BATCH, MAX_BATCH = 64, 4096
TARGET_STEPS = 30_000
MIN_AUTO_EPOCHS, MAX_AUTO_EPOCHS = 3, 30
FEW_LABELS = 100


@dataclass
class TrainingPlan:
    """``train``: the config with every ``auto`` resolved; ``reasons``: why, per key."""

    train: TrainConfig
    reasons: dict[str, str] = field(default_factory=dict)
    steps_per_epoch: int = 0

    def to_json(self) -> dict[str, Any]:
        keys = ("batch_size", "epochs", "embedding_l2", "warmup_steps", "eval_every_steps",
                "first_order_warm_start", "amp")
        return {"steps_per_epoch": self.steps_per_epoch,
                "chosen": {k: getattr(self.train, k) for k in keys},
                "early_stopping_metric": self.train.early_stopping.metric,
                "reasons": self.reasons}


def auto_batch_size(n_train: int) -> int:
    """The power of two nearest ``sqrt(n_train)`` (in log scale), within 64 .. 4096."""
    if n_train <= 0:
        return MIN_BATCH
    b = 2 ** round(math.log2(math.sqrt(n_train)))
    return int(min(MAX_BATCH, max(MIN_BATCH, b)))


def plan_training(tc: TrainConfig, n_train: int, valid_labels: np.ndarray | None = None,
                  default_metric: str = "auc", world: int = 1,
                  first_order: bool = False, patience_epochs: int = 2,
                  lr_model: bool = False) -> TrainingPlan:
    """Resolve the ``auto`` values of ``tc`` for ``n_train`` training rows.

    ``valid_labels`` ``[N, T]`` (or ``None`` without a validation split) decides the early
    stopping metric of binary tasks; ``default_metric`` is the task's (``recall@K`` for
    retrieval keeps itself); ``world`` processes share the global batch; ``first_order``:
    the model can start from an LR (:func:`~sampan.layers.embed.lr_start_part`);
    ``patience_epochs``: the epochs of evaluations ``early_stopping.patience: auto`` waits
    for (the task's: 10 for next-item models, 2 otherwise); ``lr_model``: the model is an
    LR, whose warm start is an exact fit or none.
    """
    reasons: dict[str, str] = {}
    upd: dict[str, Any] = {}
    has_valid = valid_labels is not None and len(valid_labels) > 0

    batch = tc.batch_size
    if batch == "auto":
        batch = max(auto_batch_size(n_train), 2 * world)
        reasons["batch_size"] = f"{batch}: the power of two nearest sqrt({n_train:,} rows)"
    upd["batch_size"] = batch
    steps = max(1, -(-n_train // batch))

    if tc.embedding_l2 == "auto":
        upd["embedding_l2"] = 0.1 / batch
        reasons["embedding_l2"] = (f"{0.1 / batch:.3g}: 0.1 / batch {batch}, the same "
                                   "regularisation per example at any batch size")
    if tc.epochs == "auto":
        if has_valid:
            cap = min(MAX_AUTO_EPOCHS, max(MIN_AUTO_EPOCHS, -(-TARGET_STEPS // steps)))
            reasons["epochs"] = (f"up to {cap} ({steps:,} steps each), stopping when validation "
                                 "stops improving")
        else:
            cap = MIN_AUTO_EPOCHS
            reasons["epochs"] = f"{cap}: no validation split to stop on"
        upd["epochs"] = cap
    if tc.eval_every_steps == "auto":
        if steps > 400:
            every = max(100, -(-steps // 4))
            upd["eval_every_steps"] = every
            reasons["eval_every_steps"] = f"{every}: four evaluations per {steps:,}-step epoch"
        else:
            upd["eval_every_steps"] = None
            reasons["eval_every_steps"] = "once per epoch"
    if tc.warmup_steps == "auto":
        warm = min(200, max(10, steps // 10))
        upd["warmup_steps"] = warm
        reasons["warmup_steps"] = f"{warm}: a tenth of an epoch, 10 to 200"

    warm = tc.first_order_warm_start
    if warm == "auto":
        sgd_lr = lr_model and tc.first_order_solver == "sgd"
        warm = first_order and has_valid and not sgd_lr
        if first_order:
            reasons["first_order_warm_start"] = (
                "on: the model starts as an LR fitted first" if warm else
                "off: no validation split to stop the LR on" if not has_valid else
                "off: the model is an LR, and an SGD fit of it would be the model itself "
                "(train.first_order_solver: sgd)")
    elif warm and not first_order:
        raise ConfigError("train.first_order_warm_start: true, but this model cannot "
                          "start from an LR (no first-order terms, and no output layer "
                          "reading its field vectors directly); expected false or auto")
    upd["first_order_warm_start"] = bool(warm)

    es = tc.early_stopping
    if es.patience == "auto":
        every = upd.get("eval_every_steps", tc.eval_every_steps)
        per_epoch = 1 if every is None else max(1, round(steps / every))
        es = es.model_copy(update={"patience": patience_epochs * per_epoch})
    if tc.early_stopping.patience == "auto" and has_valid and es.enabled:
        reasons["early_stopping.patience"] = (
            f"{patience_epochs * per_epoch}: {patience_epochs} epochs of evaluations without "
            "improvement " + ("(a signal that only interactions carry can take more than an "
                              "epoch to show)" if patience_epochs <= 2 else
                              "(a next-item model's ranking metric can stall for several "
                              "epochs before it climbs)"))
    if es.metric is None and has_valid and default_metric == "auc":
        y = np.asarray(valid_labels, dtype=np.float64)
        pos = int(y[:, 0].sum()) if y.ndim == 2 else int(y.sum())
        few = min(pos, len(y) - pos)
        if few < FEW_LABELS:
            es = es.model_copy(update={"metric": "logloss"})
            reasons["early_stopping.metric"] = (
                f"logloss: the validation split has only {few} "
                f"{'positives' if pos <= len(y) - pos else 'negatives'}, too few for AUC "
                "to steer by")
        else:
            es = es.model_copy(update={"metric": default_metric})
    elif es.metric is None:
        es = es.model_copy(update={"metric": default_metric})
    upd["early_stopping"] = es
    resolved = tc.model_copy(update=upd)
    return TrainingPlan(resolved, reasons, steps)
