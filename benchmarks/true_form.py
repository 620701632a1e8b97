"""A world's own labelling model fitted on its training rows: how much of its interactions
those rows can show to a model that is told where they are.

A world's pairs can be worth 0.04 AUC to the oracle and still be beyond its training rows:
with 40k rows, 2,000 clicks and most ids seen a handful of times, no estimate of the pairs'
vectors beats leaving them out. The defaults benchmark asks FM and DeepFM to beat the tuned
LR beyond the interval only where the rows can show the interactions, and finds that out here,
with none of Sampan's training code: the tuned LR's own design matrix (its one-hot and numeric
columns, starting from its coefficients) plus, for each true pair of fields ``(f, g)``,
``<u_f[id_f], u_g[id_g]>`` with one rank-``LATENT`` vector per id of each field shared by its
pairs (the form the world draws its labels from), fitted to the L2-regularised optimum of the
mean log loss by full-batch L-BFGS in float64. The LR part keeps the tuned LR's penalty
(``1 / (C n)``); the vectors' L2 is chosen on the validation rows along a path from strong to
weak, each fit starting from the last. Ids not seen in training (and missing values) get no
vector, as they get no LR column.

This model knows what no learner is told (which pairs interact, and their rank), so where it
cannot beat the LR, no model can be asked to; where it can, FM and DeepFM have to find the
pairs among all of them as well.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from sampan.data.synthetic import LATENT
from sampan.metrics import auc

# the vectors' L2 (mean-loss units), strong to weak; the path stops once validation AUC has
# fallen below its best twice in a row
L2_PATH = (3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)


def field_ids(tables: dict[str, pa.Table], column: str) -> tuple[dict[str, torch.Tensor], int]:
    """Each split's ids of ``column`` in the train split's vocabulary (``V`` = its size for a
    value not in it, or missing), and ``V``."""
    vocab = pc.unique(tables["train"].column(column).drop_null().combine_chunks())
    ids = {s: torch.from_numpy(pc.fill_null(pc.index_in(t.column(column), value_set=vocab),
                                            len(vocab)).to_numpy().astype(np.int64))
           for s, t in tables.items()}
    return ids, len(vocab)


def _torch_csr(m: Any) -> torch.Tensor:
    m = m.tocsr()
    with warnings.catch_warnings():  # "CSR support is in beta": products are all it does here
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)),
                                       torch.from_numpy(m.indices.astype(np.int64)),
                                       torch.from_numpy(m.data.astype(np.float64)), m.shape,
                                       check_invariants=False)


class _Design(torch.autograd.Function):
    """``X @ w`` whose backward is ``X^T @ g`` with ``X^T`` held as CSR too: autograd's own
    backward through a CSR product took 100x the forward's time."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, x: torch.Tensor, xt: torch.Tensor) -> torch.Tensor:
        ctx.xt = xt
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.xt @ g, None, None


def fit_true_form(x: dict[str, Any], y: dict[str, np.ndarray], coef: np.ndarray,
                  intercept: float, c: float, tables: dict[str, pa.Table],
                  pairs: list[tuple[int, int]], rank: int = LATENT, seed: int = 0,
                  max_iter: int = 200) -> dict[str, Any]:
    """The fit described in the module docstring. ``x`` / ``y``: the LR's design matrices
    (scipy) and labels per split; ``coef``, ``intercept``, ``c``: the tuned LR; ``pairs``:
    0-based categorical fields (column ``c{f + 1}``). Returns the chosen ``l2``, the path's
    validation AUCs, the test logits and the seconds taken."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    X = {s: _torch_csr(m) for s, m in x.items()}
    xt = _torch_csr(x["train"].T)
    Y = {s: torch.from_numpy(np.asarray(v, dtype=np.float64)) for s, v in y.items()}
    n = len(Y["train"])
    fields = sorted({f for p in pairs for f in p})
    ids, keep, vec = {}, {}, {}
    for f in fields:
        ids[f], v = field_ids(tables, f"c{f + 1}")
        keep[f] = torch.cat([torch.ones(v), torch.zeros(1)]).to(torch.float64)[:, None]
        vec[f] = (0.1 * torch.randn(v + 1, rank, generator=gen, dtype=torch.float64)
                  ).requires_grad_()
    w = torch.tensor(np.asarray(coef, dtype=np.float64), requires_grad=True)
    b = torch.tensor(float(intercept), dtype=torch.float64, requires_grad=True)

    def logits(split: str) -> torch.Tensor:
        z = (_Design.apply(w, X[split], xt) if split == "train" else X[split] @ w) + b
        for f, g in pairs:
            z = z + ((vec[f] * keep[f])[ids[f][split]]
                     * (vec[g] * keep[g])[ids[g][split]]).sum(dim=1)
        return z

    best: dict[str, Any] | None = None
    path, falls = [], 0
    params = [w, b, *vec.values()]
    for l2 in L2_PATH:
        opt = torch.optim.LBFGS(params, lr=1.0, max_iter=max_iter,
                                history_size=20, line_search_fn="strong_wolfe",
                                tolerance_grad=1e-9, tolerance_change=1e-12)

        def closure(l2: float = l2) -> torch.Tensor:
            for p in params:
                p.grad = None
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits("train"), Y["train"]) + 0.5 / (c * n) * w.square().sum() \
                + 0.5 * l2 * sum(u.square().sum() for u in vec.values())
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            valid = auc(logits("valid"), Y["valid"])
            path.append([l2, valid])
            if best is None or valid > best["valid_auc"]:
                best, falls = {"l2": l2, "valid_auc": valid,
                               "test_logits": logits("test").clone()}, 0
            else:
                falls += 1
                if falls == 2:
                    break
            # a strong L2 takes the vectors to 0, a stationary point of the product terms:
            # the next fit starts them away from it again
            for u in vec.values():
                if float(u.norm()) < 1e-3 * u.numel() ** 0.5:
                    u.copy_(0.1 * torch.randn(u.shape, generator=gen, dtype=torch.float64))
    assert best is not None
    return {**best, "path": path, "seconds": time.perf_counter() - t0}
