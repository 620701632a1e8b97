"""The exact logistic regression of the first-order warm start: L2-regularised, solved by
L-BFGS over the whole training split, its L2 strength chosen on the validation rows.

Why: the warm start makes an LR the floor of an FM-family run, so the floor is only as good
as that LR. Trained by mini-batch Adam with early stopping, Sampan's LR stopped 0.005-0.03
AUC below a scikit-learn LogisticRegression whose ``C`` was picked on validation, on the same
rows (worst on MovieLens and on two-million-id vocabularies): early stopping regularises every
id alike, by how often it was seen, not by how much its evidence says. The L2 optimum shrinks
a rare id's weight towards zero in proportion to its evidence, which is what generalises.

The model is linear in its weights, so each split is held as a sparse design matrix ``X``
(one column per table row, 1 for a row's id in each categorical column, ``1/len`` or 1 for
the ids of a mean- or sum-pooled list) beside its numeric columns. One pass over the rows is
two sparse products (``X w`` and ``X^T r``), with no sort or gather per batch. The objective
per label is ``mean BCE + lambda / 2 * ||w||^2`` (bias not penalised), with
``lambda = 1 / (C * rows)`` as scikit-learn's ``C``. ``C`` is searched on a grid a factor
of about 3 apart: from 0.01 towards weaker regularisation while the validation metric
improves (towards stronger when the first step already falls), each solve starting from the
best solution so far; the best ``C`` is kept.

Binned numbers (a numeric column's bucket twin, ``bucketize``; ``SparseFeatureSpec.binned``)
get an L2 strength of their own, ``lambda`` times a multiplier from :data:`BINNED_L2`, also
chosen on validation: after the ``C`` search at 1, the multiplier rises at that ``C`` while
validation improves, and ``C`` is then searched again one step either way. Why: one L2 for
everything let 16 bucket weights per number (fitted on a few hundred rows each) add their
noise where the number's effect is linear in its standardised value, which its numeric weight
already carries. The defaults benchmark's small numeric-rich worlds lost up to 0.0074 test AUC
to scikit-learn's LR on the same rows without the twins; with its own L2 the twin keeps what it
is worth on large worlds with non-linear numbers (fresh_7963_2: +0.011 over that LR) and gives
way elsewhere.

``seconds`` bounds the search's time (the warm start gives it a share of the training it
precedes): each solve gets the passes that fit what is left (timed from the first pass), and
the walk ends, keeping the best ``C`` so far, when fewer than :data:`MIN_PASSES` fit (a
solve cut short says so in its path entry).

It applies when everything fits the design in memory: one process, fitted vocabularies (no
dynamic tables), a binary task, and at most :data:`MAX_NONZEROS` ids over the training rows.
Otherwise the warm start trains its LR by SGD (:mod:`sampan.train.warm_start`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from sampan.data.arrays import SplitArrays
from sampan.embedding.collection import csr
from sampan.layers.embed import FeatureEmbedding

# two CSR copies (X and X^T) of 8 bytes an entry each with int32 indices: 2.4 GB at the cap
MAX_NONZEROS = 150_000_000
C_PATH = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
C_START = 0.01
# the binned-number rows' L2 as a multiple of the others' (tried in this order)
BINNED_L2 = (1.0, 10.0, 100.0, 1000.0)
# L-BFGS iterations per C, each solve starting from the best C's solution so far: near
# enough for the validation metric (more moved it by < 3e-4 AUC on the built-in data)
MAX_ITER = 40
# a solve given fewer passes than this (under a time bound) is not started
MIN_PASSES = 5


def _csr(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
         shape: tuple[int, int]) -> torch.Tensor:
    """:func:`~sampan.embedding.collection.csr` with int32 indices where they fit (half the
    memory of int64)."""
    index = torch.int32 if max(shape) < 2**31 and len(col) < 2**31 else torch.int64
    return csr(crow.to(index), col.to(index), val, shape)


def _transposed(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
                shape: tuple[int, int], width: int | None = None) -> torch.Tensor:
    """``X^T`` in CSR for ``X`` given by ``crow``, ``col``, ``val`` (``width``: every row
    has that many entries): its entries in column order by one stable sort of the column
    indices (about half the time ``x.t().to_sparse_csr()`` takes on 34 M entries)."""
    rows, cols = shape
    small = cols < 2**31 and rows < 2**31 and len(col) < 2**31
    index = torch.int32 if small else torch.int64
    order = torch.sort(col.to(index), stable=True).indices
    if width:  # entry e is row e // width's
        row_of = torch.div(order, width, rounding_mode="floor").to(index)
    else:
        row_of = torch.repeat_interleave(torch.arange(rows, dtype=index), crow.diff(),
                                         output_size=len(col))[order]
    t_crow = torch.zeros(cols + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(col, minlength=cols), 0, out=t_crow[1:])
    return _csr(t_crow, row_of, val[order], (cols, rows))


@dataclass
class Design:
    """One split as the LR sees it: ``blocks`` of ``(X [N, R], X^T [R, N])`` (CSR; one for
    the categorical columns, one per list feature), the numeric columns ``dense [N, Nd]``,
    ``labels [N, T]`` and which of them are known (``mask``)."""

    blocks: list[tuple[torch.Tensor, torch.Tensor | None]]
    dense: torch.Tensor
    labels: torch.Tensor | None
    mask: torch.Tensor | None

    def logits(self, w: torch.Tensor, wd: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = b.expand(self.dense.shape[0], -1).clone()
        for x, _ in self.blocks:
            z += x @ w
        if self.dense.shape[1]:
            z += self.dense @ wd
        return z


def nonzeros(data: SplitArrays, fe: FeatureEmbedding) -> int:
    """Entries of ``data``'s design matrix (its ids, padding excluded), without building it."""
    n = int(data.sparse.shape[0]) * int(data.sparse.shape[1])
    for s in fe.schema.sequences:
        n += int(np.count_nonzero(data.sequences[s.name]))
    return n


def design(data: SplitArrays, fe: FeatureEmbedding, transpose: bool) -> Design:
    """``data``'s design matrix under ``fe``'s table layout (its offsets, shared list tables
    and poolings); ``transpose``: also keep ``X^T`` (for gradients; training rows only)."""
    rows, table = int(data.sparse.shape[0]), fe.embedding
    blocks = []

    def add(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
            width: int | None = None) -> None:
        x = _csr(crow, col, val, (rows, table.num_rows))
        xt = _transposed(crow, col, val, (rows, table.num_rows), width) if transpose else None
        blocks.append((x, xt))

    ids = torch.from_numpy(np.array(data.sparse, dtype=np.int64))
    if ids.shape[1]:
        f = ids.shape[1]
        add(torch.arange(0, rows * f + 1, f), (ids + table.offsets.cpu()).reshape(-1),
            torch.ones(rows * f), width=f)
    for s in fe.schema.sequences:
        seq = torch.from_numpy(np.array(data.sequences[s.name], dtype=np.int64))
        real = seq != 0  # padding is not an id
        count = real.sum(1)
        crow = torch.zeros(rows + 1, dtype=torch.int64)
        torch.cumsum(count, 0, out=crow[1:])
        per_row = torch.ones(rows) if (s.pooling or "mean") == "sum" \
            else 1.0 / count.clamp_min(1).float()
        add(crow, seq[real] + table.shared_offset[s.name],
            per_row.repeat_interleave(count, output_size=int(crow[-1])))
    dense = torch.from_numpy(np.array(data.dense, dtype=np.float32)).reshape(rows, -1)
    labels = mask = None
    if data.labels is not None:
        labels = torch.from_numpy(np.array(data.labels, dtype=np.float32)).reshape(rows, -1)
        mask = torch.isfinite(labels)
        labels = torch.where(mask, labels, 0.0)
    return Design(blocks, dense, labels, mask)


def binned_rows(fe: FeatureEmbedding) -> torch.Tensor:
    """Which rows of ``fe``'s table belong to binned fields (``SparseFeatureSpec.binned``), as
    a boolean ``[R]``."""
    table = fe.embedding
    out = torch.zeros(table.num_rows, dtype=torch.bool)
    for f, spec in enumerate(fe.schema.sparse):
        if spec.binned:
            lo = int(table.offsets[f])
            out[lo: lo + spec.cardinality] = True
    return out


class _Objective:
    """``mean BCE + lam / 2 * (||p * w||^2 + ||w_d||^2)`` per label, summed over labels, and
    its gradient, for a flat parameter vector ``[w (R x T), w_d (Nd x T), b (T)]``; ``p^2`` is
    ``binned_l2`` on the rows in ``binned``, 1 on the others."""

    def __init__(self, d: Design, rows: int, tasks: int, binned: torch.Tensor | None = None):
        self.d, self.rows, self.tasks = d, rows, tasks
        self.per_label = d.mask.sum(0).clamp_min(1).float()  # type: ignore[union-attr]
        self.lam = 0.0
        self.binned = binned if binned is not None and bool(binned.any()) else None
        self.binned_l2 = 1.0

    @property
    def binned_l2(self) -> float:
        return self._binned_l2

    @binned_l2.setter
    def binned_l2(self, m: float) -> None:
        """Set the binned rows' multiplier; each row's, ``[R, 1]`` (or 1.0 for all), is
        built here once, not on every pass."""
        self._binned_l2 = m
        self.row_l2: torch.Tensor | float = 1.0 if self.binned is None or m == 1.0 else \
            torch.where(self.binned, m, 1.0).unsqueeze(1)

    def unpack(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, r, nd = self.tasks, self.rows, self.d.dense.shape[1]
        return (theta[: r * t].view(r, t), theta[r * t: (r + nd) * t].view(nd, t),
                theta[(r + nd) * t:])

    def __call__(self, theta: torch.Tensor) -> tuple[float, torch.Tensor]:
        w, wd, b = self.unpack(theta)
        d = self.d
        z = d.logits(w, wd, b)
        loss = F.binary_cross_entropy_with_logits(z, d.labels, weight=d.mask.float(),
                                                  reduction="none").sum(0)
        value = float((loss.double() / self.per_label.double()).sum())
        r = (torch.sigmoid(z) - d.labels) * d.mask / self.per_label  # dLoss/dz
        grad = torch.empty_like(theta)
        gw, gwd, gb = self.unpack(grad)
        gw.zero_()
        for _, xt in d.blocks:
            gw += xt @ r  # type: ignore[operator]
        gwd.copy_(d.dense.t() @ r)
        gb.copy_(r.sum(0))
        if self.lam:
            p = self.row_l2
            value += 0.5 * self.lam * float((w.double().square() * p).sum()
                                            + wd.double().square().sum())
            gw.add_(w * p, alpha=self.lam)
            gwd.add_(wd, alpha=self.lam)
        return value, grad


def _solve(obj: _Objective, theta: torch.Tensor, max_iter: int,
           max_eval: int | None = None) -> tuple[torch.Tensor, int]:
    """L-BFGS (strong Wolfe line search) from ``theta``, at most ``max_iter`` iterations
    and ``max_eval`` objective evaluations (torch's default: 1.25 x ``max_iter``); returns
    the solution and the number of objective evaluations."""
    theta = theta.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, max_eval=max_eval,
                            history_size=10,
                            tolerance_grad=1e-9, tolerance_change=1e-9,
                            line_search_fn="strong_wolfe")
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        value, grad = obj(theta.detach())
        theta.grad = grad
        return torch.tensor(value)

    opt.step(closure)
    return theta.detach(), calls


def fit_exact_lr(fe: FeatureEmbedding, train: SplitArrays, valid: SplitArrays,
                 score: Callable[[torch.Tensor], tuple[float, dict[str, float]]],
                 log: Callable[[str], None] | None = None,
                 seconds: float | None = None) -> dict[str, Any]:
    """Fit ``fe``'s first-order terms (bias, each row's weight per label, the numeric
    weights) as the L2-regularised LR on ``train``, ``C`` chosen on ``valid``, and write
    them into ``fe``. ``score(valid logits)`` returns ``(value, metrics)``, higher value
    better (the run's early-stopping metric, signed). ``seconds``: the time the search may
    take, counted from this call (the design matrices included); ``None``: no bound.
    Returns what the run reports; ``cut``, where the bound ended it early: ``search`` (the
    kept solve ran its iterations, later ones were cut or skipped) or ``solution`` (the kept
    solve itself was cut short)."""
    t0 = time.perf_counter()
    d_train, d_valid = design(train, fe, transpose=True), design(valid, fe, transpose=False)
    rows, tasks = fe.embedding.num_rows, fe.tasks
    obj = _Objective(d_train, rows, tasks, binned_rows(fe))
    n = len(train)
    theta = torch.zeros(rows * tasks + d_train.dense.shape[1] * tasks + tasks)
    base = (d_train.labels * d_train.mask).sum(0) / obj.per_label  # type: ignore[operator]
    _, _, b = obj.unpack(theta)
    b.copy_(torch.logit(base.clamp(1e-6, 1 - 1e-6)))
    path: list[dict[str, Any]] = []
    # (valid value, C, binned L2, solution, valid metrics, its path entry) of the best
    # solve so far
    best: tuple[float, float, float, torch.Tensor, dict[str, float], dict[str, Any]] | None \
        = None
    evals, cut = 0, False
    if seconds is not None:  # one pass timed: what a solve's passes cost
        tp = time.perf_counter()
        obj(theta)
        pass_seconds = time.perf_counter() - tp

    def solve(c: float, start: torch.Tensor, binned_l2: float = 1.0) -> bool:
        """Solve at ``c`` (and ``binned_l2``) from ``start``; True when it beats the best
        so far. Under a time bound, the passes that fit what is left; none (False, and
        ``cut`` set) when fewer than ``MIN_PASSES`` fit."""
        nonlocal best, evals, cut
        max_iter, max_eval = MAX_ITER, None
        if seconds is not None:
            left = int((seconds - (time.perf_counter() - t0)) / max(pass_seconds, 1e-9))
            if left < MIN_PASSES and best is not None:
                cut = True
                return False
            max_eval = min(max(left, MIN_PASSES), MAX_ITER * 5 // 4)
            max_iter = min(MAX_ITER, max_eval)
        obj.lam, obj.binned_l2 = 1.0 / (c * n), binned_l2
        theta, calls = _solve(obj, start, max_iter, max_eval)
        evals += calls
        short = max_eval is not None and max_eval < MAX_ITER * 5 // 4 and calls >= max_eval
        cut = cut or short  # stopped by the bound before its iterations were done
        value, metrics = score(d_valid.logits(*obj.unpack(theta)))
        extra = {} if obj.binned is None else {"binned_l2": binned_l2}
        path.append({"C": c, **extra, "evals": calls, **({"cut": True} if short else {}),
                     **{k: metrics[k] for k in ("auc", "logloss") if k in metrics}})
        if log is not None:
            log(f"C {c:g}" + (f", binned L2 x{binned_l2:g}" if extra else "")
                + f": {calls} passes, valid " + " ".join(
                    f"{k} {metrics[k]:.4f}" for k in ("auc", "logloss") if k in metrics))
        if best is None or (not math.isnan(value) and value > best[0]):
            best = (value, c, binned_l2, theta, metrics, path[-1])
            return True
        return False

    def walk_c(start: int, binned_l2: float, first: bool) -> None:
        """From ``C_PATH[start]`` (solved already unless ``first``) towards weaker
        regularisation while validation improves; if the first step already falls, towards
        stronger instead."""
        if first:
            solve(C_PATH[start], theta, binned_l2)
        weaker_helped = False
        for j in range(start + 1, len(C_PATH)):
            if not solve(C_PATH[j], best[3], binned_l2):  # type: ignore[index]
                break
            weaker_helped = True
        if not weaker_helped:
            for j in range(start - 1, -1, -1):
                if not solve(C_PATH[j], best[3], binned_l2):  # type: ignore[index]
                    break

    walk_c(C_PATH.index(C_START), 1.0, first=True)
    if obj.binned is not None:
        c0 = best[1]  # type: ignore[index]
        for m in BINNED_L2[1:]:  # the binned rows' own L2, at the best C, while it helps
            if not solve(c0, best[3], m):  # type: ignore[index]
                break
        if best[2] != 1.0:  # type: ignore[index]
            walk_c(C_PATH.index(c0), best[2], first=False)  # type: ignore[index]
    assert best is not None
    _, c, binned_l2, theta, metrics, entry = best
    w, wd, b = obj.unpack(theta)
    with torch.no_grad():
        weight = fe.embedding.weight
        weight[:, :tasks].copy_(w.to(weight.device, weight.dtype))
        fe.bias.copy_(b.to(fe.bias.device))
        if fe.dense_linear is not None:
            fe.dense_linear.weight.copy_(wd.t().to(fe.dense_linear.weight.device))
    return {"solver": "lbfgs", "C": c,
            **({} if obj.binned is None else {"binned_l2": binned_l2}),
            "passes": evals, "path": path,
            **({"cut": "solution" if entry.get("cut") else "search"} if cut else {}),
            "valid": {k: metrics[k] for k in ("auc", "logloss") if k in metrics}}
