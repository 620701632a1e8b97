"""Trainer: the training loop, evaluation, early stopping and checkpoints.

The step order is the whole algorithm and is visible in :meth:`Trainer._train_step`:
autocast -> forward -> loss -> backward -> reduce -> clip -> sparse step -> dense step -> zero
grads. Behaviour comes from ``TrainConfig`` flags, never from subclasses. The loop is
single-process code: wherever processes must agree (gradients, the logged loss, decisions,
checkpoints) it asks its strategy (:mod:`sampan.distributed.strategy`), which a single
process's makes a no-op.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from torch import nn

from sampan import native
from sampan.config import ConfigError, ExperimentConfig, dump_config
from sampan.data.loader import Batch, BatchLoader
from sampan.data.store import SplitArrays
from sampan.distributed.strategy import SingleProcess, strategy_for
from sampan.embedding import EmbeddingCollection, make_sparse_optimizer
from sampan.embedding.dynamic import KeyIndex
from sampan.layers.embed import FeatureEmbedding, lr_start_part
from sampan.tasks import make_task
from sampan.train import checkpoint as ckpt
from sampan.train import guard
from sampan.train.compute import (
    compile_dense,
    dense_optimizer,
    l1_shrink_targets,
    plan_for,
    resolve_amp,
    reuse_freed_memory,
    shrink_l1,
)
from sampan.train.evaluate import (  # noqa: F401  (importable from here as before)
    Evaluator,
    headline_metrics,
    probabilities,
    resolve_device,
)
from sampan.train.logging import MetricsLog, grad_norm, make_progress, train_record
from sampan.train.plan import plan_training
from sampan.train.schedules import lr_factor
from sampan.train.state import BEST, LAST, START, TrainState  # noqa: F401  (importable here)


def data_on_device(data: SplitArrays, choice: bool | str, device: torch.device
                   ) -> tuple[bool, str | None]:
    """Whether the training split lives on ``device`` (``train.data_on_device``), and why
    (``None`` off a GPU, where there is nothing to choose)."""
    if device.type != "cuda":
        return False, None
    size = data.nbytes()
    if choice != "auto":
        return bool(choice), f"{bool(choice)} (set; the split is {size / 2**20:,.0f} MB)"
    free, _ = torch.cuda.mem_get_info(device)
    fits = size <= free // 4
    return fits, (f"{fits}: the split's {size / 2**20:,.0f} MB is {'under' if fits else 'over'} "
                  f"a quarter of the GPU's {free / 2**30:,.1f} GB free")


class Trainer:
    """Trains ``model`` on ``train`` and evaluates on ``valid``, writing into ``run_dir``.

    ``strategy`` says how the run spreads over processes (by default the launch's: see
    :func:`~sampan.distributed.strategy.strategy_for`); the Trainer first applies its
    ``parallelize`` to ``model`` (which a model already prepared by it passes unchanged).

    Example::

        trainer = Trainer(model, cfg, run_dir, train_split, valid_split)
        trainer.fit()                       # or trainer.fit(resume=True)
        test_metrics = trainer.evaluate(test_split)
    """

    def __init__(self, model: nn.Module, cfg: ExperimentConfig, run_dir: str | Path,
                 train: SplitArrays, valid: SplitArrays | None,
                 console: Console | None = None, log_metrics: bool = True,
                 strategy: SingleProcess | None = None):
        self.cfg = cfg
        self.tc = cfg.train
        self.run_dir = Path(run_dir)
        self.console = console or Console()
        self.device = resolve_device(self.tc.device)
        self.strategy = strategy = strategy or strategy_for(cfg.train)
        self.model = model = strategy.parallelize(model).to(self.device)
        self.task = make_task(model, train)
        self.train_rows = train  # every row, for what a model reads from the data
        train = self.task.training_rows(train)
        self.train_data, self.valid_data = train, valid
        start = lr_start_part(model)
        self.plan = plan_training(
            cfg.train, len(train), None if valid is None or valid.labels is None
            else np.asarray(valid.labels), self.task.default_metric, strategy.world,
            first_order=start is not None,
            patience_epochs=getattr(self.task, "patience_epochs", 2),
            lr_model=isinstance(start, FeatureEmbedding) and not start.dim)
        self.tc = self.plan.train  # every `auto` resolved from the data
        if strategy.enabled and self.tc.batch_size < 2 * strategy.world:
            raise ConfigError(f"train.batch_size {self.tc.batch_size} (the global batch) must "
                             f"give each of the {strategy.world} processes two rows or more: "
                             f"set it to {2 * strategy.world} or more")
        on_device, why = data_on_device(train, self.tc.data_on_device, self.device)
        if why:
            self.plan.reasons["data_on_device"] = why
        amp, self.plan.reasons["amp"] = resolve_amp(self.tc.amp, self.device, model)
        if self.device.type == "cpu" and self.tc.reuse_memory:
            done = reuse_freed_memory()
            if done:
                self.plan.reasons["reuse_memory"] = done
        self.tc = self.plan.train = self.tc.model_copy(update={"amp": amp})
        self.loader = BatchLoader(train, self.tc.batch_size, shuffle=self.tc.shuffle,
                                  seed=cfg.seed, prefetch=self.tc.prefetch,
                                  pin_memory=self.device.type == "cuda" and not on_device,
                                  drop_singleton=True, rank=strategy.rank, world=strategy.world,
                                  device=self.device if on_device else None)
        self.total_steps = self.tc.max_steps or self.tc.epochs * len(self.loader)
        self.kernels = plan_for(self, log_metrics)
        self.evaluator = Evaluator(self.model, self.task, self.device, self.tc.eval_batch_size,
                                   self.tc.prefetch, strategy)
        if self.tc.compile:  # after the kernels are set: compiled graphs guard on them
            compile_dense(self.model)

        collections = [m for m in model.modules() if isinstance(m, EmbeddingCollection)]
        if any(c.dynamic for c in collections) and self.device.type == "cpu":
            self.plan.reasons["dynamic_tables"] = (
                "key map on C kernels" if native.library() is not None
                else f"key map on tensor operations (C kernels {native.status()})")
        self.dense_params = [p for p in model.parameters() if p.requires_grad]
        self.sparse_opt = make_sparse_optimizer(
            self.tc.sparse_optimizer, collections, lr=self.tc.sparse_lr or self.tc.lr,
            embedding_l2=self.tc.embedding_l2,
            embedding_l1=self.tc.embedding_l1) if collections else None
        self.dense_opt = dense_optimizer(self.dense_params, self.tc)
        self._l1_targets = l1_shrink_targets(self.dense_opt)
        self.base_lrs = [[g["lr"] for g in o.param_groups] for o in self._optimizers()]
        self.state = TrainState()
        self.metrics = MetricsLog(self.run_dir, self.tc.tensorboard and log_metrics,
                                  self.console) if log_metrics and strategy.is_main else None
        self.log_metrics = log_metrics
        self.metric = self.tc.early_stopping.metric or self.task.default_metric
        self.maximize = self.metric != "logloss"
        self.best_model: dict[str, torch.Tensor] | None = None
        self.warm_start: dict[str, Any] | None = None  # set by warm_start.fit_first_order
        # the divergence guard: a training loss above this is "exploding"
        self.reference_loss = self.task.reference_loss(train, self.tc.batch_size) \
            if len(train) else 1.0
        self.explode_at = 3.0 * self.reference_loss + 1.0
        self.last_train_loss: float | None = None  # the last log window's mean
        self._window: tuple[torch.Tensor | None, int] = (None, 0)  # the loop's log window
        self._fit_t0 = time.perf_counter()  # reset by fit()
        # after every validation (step, epochs, metrics): a reason to stop (tune's "pruned")
        self.should_stop: Callable[[int, float, dict[str, float]], str | None] | None = None
        self.stopped_by: str | None = None
        self.last_grad_norm: torch.Tensor | None = None  # of the last logged step

    def describe_plan(self) -> list[str]:
        """What the run chose for the ``auto`` values, and why (one line each)."""
        lines = [f"{k}: {why}" for k, why in self.plan.reasons.items()]
        describe = getattr(self.task, "describe", None)
        return lines + ([describe()] if describe is not None else [])

    def _write(self, name: str, obj: dict[str, Any]) -> Path:
        """Write ``checkpoints/<name>`` (collective: every process calls it)."""
        return ckpt.save_run_checkpoint(obj, self.run_dir / "checkpoints" / name, self.model,
                                        self.sparse_opt, self.strategy, f"step{self.state.step}")

    def _read(self, name: str) -> dict[str, Any]:
        """``checkpoints/<name>`` with this process's rows of row-sharded tables only."""
        return ckpt.load(self.run_dir / "checkpoints" / name, "cpu",
                         ckpt.local_rows_of(self.model, self.sparse_opt))

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.sparse_opt, self.dense_opt) if o is not None]

    # ------------------------------------------------------------------- the step
    def _set_lr(self) -> None:
        f = lr_factor(self.state.step, self.total_steps, self.tc.warmup_steps, self.tc.schedule,
                      self.tc.min_lr_ratio)
        f *= self.state.lr_scale
        for opt, bases in zip(self._optimizers(), self.base_lrs, strict=True):
            for g, base in zip(opt.param_groups, bases, strict=True):
                g["lr"] = base * f

    def _train_step(self, batch: Batch, weight: float = 1.0,
                    measure: bool = False) -> torch.Tensor:
        """One step; ``weight`` is this rank's share of the global batch (1 in a single
        process), so that the gradients summed over ranks are the global mean's;
        ``measure`` (a logged step) keeps the dense gradients' norm."""
        self._set_lr()
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.tc.amp == "bf16"):
            loss = self.task.loss(self.model, batch)
        (loss * weight if weight != 1.0 else loss).backward()
        self.strategy.reduce_gradients(self.dense_params)  # a single process's: no-op
        if measure:
            self.last_grad_norm = grad_norm(self.dense_params)
        if self.tc.clip_grad_norm is not None and self.dense_params:
            # Clips the dense parameters; embedding rows are bounded by their optimizer.
            torch.nn.utils.clip_grad_norm_(self.dense_params, self.tc.clip_grad_norm)
        if self.sparse_opt is not None:
            self.sparse_opt.step()
        if self.dense_opt is not None:
            self.dense_opt.step()
            self.dense_opt.zero_grad(set_to_none=True)
            if self._l1_targets:
                shrink_l1(self.dense_opt, self._l1_targets)
        return loss.detach() * weight  # summed over ranks at logging: the global mean

    def step_seconds(self, steps: int = 3) -> float:
        """Seconds of one training step as :meth:`fit` takes it (forward, backward, both
        optimizers' updates): the median of ``steps`` steps, after one untimed, on the first
        training rows, then undone. The model's and the optimizers' state and the random
        generator are put back as they were, so a run that asks trains as one that does
        not. Every process of a distributed run takes the same steps."""
        size = max(self.tc.batch_size // self.strategy.world, 1)
        rows = np.arange(size * (steps + 1)) % max(len(self.train_data), 1)
        loader = BatchLoader(self.train_data.take(rows), size, shuffle="none", prefetch=0)
        saved = copy.deepcopy({"model": self.model.state_dict(),
                               "optimizers": [o.state_dict() for o in self._optimizers()]})
        rng, was_training, times = torch.get_rng_state(), self.model.training, []
        self.model.train()
        for batch in loader:
            t0 = time.perf_counter()
            self._train_step(batch.to(self.device))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        self.model.load_state_dict(saved["model"])
        for opt, state in zip(self._optimizers(), saved["optimizers"], strict=True):
            opt.load_state_dict(state)
        torch.set_rng_state(rng)
        self.model.train(was_training)
        return float(np.median(times[1:] if len(times) > 1 else times))

    # -------------------------------------------------------------------- fitting
    def fit(self, resume: bool = False) -> TrainState:
        """Train until ``epochs`` / ``max_steps`` or early stop; restores the best weights.

        A divergence (see ``train.on_divergence``) restores the last checkpoint and halves
        the learning rates, at most 3 times; then, or with ``stop``, it raises
        :class:`~sampan.errors.DivergenceError` and ``last.pt`` keeps the last good state.
        """
        if resume:
            self._restore(self.run_dir / "checkpoints" / LAST)
        self._fit_t0 = time.perf_counter()  # state.seconds holds the earlier runs' time
        if not self.log_metrics:
            raise RuntimeError("this Trainer was built with log_metrics=False (evaluation only)")
        if not resume:
            fit_data = getattr(getattr(self.model, "module", self.model), "fit_data", None)
            if fit_data is not None:  # what a model reads from the training rows
                done = fit_data(self.train_rows)
                if done:
                    self.console.print(done)
            if self.tc.init_output_bias and self.warm_start is None:  # else: the LR's bias
                done = self.task.init_output_bias(self.model, self.train_data, self.device)
                if done:
                    self.console.print(done)
            if self.warm_start is not None:
                self._evaluate_and_track()  # the LR it starts as is the floor of the run
            if self.tc.on_divergence == "recover":
                self.save_checkpoint(START)  # the first good state to come back to
        progress = make_progress(self.console, self.tc.progress and self.strategy.is_main)
        with progress:
            bar = progress.add_task("train", total=self.total_steps, completed=self.state.step,
                                    loss="-", speed="-")
            while True:
                try:
                    self._run_epochs(progress, bar)
                    if self.state.best is None and self.state.step and \
                            self.valid_data is not None:
                        self._evaluate_and_track()  # max_steps ended before any evaluation
                    break
                except guard.Diverged as e:
                    guard.recover(self, str(e))
                    progress.update(bar, completed=self.state.step)
            self.state.seconds += time.perf_counter() - self._fit_t0
        if self.metrics is not None:
            self.metrics.close()
        if self.best_model is not None:
            self.model.load_state_dict(self.best_model)
        return self.state

    def _run_epochs(self, progress: Any, bar: Any) -> None:
        st = self.state
        n_batches = len(self.loader)
        while st.epoch < self.tc.epochs and not self._done():
            self.model.train()
            self.loader.set_position(st.epoch, st.batch)
            # a resumed run continues the log window its checkpoint was written in
            loss_sum = torch.full((), st.window[0], device=self.device)
            loss_n, t0, seen = st.window[1], time.perf_counter(), 0
            st.window = (0.0, 0)  # used once: later epochs start with an empty window
            self._window = (loss_sum, loss_n)
            for batch in self.loader:
                batch = batch.to(self.device, non_blocking=True)
                weight = self.strategy.batch_weight(batch.size,
                                                    self.loader.global_rows(st.batch))
                loss_sum += self._train_step(batch, weight, measure=(
                    (st.step + 1) % self.tc.log_every_steps == 0 or st.batch + 1 == n_batches))
                loss_n += 1
                self._window = (loss_sum, loss_n)
                seen += batch.size
                st.step += 1
                st.batch += 1
                if st.step % self.tc.log_every_steps == 0 or st.batch == n_batches:
                    self.strategy.sum_(loss_sum)  # the global-batch loss
                    mean_loss = (loss_sum / loss_n).item()  # the only host sync, every N
                    # timed after the sync: on a GPU the window's steps have then finished
                    speed = seen * self.strategy.world / max(time.perf_counter() - t0, 1e-9)
                    guard.check_loss(self, mean_loss, loss_n)
                    self.last_train_loss = mean_loss
                    if self.metrics is not None:
                        self.metrics.write(train_record(self, mean_loss, speed))
                    progress.update(bar, completed=st.step, loss=f"{mean_loss:.4f}",
                                    speed=f"{speed:,.0f}")
                    loss_sum.zero_()
                    loss_n, t0, seen = 0, time.perf_counter(), 0
                    self._window = (loss_sum, loss_n)
                if self.tc.eval_every_steps and st.step % self.tc.eval_every_steps == 0:
                    self._evaluate_and_track()
                    self.model.train()
                if self.tc.checkpoint_every_steps and \
                        st.step % self.tc.checkpoint_every_steps == 0:
                    self.save_checkpoint()
                if self._done():
                    break
            if st.batch >= n_batches:  # a full epoch, not a max_steps / early stop cut
                # every training row has been read once: dynamic tables' admission has
                # counted each key's rows, and later epochs do not count them again
                for m in self.model.modules():
                    if isinstance(m, KeyIndex):
                        m.stop_counting()
                if not self.tc.eval_every_steps:
                    self._evaluate_and_track()
                st.epoch += 1
                st.batch = 0
            self.save_checkpoint()

    def _done(self) -> bool:
        st = self.state
        return st.stopped_early or (self.tc.max_steps is not None and st.step >= self.tc.max_steps)

    def _evaluate_and_track(self) -> None:
        st = self.state
        if self.valid_data is None:
            return
        self.strategy.sync_buffers(self.model)
        m = self.evaluate(self.valid_data)
        es = self.tc.early_stopping
        if self.metric not in m:
            raise ConfigError(
                f"train.early_stopping.metric {self.metric!r} is not computed for this model "
                f"and data; available: {sorted(k for k in m if k not in ('rows', 'queries'))}")
        overfit = guard.check_valid(self, m)
        value = m.get(self.metric, math.nan)

        def better(ref: float | None) -> bool:
            return ref is None or (value > ref + es.min_delta if self.maximize
                                   else value < ref - es.min_delta)
        # one decision for all ranks
        improved = bool(self.strategy.broadcast(better(st.best))) and not math.isnan(value)
        # a model warm-started from an LR (evaluated at step 0) first loses some of it to its
        # freshly initialised interaction parts: while it climbs back, beating its own
        # previous best evaluation also resets the patience, so it is stopped when it stops
        # improving, not while it is still catching up (best.pt keeps whichever is better)
        own = st.step > 0 and bool(self.strategy.broadcast(better(st.trained_best))) \
            and not math.isnan(value)
        progressed = own and st.trained_best is not None  # the first one sets the mark
        if own:
            st.trained_best = value
        if improved:
            st.best, st.best_step = value, st.step
            # each rank keeps its own rows (loading accepts them), and writes them to best.pt
            self.best_model = copy.deepcopy({k: v.detach().clone()
                                             for k, v in self.model.state_dict().items()})
            self._write(BEST, {"model": self.best_model, "step": st.step, "metrics": m})
        if improved or progressed:
            st.bad_evals = 0
        else:
            st.bad_evals += 1
            if es.enabled and st.bad_evals >= es.patience:
                st.stopped_early = True
            elif self.tc.schedule == "plateau":
                st.lr_scale *= 0.5
        record = {"step": st.step, "epoch": st.epoch, "split": "valid", **m,
                  "best": st.best, "best_step": st.best_step}
        st.history.append(record)
        if self.metrics is not None:
            self.metrics.write(record)
        if overfit and not st.stopped_early:
            st.stopped_early, self.stopped_by = True, overfit
        if self.should_stop is not None and not st.stopped_early and (
                reason := self.should_stop(st.step, st.step / max(len(self.loader), 1), m)):
            st.stopped_early, self.stopped_by = True, reason
        mark = "*" if improved else " "
        shown = " ".join(f"{k} {m[k]:.4f}" for k in headline_metrics(m))
        self.console.print(f"  step {st.step:>6} epoch {st.epoch}  valid {shown} {mark}"
                           + (f"  ({self.stopped_by or 'early stop'})" if st.stopped_early
                              else ""))

    # ----------------------------------------------------------------- evaluation
    def infer(self, fn, data: SplitArrays) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """``fn(batch)`` over every row of ``data`` (see :meth:`Evaluator.infer`)."""
        return self.evaluator.infer(fn, data)

    def predict_logits(self, data: SplitArrays) -> torch.Tensor:
        """Logits ``[N, T]`` for every row of ``data``, in order."""
        return self.evaluator.predict_logits(data)

    def evaluate(self, data: SplitArrays) -> dict[str, float]:
        """The task's metrics of the current model on ``data``."""
        return self.evaluator.evaluate(data)

    # ---------------------------------------------------------------- checkpoints
    def _window_now(self) -> tuple[float, int]:
        loss_sum, n = self._window
        if not n or loss_sum is None:
            return (0.0, 0)
        # what the next log record would sum over processes: restored on every process,
        # summed again at logging
        total = self.strategy.sum_(loss_sum.clone()) / self.strategy.world
        return (float(total), int(n))

    def save_checkpoint(self, name: str = LAST, extra: dict[str, Any] | None = None) -> Path:
        """``last.pt``: everything a resumed run needs (see :meth:`_write`), with ``extra``
        (a stream's position: written in the same file, so atomically with the weights).
        Nothing non-finite is ever written: that is a divergence."""
        st = self.state
        self.strategy.sync_buffers(self.model)
        guard.check_finite(self)
        start = self.run_dir / "checkpoints" / START
        if name == LAST and self.strategy.is_main and start.exists():
            ckpt.remove_parts(start)  # last.pt is the state to come back to from now on
            start.unlink()
        return self._write(name, {
            "model": self.model.state_dict(),
            "sparse_opt": self.sparse_opt.state_dict() if self.sparse_opt else None,
            "dense_opt": self.dense_opt.state_dict() if self.dense_opt else None,
            "state": {"step": st.step, "epoch": st.epoch, "batch": st.batch, "best": st.best,
                      "best_step": st.best_step, "bad_evals": st.bad_evals,
                      "trained_best": st.trained_best,
                      "stopped_early": st.stopped_early, "history": st.history,
                      "lr_scale": st.lr_scale, "recoveries": st.recoveries,
                      "seconds": st.seconds + time.perf_counter() - self._fit_t0,
                      "window": self._window_now()},
            "rng": ckpt.rng_state(),
            # every rank's own (dropout masks differ between ranks), for a resume on as many
            "rng_ranks": self.strategy.gather(ckpt.rng_state()),
            "config": dump_config(self.cfg),
            "world_size": self.strategy.world,
            **(extra or {}),
        })

    def _restore(self, path: Path, quiet: bool = False) -> None:
        # to the CPU first, only this rank's rows of a row-sharded table (a checkpoint that
        # holds the whole table is cut to them before it moves)
        c = self._read(path.name)
        # what else the checkpoint holds (a stream's position: see save_checkpoint's extra)
        self.restored = {k: v for k, v in c.items()
                         if k not in ("model", "sparse_opt", "dense_opt")}
        self.model.load_state_dict(c["model"])
        if self.sparse_opt is not None:
            self.sparse_opt.load_state_dict(ckpt.shard_optimizer_state_dict(
                c["sparse_opt"], self.sparse_opt, self.model))
        if self.dense_opt is not None:
            self.dense_opt.load_state_dict(c["dense_opt"])
        s = c["state"]
        self.state = TrainState(step=s["step"], epoch=s["epoch"], batch=s["batch"],
                                best=s["best"], best_step=s["best_step"],
                                bad_evals=s["bad_evals"], stopped_early=s["stopped_early"],
                                trained_best=s.get("trained_best", s["best"]),
                                history=list(s["history"]), lr_scale=s.get("lr_scale", 1.0),
                                recoveries=s.get("recoveries", 0),
                                seconds=s.get("seconds", 0.0),
                                window=tuple(s.get("window", (0.0, 0))))
        if (self.run_dir / "checkpoints" / BEST).exists():
            self.best_model = self._read(BEST)["model"]
        ranks = c.get("rng_ranks")
        ckpt.set_rng_state(ranks[self.strategy.rank]
                           if ranks and len(ranks) == self.strategy.world else c["rng"])
        if self.metrics is not None:
            self.metrics.truncate_after(self.state.step)
        if not quiet:
            self.console.print(f"resumed from {path} at step {self.state.step} "
                               f"(epoch {self.state.epoch}, batch {self.state.batch})",
                               soft_wrap=True)  # a path: one line, whatever the width
