"""The divergence guard: a non-finite or exploding training loss, a validation LogLoss far
above the base rate's, or a non-finite parameter before a checkpoint is a divergence; the
trainer then goes back to its last good state with halved learning rates (at most
``MAX_RECOVERIES`` times), or stops with :class:`~sampan.errors.DivergenceError`
(``train.on_divergence``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from sampan.errors import DivergenceError
from sampan.train.state import LAST, START

if TYPE_CHECKING:
    from sampan.train.trainer import Trainer

MAX_RECOVERIES = 3


class Diverged(Exception):
    """Raised inside the loop; :meth:`Trainer.fit` recovers or stops."""


def check_loss(trainer: Trainer, mean_loss: float, steps: int) -> None:
    if not math.isfinite(mean_loss):
        raise Diverged(f"the training loss of the last {steps} steps is {mean_loss}")
    if mean_loss > trainer.explode_at:
        raise Diverged(
            f"the training loss of the last {steps} steps is {mean_loss:.4g}, above "
            f"{trainer.explode_at:.3g} (3 x the base-rate loss {trainer.reference_loss:.3g} + 1)")


def check_finite(trainer: Trainer) -> None:
    """Every parameter and buffer finite, on every process (before a checkpoint is
    written, so a checkpoint never holds a diverged model)."""
    bad = [k for k, v in trainer.model.state_dict().items()
           if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if trainer.strategy.any(bool(bad)):
        raise Diverged("non-finite values in " + (", ".join(bad[:3]) if bad
                                                  else "another process's parameters"))


def check_valid(trainer: Trainer, m: dict[str, float]) -> str | None:
    """Raise :class:`Diverged` for a validation LogLoss that is not finite or above 5 x the
    base rate's while the training loss is not below its own base rate: a model that fits
    nothing. With the training loss below it, the model is memorising the training rows
    (over-confident on new ones, not broken): returns why the run should stop early (the best
    step is kept), as a halved learning rate would only memorise more slowly."""
    if "logloss" not in m or trainer.valid_data is None or trainer.valid_data.labels is None:
        return None
    base = trainer.task.reference_loss(trainer.valid_data, trainer.tc.batch_size)
    # far above: an overfitted, over-confident model can reach 3 x; 5 x is broken, unless
    # the training rows are fitted
    if math.isfinite(m["logloss"]) and m["logloss"] <= 5.0 * base:
        return None
    train = trainer.last_train_loss
    if math.isfinite(m["logloss"]) and train is not None and train < trainer.reference_loss:
        return (f"overfitting: the validation LogLoss is {m['logloss']:.4g}, above 5 x the "
                f"base-rate LogLoss {base:.3g}, while the training loss is {train:.3g}, below "
                f"its base rate's {trainer.reference_loss:.3g}")
    raise Diverged(f"the validation LogLoss is {m['logloss']:.4g}, above 5 x the "
                   f"base-rate LogLoss {base:.3g}")


def recover(trainer: Trainer, reason: str) -> None:
    """Back to ``last.pt`` with the learning rates halved, or :class:`DivergenceError`."""
    st = trainer.state
    last = trainer.run_dir / "checkpoints" / LAST
    if not last.exists():
        last = trainer.run_dir / "checkpoints" / START
    lr_now = trainer.tc.lr * st.lr_scale
    if trainer.tc.on_divergence == "stop" or st.recoveries >= MAX_RECOVERIES \
            or not last.exists():
        why = ("train.on_divergence is 'stop'" if trainer.tc.on_divergence == "stop" else
               f"{st.recoveries} recoveries with halved learning rates did not help")
        kept = f"; the last good state is kept in {last}" if last.exists() else ""
        if trainer.metrics is not None:
            trainer.metrics.write({"step": st.step, "epoch": st.epoch, "split": "divergence",
                                   "reason": reason, "action": "stop"})
            trainer.metrics.close()
        raise DivergenceError(
            f"training diverged at step {st.step}: {reason} ({why}){kept}. Try a lower "
            f"train.lr (now {lr_now:.3g}), train.clip_grad_norm, or standardized numeric "
            "features.")
    keep = (st.best, st.best_step, st.recoveries + 1, st.lr_scale * 0.5, st.step,
            st.seconds)
    trainer._restore(last, quiet=True)
    st = trainer.state
    st.best, st.best_step, st.recoveries, st.lr_scale, at, st.seconds = keep
    st.bad_evals, st.stopped_early = 0, False
    msg = (f"[yellow]diverged at step {at}[/]: {reason}; back to step {st.step} with the "
           f"learning rates halved (train.lr now {trainer.tc.lr * st.lr_scale:.3g}; recovery "
           f"{st.recoveries} of {MAX_RECOVERIES})")
    trainer.console.print(msg)
    if trainer.metrics is not None:
        trainer.metrics.write({"step": st.step, "epoch": st.epoch, "split": "divergence",
                               "at_step": at, "reason": reason, "action": "recover",
                               "lr_scale": st.lr_scale})


# the kept model's validation LogLoss over that of the LR it started from, above which the
# run says its probabilities are over-confident (DCN-V2 on Frappe, kept for its AUC: 1.49)
OVERCONFIDENT = 1.2


def overconfidence_note(results: dict, metric: str) -> str | None:
    """What to tell the user when the model kept for a ranking ``metric`` has a validation
    LogLoss well above the first-order warm start's: it ranks better than the LR but its
    probabilities are over-confident (``None`` otherwise)."""
    start = ((results.get("first_order_warm_start") or {}).get("valid") or {}).get("logloss")
    kept = (results.get("valid") or {}).get("logloss")
    if metric == "logloss" or start is None or kept is None or not kept > OVERCONFIDENT * start:
        return None
    return (f"the kept model's validation LogLoss {kept:.4f} is {kept / start - 1:.0%} above "
            f"that of the LR it started from ({start:.4f}): kept for its {metric}, it ranks "
            "better, but its probabilities are over-confident. Where calibrated probabilities "
            "matter (bids, thresholds), set train.early_stopping.metric: logloss")
