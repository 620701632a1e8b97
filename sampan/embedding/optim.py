"""Row-sparse optimizers for :class:`EmbeddingCollection` tables.

Each step reads the unique rows touched by the batch and their gradients from the
collections, and updates only those rows (and only their optimizer state): "lazy" updates.
Numerics follow PyTorch's references exactly, which the tests check:

* :class:`SparseAdam` — lazy Adam. By default each row's bias correction counts that row's
  own updates; with ``bias_correction="table"`` it is exactly ``torch.optim.SparseAdam``
  (one step counter per table).
* :class:`SparseAdagrad` — ``torch.optim.Adagrad`` fed sparse gradients.
* :class:`SparseRowWiseAdagrad` — one accumulator per row (mean of squared gradients), the
  memory-light variant used by DLRM / TorchRec.

* :class:`SparseSGD` — plain SGD on the rows used: ``w -= lr g``.

``embedding_l2`` adds ``l2 * row`` to the gradient of each row used in the batch, the usual
lazy L2 regularisation of embeddings. ``embedding_l1`` moves each row used toward 0 by
``lr * l1`` after its update, stopping at 0 (the proximal step of an L1 penalty, lazy too).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from sampan.embedding.collection import EmbeddingCollection
from sampan.embedding.pages import huge_full, huge_zeros_like


class _SparseRowOptimizer(torch.optim.Optimizer):
    def __init__(self, collections: list[EmbeddingCollection], defaults: dict[str, Any]):
        if not collections:
            raise ValueError("a sparse optimizer needs at least one EmbeddingCollection")
        self.collections = list(collections)
        super().__init__([c.weight for c in collections], defaults)
        self.frozen_columns: dict[int, int] = {}  # id(table weight) -> leading columns kept

    def freeze_columns(self, collection: EmbeddingCollection, n: int) -> None:
        """Keep the first ``n`` columns of ``collection``'s rows as they are (e.g. first-order
        weights taken from a fitted LR) while the other columns train."""
        if not any(c is collection for c in self.collections):
            raise ValueError("freeze_columns: the collection is not one this optimizer updates")
        self.frozen_columns[id(collection.weight)] = n

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        sd["frozen_columns"] = {i: self.frozen_columns[id(p)] for i, p in enumerate(params)
                                if id(p) in self.frozen_columns}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        frozen = state_dict.pop("frozen_columns", {})
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        self.frozen_columns = {id(params[int(i)]): int(n) for i, n in frozen.items()}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002 - Optimizer API
        by_param = {id(c.weight): c for c in self.collections}
        for group in self.param_groups:
            for p in group["params"]:
                renewed = by_param[id(p)].pop_reset_rows()  # rows that changed hands
                if renewed is not None and self.state[p]:
                    self._reset_rows(p, renewed, group, self.state[p])
                looked = by_param[id(p)].pop_lookups()
                if looked is None:
                    continue
                rows, grad = looked
                grad = grad.to(p.dtype)
                # Rows are unique: gather them once, update the copy, write it back (several
                # times faster on CPU than index_add_ into the full table).
                w = p.index_select(0, rows)
                if group["embedding_l2"]:
                    grad = grad.add(w, alpha=group["embedding_l2"])
                kept = self.frozen_columns.get(id(p), 0)
                head = w[:, :kept].clone() if kept else None
                self._update(p, w, rows, grad, group, self.state[p])
                l1 = group.get("embedding_l1", 0.0)
                if l1:
                    shrink = group["lr"] * l1
                    w.sub_(w.clamp(-shrink, shrink))  # = sign(w) * max(|w| - shrink, 0)
                if head is not None:
                    w[:, :kept] = head
                p.index_copy_(0, rows, w)

    def _reset_rows(self, p: torch.Tensor, rows: torch.Tensor, group: dict[str, Any],
                    state: dict[str, Any]) -> None:
        """Per-row state of ``rows`` back to its initial value (a dynamic table's row given
        to a new key)."""
        for v in state.values():
            if torch.is_tensor(v) and v.dim() and v.shape[0] == p.shape[0]:
                v.index_fill_(0, rows, self._initial_state_value(group))

    def _initial_state_value(self, group: dict[str, Any]) -> float:  # noqa: ARG002
        return 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for c in self.collections:
            c.clear_lookups()

    def _update(self, p: torch.Tensor, w: torch.Tensor, rows: torch.Tensor,
                grad: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Update ``w`` (a copy of table ``p``'s rows ``rows``, ``[U, D]``) in place; the
        state tensors are full-size, like ``p``."""
        raise NotImplementedError


class SparseAdam(_SparseRowOptimizer):
    """Lazy Adam on the rows of each batch: a row's moments and weights change only at the
    steps that use it.

    ``bias_correction="row"`` (the default) corrects a row's moments by the number of times
    *that row* was updated, as dense Adam corrects a parameter's: a row's first update moves
    each coordinate by ``lr`` (``m / sqrt(v)`` is the gradient's sign), whether it comes at
    step 1 or step 100,000. ``"table"`` uses one step counter per table, exactly
    ``torch.optim.SparseAdam`` (and TensorFlow's LazyAdam): a row first seen at a late step
    has fresh moments (``m = 0.1 g``, ``v = 0.001 g^2``) but no correction left, so its
    first step is ``3.2 lr``, and a row updated ``k`` times far apart moves
    ``(1 - 0.9^k) / sqrt(0.001 k)`` times ``lr`` per update: 6.5 at ``k = 10``, still 3.2 at
    ``k = 100``. The rare ids, which carry the least evidence, then move fastest and memorise
    their few rows (README, "What Sampan does by default and why", for what it cost).

    The row counts are one float per row (``state["row_step"]``), kept with the moments in
    checkpoints and reset with them when a dynamic table gives a row to a new key. A state
    saved without them (before 2026-12-03) resumes with every row that has moments counted at
    the table's step: the correction it had then.
    """

    def __init__(self, collections: list[EmbeddingCollection], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 embedding_l2: float = 0.0, bias_correction: str = "row"):
        if bias_correction not in ("row", "table"):
            raise ValueError(f"SparseAdam bias_correction must be 'row' or 'table', got "
                             f"{bias_correction!r}")
        super().__init__(collections, {"lr": lr, "betas": betas, "eps": eps,
                                       "embedding_l2": embedding_l2,
                                       "bias_correction": bias_correction})

    def _update(self, p, w, rows, grad, group, state):  # type: ignore[no-untyped-def]
        by_row = group.get("bias_correction", "row") == "row"
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["exp_avg"] = huge_zeros_like(p)
            state["exp_avg_sq"] = huge_zeros_like(p)
        if by_row and "row_step" not in state:
            state["row_step"] = self._row_steps_of(state, p)
        state["step"] += 1
        b1, b2 = group["betas"]
        m_old = state["exp_avg"].index_select(0, rows)
        v_old = state["exp_avg_sq"].index_select(0, rows)
        m = m_old.add_(grad.sub(m_old), alpha=1 - b1)  # m + (1-b1)(g - m), in place on a copy
        v = v_old.add_(grad.square().sub_(v_old), alpha=1 - b2)
        state["exp_avg"].index_copy_(0, rows, m)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        update = m.div_(v.sqrt_().add_(group["eps"]))
        if by_row:
            k = state["row_step"].index_select(0, rows).add_(1)
            state["row_step"].index_copy_(0, rows, k)
            # lr * sqrt(1 - b2^k) / (1 - b1^k), one factor per row
            scale = torch.pow(b2, k).neg_().add_(1).sqrt_().div_(
                torch.pow(b1, k).neg_().add_(1)).mul_(group["lr"])
            w.addcmul_(update, scale.unsqueeze(1).to(w.dtype), value=-1)
        else:
            step = float(state["step"])
            w.add_(update, alpha=-group["lr"] * math.sqrt(1 - b2**step) / (1 - b1**step))

    @staticmethod
    def _row_steps_of(state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """Row counts for a state that has none: 0 for a new state; for one saved without
        them (a table-corrected run), the table's step for every row with moments."""
        counts = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
        if float(state["step"]):
            touched = state["exp_avg_sq"].ne(0).any(dim=1)
            counts.masked_fill_(touched, float(state["step"]))
        return counts


class SparseAdagrad(_SparseRowOptimizer):
    """Adagrad on the rows of each batch; matches ``torch.optim.Adagrad`` with sparse grads."""

    def __init__(self, collections: list[EmbeddingCollection], lr: float = 1e-2,
                 eps: float = 1e-10, initial_accumulator_value: float = 0.0,
                 embedding_l2: float = 0.0):
        super().__init__(collections, {"lr": lr, "eps": eps, "embedding_l2": embedding_l2,
                                       "initial_accumulator_value": initial_accumulator_value})

    def _initial_state_value(self, group: dict[str, Any]) -> float:
        return group["initial_accumulator_value"]

    def _update(self, p, w, rows, grad, group, state):  # type: ignore[no-untyped-def]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["sum"] = huge_full(p.shape, group["initial_accumulator_value"], p.dtype,
                                     p.device)
        state["step"] += 1
        s = state["sum"].index_select(0, rows).addcmul_(grad, grad)
        state["sum"].index_copy_(0, rows, s)
        w.add_(grad / s.sqrt_().add_(group["eps"]), alpha=-group["lr"])


class SparseRowWiseAdagrad(_SparseRowOptimizer):
    """Adagrad with one accumulator per row: ``s += mean(g^2)``, ``w -= lr g / (sqrt(s)+eps)``."""

    def __init__(self, collections: list[EmbeddingCollection], lr: float = 1e-2,
                 eps: float = 1e-10, embedding_l2: float = 0.0):
        super().__init__(collections, {"lr": lr, "eps": eps, "embedding_l2": embedding_l2})

    def _update(self, p, w, rows, grad, group, state):  # type: ignore[no-untyped-def]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["sum"] = huge_full(p.shape[0], 0.0, p.dtype, p.device)
        state["step"] += 1
        s = state["sum"].index_select(0, rows).add_(grad.square().mean(1))
        state["sum"].index_copy_(0, rows, s)
        scale = s.sqrt_().add_(group["eps"]).reciprocal_().unsqueeze(1)
        w.add_(grad * scale, alpha=-group["lr"])


class SparseSGD(_SparseRowOptimizer):
    """Plain SGD on the rows of each batch; matches ``torch.optim.SGD`` (no momentum) with
    sparse gradients."""

    def __init__(self, collections: list[EmbeddingCollection], lr: float = 1e-2,
                 embedding_l2: float = 0.0):
        super().__init__(collections, {"lr": lr, "embedding_l2": embedding_l2})

    def _update(self, p, w, rows, grad, group, state):  # type: ignore[no-untyped-def]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float64)
        state["step"] += 1
        w.add_(grad, alpha=-group["lr"])


def make_sparse_optimizer(name: str, collections: list[EmbeddingCollection], lr: float,
                          embedding_l2: float = 0.0,
                          embedding_l1: float = 0.0) -> _SparseRowOptimizer:
    """Build the sparse optimizer named in ``train.sparse_optimizer``."""
    classes = {"adam": SparseAdam, "adam_table": partial(SparseAdam, bias_correction="table"),
               "adagrad": SparseAdagrad, "rowwise_adagrad": SparseRowWiseAdagrad,
               "sgd": SparseSGD}
    if name not in classes:
        raise ValueError(f"unknown sparse optimizer {name!r}; choose one of {sorted(classes)}")
    opt = classes[name](collections, lr=lr, embedding_l2=embedding_l2)
    for group in opt.param_groups:
        group["embedding_l1"] = embedding_l1
    return opt
