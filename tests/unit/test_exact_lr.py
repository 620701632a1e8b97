"""The exact LR of the warm start: its design matrix is the LR's own forward, and its
solution is scikit-learn's at the same C."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.linear_model import LogisticRegression

from sampan.batch import Batch
from sampan.data.arrays import SplitArrays
from sampan.models.lr import LR
from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec
from sampan.train.exact_lr import (
    BINNED_L2,
    C_PATH,
    C_START,
    MIN_PASSES,
    _Objective,
    _solve,
    binned_rows,
    design,
    fit_exact_lr,
    nonzeros,
)

# two id columns, a behaviour sequence sharing a's rows (mean-pooled), a bag with its own
# table (summed), two numeric columns
SCHEMA = DataSchema(dense=["x", "y"],
                    sparse=[SparseFeatureSpec("a", 40), SparseFeatureSpec("b", 12)],
                    sequences=[SequenceFeatureSpec("hist", 5, "a"),
                               SequenceFeatureSpec("tags", 3, "tags", pooling="sum")],
                    own_tables=[SparseFeatureSpec("tags", 9)])


def rows(n: int, seed: int) -> SplitArrays:
    """Labels from first-order effects of every part (the world an LR fits)."""
    rng, world = np.random.default_rng(seed), np.random.default_rng(7)
    wa, wb, wt = world.normal(0, 1, 40), world.normal(0, 1, 12), world.normal(0, 0.5, 9)
    a, b = rng.integers(0, 40, n), rng.integers(0, 12, n)
    hist = rng.integers(1, 40, (n, 5)) * (rng.random((n, 5)) < 0.6)  # 0: padding
    tags = rng.integers(1, 9, (n, 3)) * (rng.random((n, 3)) < 0.5)
    x = rng.normal(size=(n, 2)).astype(np.float32)
    real = np.maximum((hist != 0).sum(1), 1)
    z = wa[a] + wb[b] + (wa[hist] * (hist != 0)).sum(1) / real + (wt[tags] * (tags != 0)).sum(1) \
        + x @ np.array([0.7, -0.4]) - 1.0
    y = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.float32)[:, None]
    return SplitArrays(dense=x, sparse=np.stack([a, b], 1), labels=y,
                       sequences={"hist": hist, "tags": tags})


def unpacked(lr: LR) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fe = lr.features
    return fe.embedding.weight, fe.dense_linear.weight.t(), fe.bias


def test_the_design_matrix_is_the_lr_forward():
    data = rows(300, 1)
    torch.manual_seed(0)
    lr = LR(SCHEMA, LR.Config()).eval()
    with torch.no_grad():
        for p in lr.parameters():
            p.normal_()
        want = lr(Batch(dense=torch.from_numpy(data.dense),
                        sparse=torch.from_numpy(data.sparse),
                        sequences={k: torch.from_numpy(v) for k, v in data.sequences.items()}))
    d = design(data, lr.features, transpose=True)
    assert torch.allclose(d.logits(*unpacked(lr)), want, atol=1e-5)
    assert nonzeros(data, lr.features) == sum(x._nnz() for x, _ in d.blocks)
    # X^T is X transposed
    for x, xt in d.blocks:
        assert torch.equal(xt.to_dense(), x.to_dense().t())


def test_the_gradient_is_the_objectives():
    data = rows(200, 2)
    lr = LR(SCHEMA, LR.Config())
    obj = _Objective(design(data, lr.features, transpose=True), lr.features.embedding.num_rows, 1)
    obj.lam = 0.05
    theta = torch.randn(obj.rows + 2 + 1, generator=torch.Generator().manual_seed(3)) * 0.3
    value, grad = obj(theta)
    eps = 1e-2  # float32 objective: central differences on a few coordinates
    for i in (0, 5, obj.rows - 1, obj.rows, obj.rows + 2):
        e = torch.zeros_like(theta)
        e[i] = eps
        numeric = (obj(theta + e)[0] - obj(theta - e)[0]) / (2 * eps)
        assert grad[i].item() == pytest.approx(numeric, abs=2e-4)
    assert value > 0


def test_the_solution_is_scikit_learns_at_the_same_c():
    data, c = rows(3000, 3), 0.5
    lr = LR(SCHEMA, LR.Config())
    d = design(data, lr.features, transpose=True)
    obj = _Objective(d, lr.features.embedding.num_rows, 1)
    obj.lam = 1.0 / (c * len(data))
    theta, _ = _solve(obj, torch.zeros(obj.rows + 3), 500)
    ids = sum(sp.csr_matrix((v.values().numpy(), v.col_indices().numpy(),
                             v.crow_indices().numpy()), shape=tuple(v.shape))
              for v, _ in d.blocks)  # every block's columns are the table's rows
    x = sp.hstack([ids, sp.csr_matrix(data.dense)]).tocsr()
    ref = LogisticRegression(C=c, tol=1e-10, max_iter=10_000).fit(x, data.labels[:, 0])
    ours = theta[: obj.rows + 2].numpy()
    theirs = ref.coef_[0]
    assert np.abs(ours - theirs).max() < 0.02
    assert theta[-1].item() == pytest.approx(ref.intercept_[0], abs=0.02)
    # and its objective is as low as theirs
    sk = torch.from_numpy(np.concatenate([theirs, ref.intercept_])).float()
    assert obj(theta)[0] <= obj(sk)[0] + 1e-6


def test_c_is_chosen_on_validation_and_written_into_the_table():
    train, valid = rows(3000, 4), rows(1500, 5)
    lr = LR(SCHEMA, LR.Config())
    seen = []

    def score(z: torch.Tensor) -> tuple[float, dict[str, float]]:
        from sampan.metrics import auc
        value = auc(z[:, 0], torch.from_numpy(valid.labels[:, 0]))
        seen.append(value)
        return value, {"auc": value}

    out = fit_exact_lr(lr.features, train, valid, score)
    path = out["path"]
    assert path[0]["C"] == C_START
    assert out["valid"]["auc"] == max(seen) == max(p["auc"] for p in path)
    # the walk: every C tried is next on the grid to one tried before, and it ends on a C
    # that did not improve (or at the grid's end)
    at = [C_PATH.index(p["C"]) for p in path]
    assert all(min(abs(a - b) for b in at[:k]) == 1 for k, a in enumerate(at) if k)
    assert path[-1]["C"] != out["C"] or at[-1] in (0, len(C_PATH) - 1)
    # the table holds the chosen solution: its validation logits give the chosen AUC
    z = design(valid, lr.features, transpose=False).logits(*unpacked(lr))
    assert score(z)[0] == pytest.approx(out["valid"]["auc"], abs=1e-6)


# an id column and a number that also enters as its 16 quantile bins (its bucket twin)
TWIN = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 30),
                                       SparseFeatureSpec("x_bucket", 18, binned=True)])


def twin_rows(n: int, seed: int, effect: str) -> SplitArrays:
    """``effect`` ``linear``: the number acts through its standardised value (what its
    numeric weight carries; the bins only add noise); ``steps``: through the sign of
    sin(3x), which only its bins can follow."""
    rng, world = np.random.default_rng(seed), np.random.default_rng(11)
    wa = world.normal(0, 0.8, 30)
    a, x = rng.integers(0, 30, n), rng.normal(size=n)
    cuts = np.quantile(np.random.default_rng(12).normal(size=100_000), np.arange(1, 16) / 16)
    xb = 2 + np.searchsorted(cuts, x)  # ids 2..17 (0 padding, 1 missing)
    z = wa[a] - 1.0 + (0.8 * x if effect == "linear" else 1.2 * np.sign(np.sin(3 * x)))
    y = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.float32)[:, None]
    return SplitArrays(dense=x[:, None].astype(np.float32), sparse=np.stack([a, xb], 1),
                       labels=y)


def auc_score(valid: SplitArrays):
    from sampan.metrics import auc

    def score(z: torch.Tensor) -> tuple[float, dict[str, float]]:
        value = auc(z[:, 0], torch.from_numpy(valid.labels[:, 0]))
        return value, {"auc": value}
    return score


def test_binned_rows_are_the_binned_fields_table_rows():
    fe = LR(TWIN, LR.Config()).features
    rows = binned_rows(fe)
    lo = int(fe.embedding.offsets[1])
    assert lo == 30 and rows.sum() == 18 and rows[lo:].all() and not rows[:lo].any()
    assert not binned_rows(LR(SCHEMA, LR.Config()).features).any()


def test_the_binned_rows_own_l2_is_scikit_learns_on_scaled_columns():
    """An L2 ``m`` times stronger on some columns is the plain L2 on those columns scaled
    by ``1 / sqrt(m)`` (their coefficients then scaled back): scikit-learn's optimum."""
    data, c, m = twin_rows(3000, 1, "linear"), 0.5, 25.0
    fe = LR(TWIN, LR.Config()).features
    d = design(data, fe, transpose=True)
    obj = _Objective(d, fe.embedding.num_rows, 1, binned_rows(fe))
    obj.lam, obj.binned_l2 = 1.0 / (c * len(data)), m
    theta, _ = _solve(obj, torch.zeros(obj.rows + 2), 500)
    x, _ = d.blocks[0]
    ids = sp.csr_matrix((x.values().numpy(), x.col_indices().numpy(),
                         x.crow_indices().numpy()), shape=tuple(x.shape))
    scale = np.where(binned_rows(fe).numpy(), 1 / np.sqrt(m), 1.0)
    xs = sp.hstack([ids @ sp.diags(scale), sp.csr_matrix(data.dense)]).tocsr()
    ref = LogisticRegression(C=c, tol=1e-10, max_iter=10_000).fit(xs, data.labels[:, 0])
    theirs = ref.coef_[0] * np.concatenate([scale, [1.0]])
    assert np.abs(theta[: obj.rows + 1].numpy() - theirs).max() < 0.01
    assert theta[-1].item() == pytest.approx(ref.intercept_[0], abs=0.01)
    # the gradient of the penalty follows its value
    eps, i = 1e-2, int(fe.embedding.offsets[1]) + 4
    e = torch.zeros_like(theta)
    e[i] = eps
    numeric = (obj(theta + e)[0] - obj(theta - e)[0]) / (2 * eps)
    assert obj(theta)[1][i].item() == pytest.approx(numeric, abs=2e-4)


@pytest.mark.parametrize("effect", ["linear", "steps"])
def test_the_binned_rows_l2_is_chosen_on_validation(effect):
    train, valid = twin_rows(4000, 2, effect), twin_rows(20_000, 3, effect)
    fe = LR(TWIN, LR.Config()).features
    out = fit_exact_lr(fe, train, valid, auc_score(valid))
    tried = {p["binned_l2"] for p in out["path"]}
    assert tried <= set(BINNED_L2) and len(tried) > 1
    assert out["valid"]["auc"] == max(p["auc"] for p in out["path"])
    if effect == "linear":  # the number's weight carries it: the bins give way
        assert out["binned_l2"] > 1
        # an LR without binned fields reports no such multiplier
        assert "binned_l2" not in fit_exact_lr(LR(SCHEMA, LR.Config()).features,
                                               rows(2000, 4), rows(1000, 5),
                                               auc_score(rows(1000, 5)))
    else:  # only the bins can follow it: they keep the common L2
        assert out["binned_l2"] == 1


def test_a_time_bound_ends_the_c_search_with_the_best_so_far():
    train, valid = rows(3000, 4), rows(1500, 5)
    free = fit_exact_lr(LR(SCHEMA, LR.Config()).features, train, valid, auc_score(valid))
    assert "cut" not in free and len(free["path"]) > 2
    # a bound the search cannot meet: the first solve still runs, on the fewest passes, and
    # is kept, and the report says it was cut
    fe = LR(SCHEMA, LR.Config()).features
    out = fit_exact_lr(fe, train, valid, auc_score(valid), seconds=0.0)
    assert out["cut"] == "solution" and [p["C"] for p in out["path"]] == [C_START]
    assert out["path"][0]["cut"]
    assert MIN_PASSES <= out["passes"] < free["path"][0]["evals"]
    fitted = LR(SCHEMA, LR.Config())
    fitted.features = fe
    z = design(valid, fe, transpose=False).logits(*unpacked(fitted))
    assert auc_score(valid)(z)[0] == pytest.approx(out["valid"]["auc"], abs=1e-6)
    assert out["valid"]["auc"] < free["valid"]["auc"]
    # a bound it meets changes nothing
    roomy = fit_exact_lr(LR(SCHEMA, LR.Config()).features, train, valid, auc_score(valid),
                         seconds=600.0)
    assert "cut" not in roomy and roomy["path"] == free["path"]
