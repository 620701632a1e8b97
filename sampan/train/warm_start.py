"""First-order warm start: fit a logistic regression on the same rows first, then start the
model's linear terms from it.

Why: a model with first-order weights *and* latent vectors (FM, DeepFM, Wide & Deep,
xDeepFM, FiBiNET, AutoInt, DCN-V2 with ``first_order``) peaks on validation after one or two
epochs, when its interaction part starts to memorise; a logistic regression on the same ids
keeps improving for ten epochs and more. Trained together, the model stops with under-fitted
first-order weights. Fitted first (until its own validation stops improving) and copied in,
the first-order part starts where an LR ends, and the step-0 evaluation makes that LR the
floor of the run: the weights kept are never worse on validation than the LR they started
from. For the ``lr`` model the first-order part is the whole model: the warm start makes it
the tuned LR (an LR trained by mini-batch Adam with early stopping ended up to 0.03 AUC
below one).

DCN and DCN-V2 (parallel structure) have no first-order terms: there the LR's id weights go
into the first column of each id's vector (column ``t`` for task ``t``), the output layer
reads that column of every field plus the numeric features with the LR's weights (every
other input at 0), and the crosses start at zero, so the cross network is the identity: at
step 0 the model is the LR exactly. Nothing is frozen; the vectors carry the LR on and the
crosses and the MLP learn what it leaves out. Started cold, DCN-V2 ended below the tuned LR
on the defaults benchmark's additive world and 2M-id world (its ids' first-order effects
learned through the output layer and stopped early, under-fitted); with a separate wide part
warm-started and frozen instead, it stayed at its LR start on Frappe and MovieLens-100k
(the interactions, on top of a fitted LR, learn from a small residual through small vectors;
here the vectors start as large as the LR's weights).

How the LR is fitted (``train.first_order_solver``):

* ``lbfgs`` (what ``auto`` picks whenever it can): the exact L2-regularised optimum over all
  training rows, its C chosen on validation (:mod:`sampan.train.exact_lr`), as a tuned
  scikit-learn LR would be. Needs one process holding the rows' ids in memory, fitted
  vocabularies and a binary task.
* ``sgd``: a Trainer of its own in ``<run>/first_order/`` with the run's training settings
  (its ``auto`` values resolved for it) except its length: it trains until validation stops
  improving (``epochs: auto``), whatever epochs the model was given. Under a distributed
  launch it trains data-parallel like the model, its table replicated, and a row-sharded
  model takes the rows it holds.

Either way its weights are in ``<run>/first_order/checkpoints/best.pt``.

Its time is bounded by the training it precedes: an exact fit gets a third
(:data:`BUDGET_SHARE`) of that training's estimated time, so at most a quarter of the two
together, and at least :data:`BUDGET_FLOOR` seconds; one whose design holds at most
:data:`UNBOUNDED_NONZEROS` ids is not bounded (it takes seconds anyway, and is then the same
on every machine) (:func:`training_estimate`: a few
training steps timed, and undone, times the steps of a run that improves for two epochs).
Past it the fit ends its ``C`` search with the best ``C`` so far (its id weights keep
training when that solve itself was cut short); the run header says what the warm start
cost against that budget, and ``results.json`` keeps both. An SGD fit is bounded by its
own early stopping, in steps, so that a distributed run's processes and a rerun stop
where one process does. The ``lr`` model has no bound: there the exact fit is the model,
and its training only refines it. ``train.first_order_seconds`` sets a budget in seconds
instead, for either fit (``null``: none, so that the warm start never depends on the
machine's speed). ``auto`` turns the warm start on only with a validation split.

After an exact fit, the ids' first-order weights stay the LR's (``train.first_order_frozen``,
the default; the sparse optimizer keeps those columns of the table, and its checkpointed
state remembers it) and the rest of the model trains around them: they are already fitted on
every row with a tuned L2, and more mini-batch
steps on them only add noise (on the defaults benchmark's 1M-row world with 2M-id
vocabularies, FM peaked at validation AUC 0.8660 with them training and 0.8668 with them
kept; the LR start: 0.8650). An SGD fit was stopped early, not fitted: its weights keep
training (frozen, they cost the tuned ``configs/criteo_deepfm.yaml`` 0.008 test AUC over three
seeds). The ``lr`` model, which is nothing but those weights, keeps training them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from rich.console import Console
from torch import nn

from sampan.config import ConfigError
from sampan.distributed.sharded_embedding import RowShardedCollection
from sampan.layers.embed import FeatureEmbedding, lr_start_part
from sampan.models.lr import LR
from sampan.tasks.binary import BinaryTask
from sampan.train import checkpoint as ckpt
from sampan.train.exact_lr import MAX_NONZEROS, fit_exact_lr, nonzeros
from sampan.train.trainer import Trainer

DIRNAME = "first_order"
# the warm start's time: at most this share of the main training's estimate (a third: at
# most a quarter of the two together), and at least BUDGET_FLOOR seconds (where the whole
# run takes seconds, a cut LR is not worth what it saves)
BUDGET_SHARE = 1 / 3
BUDGET_FLOOR = 3.0
# an exact fit whose design holds at most this many ids has no time bound under auto: its
# whole C search takes seconds on any machine (a pass over 2M ids: about 15 ms on 2 cores;
# a search: 300-800 passes), and a bound there would only make the run depend on how busy
# the machine was (MovieLens-100K's search, 0.9 s alone, was cut at its 3 s floor on a
# loaded machine: C 0.01 instead of 3, test AUC 0.7063 instead of 0.7151)
UNBOUNDED_NONZEROS = 2_000_000


def copy_first_order(source: FeatureEmbedding, model: nn.Module) -> None:
    """Copy an LR's weights (bias, each id's weight, the numeric weights) into what
    :func:`~sampan.layers.embed.lr_start_part` names in ``model``: its first-order terms
    (the latent vectors are left as they are), or the first columns of its field vectors,
    which its ``start_from_lr`` then makes its output layer read."""
    target = lr_start_part(model)
    if target is None:
        raise ValueError(f"{type(model).__name__} cannot start from an LR")
    table, tasks = target.embedding, source.tasks
    src = source.embedding.weight
    wide = isinstance(target, FeatureEmbedding)
    if source.embedding.num_rows != table.num_rows or \
            tasks != (target.tasks if wide else target.schema.num_tasks):
        raise RuntimeError(f"first-order warm start: the LR has {source.embedding.num_rows} "
                           f"rows x {tasks} tasks, the model {table.num_rows} x "
                           f"{target.schema.num_tasks}; they must be built from the same "
                           "schema")
    # a row-sharded model holds rows [lo, hi): of a whole LR table, or the LR's same shard
    if isinstance(table, RowShardedCollection) and \
            not isinstance(source.embedding, RowShardedCollection):
        src = src[table.lo: table.hi]
    elif src.shape[0] != table.weight.shape[0]:
        raise RuntimeError("first-order warm start: the LR's table is row-sharded and the "
                           "model's is not")
    # dynamic tables: the model takes the LR's keys -> rows (and its step), so that the
    # rows copied are the same keys'
    for name, index in table.dynamic.items():
        index.load_state_dict(source.embedding.dynamic[name].state_dict())
    if table.dynamic:
        table.dynamic_step.copy_(source.embedding.dynamic_step)
    dense = source.dense_linear.weight if source.dense_linear is not None else None
    with torch.no_grad():
        table.weight[:, :tasks].copy_(src[:, :tasks])
        if not wide:
            model.start_from_lr(source.bias, dense)
            return
        target.bias.copy_(source.bias)
        if target.dense_linear is not None and dense is not None:
            target.dense_linear.weight.copy_(dense)


def exact_fit_blocker(trainer: Trainer) -> str | None:
    """Why the exact LR (:mod:`sampan.train.exact_lr`) cannot be the warm start's, or
    ``None`` when it can."""
    target = lr_start_part(trainer.model)
    if trainer.valid_data is None:
        return "no validation split to choose its C on"
    if trainer.strategy.enabled:
        return "a distributed run (each process holds a share of the rows)"
    if target is None or target.embedding.dynamic or \
            isinstance(target.embedding, RowShardedCollection):
        return "dynamic or row-sharded tables"
    if not isinstance(trainer.task, BinaryTask):
        return f"a {trainer.task.name} task"
    n = nonzeros(trainer.train_data, target)
    if n > MAX_NONZEROS:
        return f"{n:,} ids over the training rows (more than {MAX_NONZEROS:,} in memory)"
    return None


def training_estimate(trainer: Trainer) -> tuple[float, int]:
    """The main training's expected seconds and the steps they count: with early stopping,
    two epochs and the patience past them (a run that improves through its second epoch,
    as all but a few runs of the defaults benchmark do, is at least that long); else every
    planned step. Each step takes what :meth:`~sampan.train.trainer.Trainer.step_seconds`
    measures, and each evaluation what scoring the validation rows takes (timed on its
    first rows)."""
    tc, per_epoch = trainer.tc, len(trainer.loader)
    steps = trainer.total_steps
    every = tc.eval_every_steps or per_epoch
    valid = trainer.valid_data
    if valid is not None and tc.early_stopping.enabled:
        steps = min(steps, 2 * per_epoch + int(tc.early_stopping.patience) * every)
    seconds = trainer.step_seconds() * steps
    if valid is not None and len(valid):
        sample = valid.take(np.arange(min(len(valid), tc.eval_batch_size)))
        was_training, t0 = trainer.model.training, time.perf_counter()
        trainer.predict_logits(sample)
        per_row = (time.perf_counter() - t0) / len(sample)
        trainer.model.train(was_training)
        seconds += (steps // max(every, 1) + 1) * per_row * len(valid)
    return seconds, steps


def fit_first_order(trainer: Trainer) -> dict[str, Any] | None:
    """Fit an LR with ``trainer``'s config and rows and copy it into ``trainer.model``,
    before ``trainer.fit()``: the fit then keeps the LR's output bias and evaluates the
    warm-started model at step 0. ``train.first_order_solver`` says how: the exact optimum
    (:func:`fit_exact`) or SGD (:func:`fit_sgd`). Returns what the run reports
    (``results.json``: ``first_order_warm_start``) and sets ``trainer.warm_start`` to it.
    For the ``lr`` model only the exact fit is a start worth having (an SGD fit would be the
    model itself, trained twice): without it, nothing is fitted and ``None`` returned.
    """
    target = lr_start_part(trainer.model)
    if target is None:
        raise ValueError(f"{type(trainer.model).__name__} cannot start from an LR")
    # the lr model itself: first-order terms and nothing else
    only_lr = isinstance(target, FeatureEmbedding) and not target.dim
    solver = trainer.tc.first_order_solver
    blocker = exact_fit_blocker(trainer) if solver != "sgd" else None
    if solver == "lbfgs" and blocker is not None:
        raise ConfigError(f"train.first_order_solver: lbfgs cannot fit this run's LR: "
                          f"{blocker}; use auto or sgd")
    if only_lr and (solver == "sgd" or blocker is not None):
        trainer.console.print("first-order warm start: skipped, the model is an LR that "
                              "trains as an SGD fit would ("
                              f"{blocker or 'train.first_order_solver: sgd'})")
        return None
    t0 = time.perf_counter()
    exact = solver != "sgd" and blocker is None
    budget, estimate, steps = None, None, None
    given = trainer.tc.first_order_seconds
    # auto bounds the exact fit; an SGD fit is bounded by its own early stopping (in steps:
    # a distributed run's processes, and a rerun, stop where one process does); the lr
    # model's exact fit is the model: not cut
    ids = nonzeros(trainer.train_data, target) if exact else 0
    if given == "auto" and exact and not only_lr and ids > UNBOUNDED_NONZEROS:
        estimate, steps = training_estimate(trainer)
        budget = max(BUDGET_FLOOR, BUDGET_SHARE * estimate)
    elif given not in ("auto", None):
        budget = float(given)
    torch_state = torch.get_rng_state()  # the model's own run draws what it would have drawn
    lr_model = LR.Config(embedding_init_std=trainer.cfg.model.embedding_init_std)
    lr = LR(target.schema, lr_model)
    left = None if budget is None else budget - (time.perf_counter() - t0)
    if exact:
        out = fit_exact(trainer, lr, left)
        how = f"exact L2 optimum, C {out['C']:g}" + (
            f" (binned numbers' L2 x{out['binned_l2']:g})" if "binned_l2" in out else "") + \
            f" chosen on validation, {out['passes']} passes" + {
                "search": "; the time budget ended its C search",
                "solution": "; the time budget cut its solve short, its id weights train on",
            }.get(out.get("cut", ""), "")
    else:
        out = fit_sgd(trainer, lr, lr_model, left)
        how = f"SGD, best at step {out['best_step']:,} of {out['steps']:,}" + (
            "; the time budget stopped it" if out.get("cut") else "")
        if solver == "auto" and blocker is not None:
            how += f"; not exact: {blocker}"
    torch.set_rng_state(torch_state)
    copy_first_order(lr.features.to(trainer.device), trainer.model)
    # a solution the budget cut short is not the optimum: its weights keep training
    if out.get("solver") == "lbfgs" and trainer.tc.first_order_frozen and \
            out.get("cut") != "solution" and \
            isinstance(target, FeatureEmbedding) and not only_lr and \
            trainer.sparse_opt is not None:  # kept in the optimizer's state: a resume keeps it
        trainer.sparse_opt.freeze_columns(target.embedding, target.tasks)
        out["frozen"] = True
        how += "; its id weights stay"
    out["seconds"] = round(time.perf_counter() - t0, 2)
    cost = f"{out['seconds']:.1f} s"
    if budget is not None:
        out["budget_seconds"] = round(budget, 2)
        cost += f" of its {budget:.1f} s budget"
    if estimate is not None:
        out["training_estimate"] = {"seconds": round(estimate, 2), "steps": steps}
        cost += (f" (a third of the training's estimated {estimate:.1f} s over {steps:,} "
                 f"steps, at least {BUDGET_FLOOR:g} s)")
    elif budget is not None:
        cost += " (train.first_order_seconds)"
    elif given == "auto" and exact and not only_lr:
        cost += (f" (no time bound: {ids:,} ids, a design small enough to fit in seconds "
                 "on any machine)")
    shown = " ".join(f"{k} {v:.4f}" for k, v in out["valid"].items())
    where = "the model's linear terms" if isinstance(target, FeatureEmbedding) else \
        "the model (its vectors' first columns, read by its output layer)"
    trainer.console.print(f"first-order warm start: an LR on the same rows ({how}; valid "
                          f"{shown}) starts {where}; it took {cost}")
    trainer.warm_start = out
    return out


def fit_exact(trainer: Trainer, lr: LR, seconds: float | None = None) -> dict[str, Any]:
    """``lr`` fitted by :func:`~sampan.train.exact_lr.fit_exact_lr` on the trainer's rows, its
    C chosen by the run's early-stopping metric, within ``seconds`` (``None``: unbounded);
    written to ``first_order/checkpoints/best.pt`` as an SGD fit's best checkpoint is."""
    valid = trainer.valid_data
    sign = 1.0 if trainer.maximize else -1.0

    def score(z: torch.Tensor) -> tuple[float, dict[str, float]]:
        m = trainer.task.evaluate(None, valid, lambda _model, _data: z)
        return sign * m.get(trainer.metric, float("nan")), m

    out = fit_exact_lr(lr.features, trainer.train_data, valid, score, seconds=seconds)
    ckpt.save_atomic({"model": lr.state_dict(), "step": 0, "metrics": out["valid"],
                      "first_order": {k: v for k, v in out.items() if k != "valid"}},
                     trainer.run_dir / DIRNAME / "checkpoints" / "best.pt")
    return out


def fit_sgd(trainer: Trainer, lr: LR, lr_model: LR.Config,
            seconds: float | None = None) -> dict[str, Any]:
    """``lr`` trained by a Trainer of its own in ``<run>/first_order/``, with the run's
    settings but its own length (until its validation stops improving, or at the first
    evaluation past ``seconds``)."""
    cfg = trainer.cfg
    lr_cfg = cfg.model_copy(update={
        "model": lr_model,
        # its own plan from the user's values, but its own length: an epoch count chosen for
        # the model would stop an LR long before it converges; nothing to compile or show
        "train": cfg.train.model_copy(update={
            "compile": False, "tensorboard": False, "progress": False,
            "first_order_warm_start": False,
            **({"epochs": "auto", "max_steps": None} if trainer.valid_data is not None
               else {})})})
    sub = Trainer(lr, lr_cfg, trainer.run_dir / DIRNAME, trainer.train_data,
                  trainer.valid_data, console=Console(quiet=True),
                  strategy=trainer.strategy)  # data-parallel as the model is
    if seconds is not None:
        deadline = time.perf_counter() + seconds
        # every rank decides alike: by rank 0's clock
        sub.should_stop = lambda *_: "time budget" if sub.strategy.broadcast(
            time.perf_counter() > deadline) else None
    state = sub.fit()
    # the LR's validation metrics at its kept (best) step: recorded when it was evaluated
    valid = next((r for r in state.history if r["split"] == "valid"
                  and r["step"] == state.best_step), {})
    return {"solver": "sgd", "steps": state.step, "best_step": state.best_step,
            **({"cut": True} if sub.stopped_by == "time budget" else {}),
            "valid": {k: v for k, v in valid.items() if k in ("auc", "logloss")}}

