"""First-order warm start: fit a logistic regression on the same rows first, then start the
model's linear terms from it.

Why: a model with first-order weights *and* latent vectors (FM, DeepFM, Wide & Deep,
xDeepFM, FiBiNET, AutoInt) peaks on validation after one or two epochs, when its interaction
part starts to memorise; a logistic regression on the same ids keeps improving for ten epochs
and more. Trained together, the model stops with under-fitted first-order weights. Fitted
first (until its own validation stops improving) and copied in, the first-order part starts
where an LR ends, and the model's step-0 evaluation makes that LR the floor of the run: the
weights kept are never worse on validation than the LR they started from.

The LR trains in ``<run>/first_order/`` with the run's own training settings (its ``auto``
values resolved for it) except its length: with a validation split it trains until validation
stops improving (``epochs: auto``), whatever epochs the model was given. Its steps are cheap
(its table has one column). ``auto`` turns it on only with a validation split. Under a
distributed launch the LR trains data-parallel like the model, its table replicated, and a
row-sharded model takes the rows it holds.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console

from sampan.distributed.sharded_embedding import RowShardedCollection
from sampan.layers.embed import FeatureEmbedding, first_order_part
from sampan.models.lr import LR
from sampan.train.trainer import Trainer

DIRNAME = "first_order"


def copy_first_order(source: FeatureEmbedding, target: FeatureEmbedding) -> None:
    """Copy an LR's weights (bias, each id's weight, the numeric weights) into ``target``'s
    first-order terms; the latent vectors are left as they are."""
    src_table, table = source.embedding, target.embedding
    src, dst = src_table.weight, table.weight
    if src_table.num_rows != table.num_rows or source.tasks != target.tasks:
        raise RuntimeError(f"first-order warm start: the LR has {src_table.num_rows} rows x "
                           f"{source.tasks} tasks, the model {table.num_rows} x "
                           f"{target.tasks}; they must be built from the same schema")
    # a row-sharded model holds rows [lo, hi): of a whole LR table, or the LR's same shard
    if isinstance(table, RowShardedCollection) and \
            not isinstance(src_table, RowShardedCollection):
        src = src[table.lo: table.hi]
    elif src.shape[0] != dst.shape[0]:
        raise RuntimeError("first-order warm start: the LR's table is row-sharded and the "
                           "model's is not")
    # dynamic tables: the model takes the LR's keys -> rows (and its step), so that the
    # rows copied are the same keys'
    for name, index in table.dynamic.items():
        index.load_state_dict(src_table.dynamic[name].state_dict())
    if table.dynamic:
        table.dynamic_step.copy_(src_table.dynamic_step)
    with torch.no_grad():
        dst[:, : target.tasks].copy_(src[:, : source.tasks])
        target.bias.copy_(source.bias)
        if target.dense_linear is not None and source.dense_linear is not None:
            target.dense_linear.weight.copy_(source.dense_linear.weight)


def fit_first_order(trainer: Trainer) -> dict[str, Any]:
    """Train an LR with ``trainer``'s config and rows and copy it into ``trainer.model``,
    before ``trainer.fit()``: the fit then keeps the LR's output bias and evaluates the
    warm-started model at step 0. Returns what the run reports (``results.json``:
    ``first_order_warm_start``) and sets ``trainer.warm_start`` to it.
    """
    target = first_order_part(trainer.model)
    if target is None:
        raise ValueError(f"{type(trainer.model).__name__} has no first-order terms to warm-start")
    cfg = trainer.cfg
    lr_cfg = cfg.model_copy(update={
        "model": LR.Config(embedding_init_std=cfg.model.embedding_init_std),
        # its own plan from the user's values, but its own length: an epoch count chosen for
        # the model would stop an LR long before it converges; nothing to compile or show
        "train": cfg.train.model_copy(update={
            "compile": False, "tensorboard": False, "progress": False,
            "first_order_warm_start": False,
            **({"epochs": "auto", "max_steps": None} if trainer.valid_data is not None
               else {})})})
    t0 = time.perf_counter()
    torch_state = torch.get_rng_state()  # the model's own run draws what it would have drawn
    lr = LR(target.schema, lr_cfg.model)
    sub = Trainer(lr, lr_cfg, trainer.run_dir / DIRNAME, trainer.train_data,
                  trainer.valid_data, console=Console(quiet=True),
                  strategy=trainer.strategy)  # data-parallel as the model is
    state = sub.fit()
    torch.set_rng_state(torch_state)
    copy_first_order(lr.features.to(trainer.device), target)
    # the LR's validation metrics at its kept (best) step: recorded when it was evaluated
    valid = next((r for r in state.history if r["split"] == "valid"
                  and r["step"] == state.best_step), {})
    out = {"steps": state.step, "best_step": state.best_step,
           "seconds": round(time.perf_counter() - t0, 2),
           "valid": {k: v for k, v in valid.items() if k in ("auc", "logloss")}}
    shown = " ".join(f"{k} {v:.4f}" for k, v in out["valid"].items())
    trainer.console.print(f"first-order warm start: an LR on the same rows, best at step "
                          f"{state.best_step:,} of {state.step:,} (valid {shown}, "
                          f"{out['seconds']:.0f} s), starts the model's linear terms")
    trainer.warm_start = out
    return out
