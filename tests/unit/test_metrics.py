"""Ranking / calibration metrics against hand-computed values and scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss, roc_auc_score

from sampan.metrics import MetricAccumulator, auc, gauc, logloss

TOL = 1e-9


def _t(x, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


# ------------------------------------------------------------------------------------ auc
def test_auc_docstring_case() -> None:
    # positives {0.35, 0.8} vs negatives {0.1, 0.4}: 3 of 4 pairs ordered correctly
    assert auc(_t([0.1, 0.4, 0.35, 0.8]), _t([0, 0, 1, 1])) == pytest.approx(0.75, abs=TOL)


def test_auc_tie_between_positive_and_negative_counts_half() -> None:
    # pos {0.5, 0.9}, neg {0.5, 0.2}: (0.5~0.5)=0.5, (0.5>0.2)=1, (0.9>0.5)=1, (0.9>0.2)=1
    assert auc(_t([0.5, 0.5, 0.2, 0.9]), _t([1, 0, 0, 1])) == pytest.approx(3.5 / 4, abs=TOL)


def test_auc_all_tied_is_half() -> None:
    assert auc(_t([0.3] * 6), _t([1, 0, 1, 0, 0, 1])) == pytest.approx(0.5, abs=TOL)


def test_auc_perfect_and_reversed() -> None:
    s = _t([0.1, 0.2, 0.3, 0.4])
    assert auc(s, _t([0, 0, 1, 1])) == pytest.approx(1.0, abs=TOL)
    assert auc(s, _t([1, 1, 0, 0])) == pytest.approx(0.0, abs=TOL)


def test_auc_labels_thresholded_at_half() -> None:
    # soft labels: > 0.5 positive; same ranking as the docstring case
    assert auc(_t([0.1, 0.4, 0.35, 0.8]), _t([0.2, 0.5, 0.7, 1.0])) == pytest.approx(0.75)


@pytest.mark.parametrize("labels", [[0, 0, 0], [1, 1, 1]])
def test_auc_single_class_is_nan(labels) -> None:
    assert math.isnan(auc(_t([0.1, 0.5, 0.9]), _t(labels)))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1)), min_size=2, max_size=80))
def test_auc_matches_sklearn_hypothesis(rows) -> None:
    scores = np.array([r[0] for r in rows], dtype=np.float64) / 5.0  # few values: many ties
    labels = np.array([r[1] for r in rows])
    got = auc(torch.from_numpy(scores), torch.from_numpy(labels))
    if labels.min() == labels.max():
        assert math.isnan(got)
    else:
        assert got == pytest.approx(roc_auc_score(labels, scores), abs=TOL)


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_sklearn_seeded(seed) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 3000))
    scores = np.round(rng.normal(size=n), 1)  # rounding creates many ties
    labels = (rng.random(n) < 1 / (1 + np.exp(-scores))).astype(np.int64)
    got = auc(torch.from_numpy(scores), torch.from_numpy(labels))
    assert got == pytest.approx(roc_auc_score(labels, scores), abs=TOL)


def test_auc_accepts_2d_float32() -> None:
    rng = np.random.default_rng(7)
    scores = rng.integers(0, 10, size=(200, 1)).astype(np.float32)
    labels = rng.integers(0, 2, size=(200, 1)).astype(np.float32)
    got = auc(torch.from_numpy(scores), torch.from_numpy(labels))
    assert got == pytest.approx(roc_auc_score(labels.ravel(), scores.ravel()), abs=TOL)


# -------------------------------------------------------------------------------- logloss
@pytest.mark.parametrize("seed", range(4))
def test_logloss_matches_sklearn(seed) -> None:
    rng = np.random.default_rng(100 + seed)
    n = 1000
    logits = rng.normal(scale=3.0, size=n)
    labels = (rng.random(n) < 0.3).astype(np.float64)
    probs = 1.0 / (1.0 + np.exp(-logits))
    expected = log_loss(labels, probs, labels=[0, 1])
    assert logloss(torch.from_numpy(logits), torch.from_numpy(labels)) == pytest.approx(
        expected, abs=TOL)


def test_logloss_hand_value() -> None:
    # logit 0 -> p = 0.5 -> loss ln 2 whatever the label
    assert logloss(_t([0.0, 0.0]), _t([1.0, 0.0])) == pytest.approx(math.log(2), abs=1e-12)
    # a very confident right answer stays finite and near 0; a confident wrong one ~ |logit|
    assert logloss(_t([100.0]), _t([1.0])) == pytest.approx(0.0, abs=1e-12)
    assert logloss(_t([-100.0]), _t([1.0])) == pytest.approx(100.0, rel=1e-12)


# ----------------------------------------------------------------------------------- gauc
def test_gauc_hand_example() -> None:
    # group 1: pos {0.9, 0.5}, neg {0.1}                      -> AUC 1.0,   3 rows
    # group 2: pos {0.3, 0.2}, neg {0.3, 0.8}: only a tie 0.5 -> AUC 0.125, 4 rows
    # group 3: all positive                                    -> skipped
    rows = [  # (group, score, label), interleaved
        (2, 0.3, 1), (1, 0.1, 0), (3, 0.7, 1), (2, 0.3, 0), (1, 0.9, 1),
        (2, 0.8, 0), (3, 0.4, 1), (1, 0.5, 1), (2, 0.2, 1),
    ]
    g = torch.tensor([r[0] for r in rows])
    s = _t([r[1] for r in rows])
    y = _t([r[2] for r in rows])
    r = gauc(s, y, g)
    assert r.value == pytest.approx((3 * 1.0 + 4 * 0.125) / 7, abs=TOL)
    assert r.groups_used == 2
    assert r.groups_skipped == 1


def test_gauc_all_groups_single_class() -> None:
    r = gauc(_t([0.1, 0.2, 0.3]), _t([1, 1, 0]), torch.tensor([5, 5, 9]))
    assert math.isnan(r.value)
    assert (r.groups_used, r.groups_skipped) == (0, 2)


def _gauc_reference(scores, labels, groups) -> tuple[float, int, int]:
    num = den = 0.0
    used = skipped = 0
    for gval in np.unique(groups):
        m = groups == gval
        if labels[m].min() == labels[m].max():
            skipped += 1
            continue
        num += m.sum() * roc_auc_score(labels[m], scores[m])
        den += m.sum()
        used += 1
    return num / den, used, skipped


@pytest.mark.parametrize("seed", range(5))
def test_gauc_matches_loop_reference(seed) -> None:
    rng = np.random.default_rng(200 + seed)
    n = 2000
    groups = rng.integers(-150, 150, size=n) * 7919  # negative and sparse ids
    scores = rng.integers(0, 8, size=n).astype(np.float64)  # heavy ties, also across groups
    labels = (rng.random(n) < 0.25).astype(np.float64)
    expected, used, skipped = _gauc_reference(scores, labels, groups)
    assert skipped > 0  # the data exercise the skip path
    r = gauc(torch.from_numpy(scores), torch.from_numpy(labels), torch.from_numpy(groups))
    assert r.value == pytest.approx(expected, abs=TOL)
    assert (r.groups_used, r.groups_skipped) == (used, skipped)


# ------------------------------------------------------------------------ MetricAccumulator
def test_accumulator_empty() -> None:
    assert MetricAccumulator().compute() == {}


def test_accumulator_equals_metrics_on_concatenation() -> None:
    rng = np.random.default_rng(3)
    sizes = [37, 1, 250, 64]
    acc = MetricAccumulator()
    zs, ys, gs = [], [], []
    for n in sizes:
        z = np.round(rng.normal(size=(n, 2)), 1).astype(np.float32)
        y = (rng.random((n, 2)) < 0.4).astype(np.float32)
        g = rng.integers(0, 20, size=n)
        acc.update(torch.from_numpy(z), torch.from_numpy(y), torch.from_numpy(g))
        zs.append(z)
        ys.append(y)
        gs.append(g)
    z, y, g = np.concatenate(zs), np.concatenate(ys), np.concatenate(gs)
    out = acc.compute()
    z64 = z.astype(np.float64)
    p = 1.0 / (1.0 + np.exp(-z64))
    assert out["rows"] == sum(sizes)
    assert out["auc"] == pytest.approx(roc_auc_score(y[:, 0], z64[:, 0]), abs=TOL)
    assert out["logloss"] == pytest.approx(log_loss(y[:, 0], p[:, 0], labels=[0, 1]), abs=TOL)
    assert out["ctr"] == pytest.approx(y[:, 0].mean(), abs=1e-6)
    assert out["pred_ctr"] == pytest.approx(p[:, 0].mean(), abs=1e-9)
    for t in range(2):
        assert out[f"auc_{t}"] == pytest.approx(roc_auc_score(y[:, t], z64[:, t]), abs=TOL)
        assert out[f"logloss_{t}"] == pytest.approx(
            log_loss(y[:, t], p[:, t], labels=[0, 1]), abs=TOL)
    expected, used, skipped = _gauc_reference(z64[:, 0], y[:, 0], g)
    assert out["gauc"] == pytest.approx(expected, abs=TOL)
    assert (out["gauc_groups"], out["gauc_skipped"]) == (used, skipped)


def test_accumulator_single_task_has_no_per_task_keys_and_no_gauc_without_groups() -> None:
    acc = MetricAccumulator()
    acc.update(_t([[0.5], [-1.0]], torch.float32), _t([[1.0], [0.0]], torch.float32))
    acc.update(_t([[2.0]], torch.float32), _t([[0.0]], torch.float32))
    out = acc.compute()
    assert set(out) == {"auc", "logloss", "rows", "ctr", "pred_ctr"}
    # pos {0.5}, neg {-1.0, 2.0}: one of two pairs ordered correctly
    assert out["auc"] == pytest.approx(0.5, abs=TOL)


# ------------------------------------------------------------------ top-K ranking metrics
def _reference_ranking(scores, relevant, k):
    """Plain-Python reference: pessimistic ties, binary gains, queries without relevant
    items skipped."""
    out = {"recall": [], "hit": [], "ndcg": [], "mrr": []}
    for s, r in zip(scores.tolist(), relevant.tolist(), strict=True):
        if not any(r):
            continue
        ranks = [sum(1 for t in s if t >= s[j]) for j in range(len(s)) if r[j]]
        top = [x for x in ranks if x <= k]
        out["recall"].append(len(top) / len(ranks))
        out["hit"].append(float(bool(top)))
        dcg = sum(1 / math.log2(x + 1) for x in top)
        idcg = sum(1 / math.log2(i + 2) for i in range(min(len(ranks), k)))
        out["ndcg"].append(dcg / idcg)
        out["mrr"].append(1 / min(ranks))
    return {key: sum(v) / len(v) for key, v in out.items()}


def test_ranking_metrics_hand_computed():
    from sampan.metrics import ranking_metrics

    s = torch.tensor([[0.9, 0.8, 0.1, 0.7], [0.2, 0.9, 0.5, 0.5], [0.1, 0.2, 0.3, 0.4]])
    r = torch.tensor([[False, True, False, True], [True, False, True, False],
                      [False, False, False, False]])
    got = ranking_metrics(s, r, k=2)
    # q1: relevant ranks 2 and 3 -> recall 1/2, hit 1, ndcg (1/log2 3)/(1 + 1/log2 3), mrr 1/2
    # q2: relevant ranks 4 (0.2) and 3 (0.5 tied with 0.5 -> pessimistic 3): nothing in top 2
    # q3: no relevant item: skipped
    assert got["queries"] == 2
    assert got["recall@2"] == pytest.approx((0.5 + 0) / 2)
    assert got["hitrate@2"] == pytest.approx(0.5)
    ndcg1 = (1 / math.log2(3)) / (1 + 1 / math.log2(3))
    assert got["ndcg@2"] == pytest.approx(ndcg1 / 2)
    assert got["mrr"] == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_ranking_metrics_rank_nan_scores_pessimistically():
    from sampan.metrics import ranking_metrics

    nan = float("nan")
    s = torch.tensor([[0.9, nan, 0.1], [nan, 0.5, 0.2]])
    r = torch.tensor([[True, False, False], [True, False, False]])
    got = ranking_metrics(s, r, k=2)
    # q1: the NaN competitor counts as above 0.9 -> rank 2; q2: the NaN item ranks last (3)
    assert got["hitrate@2"] == pytest.approx(0.5)
    assert got["mrr"] == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_ranking_metrics_match_reference_on_random_inputs():
    from sampan.metrics import ranking_metrics

    g = torch.Generator().manual_seed(0)
    for k in (1, 3, 10):
        s = torch.randint(0, 6, (40, 12), generator=g).float()  # many ties
        r = torch.rand(40, 12, generator=g) < 0.2
        got = ranking_metrics(s, r, k=k)
        want = _reference_ranking(s, r, k)
        assert got[f"recall@{k}"] == pytest.approx(want["recall"])
        assert got[f"hitrate@{k}"] == pytest.approx(want["hit"])
        assert got[f"ndcg@{k}"] == pytest.approx(want["ndcg"])
        assert got["mrr"] == pytest.approx(want["mrr"])


@pytest.mark.parametrize("seed", [0, 1])
def test_auc_bootstrap_equals_auc_of_each_resample(seed) -> None:
    from sampan.metrics import auc_bootstrap

    rng = np.random.default_rng(seed)
    n = 300
    scores = np.round(rng.random(n), 1)  # many ties
    labels = (rng.random(n) < 0.3).astype(np.float64)
    boot = auc_bootstrap(torch.tensor(scores), torch.tensor(labels), resamples=70, seed=seed,
                         chunk=16)
    # the same draws, made one resample at a time
    gen = torch.Generator().manual_seed(seed)
    draws = torch.cat([torch.randint(0, n, (min(16, 70 - k), n), generator=gen)
                       for k in range(0, 70, 16)]).numpy()
    expected = [roc_auc_score(labels[d], scores[d]) for d in draws]
    np.testing.assert_allclose(boot.numpy(), expected, rtol=0, atol=1e-12)


def test_auc_bootstrap_is_paired_and_spreads_like_the_standard_error() -> None:
    from sampan.metrics import auc_bootstrap

    rng = np.random.default_rng(3)
    n = 2000
    labels = (rng.random(n) < 0.25).astype(np.float64)
    a = labels + rng.normal(0, 1.5, n)
    b = a + rng.normal(0, 0.3, n)  # a close variant of a
    ba = auc_bootstrap(torch.tensor(a), torch.tensor(labels), resamples=400)
    bb = auc_bootstrap(torch.tensor(b), torch.tensor(labels), resamples=400)
    # Hanley-McNeil standard error of one AUC
    A, p, q = auc(torch.tensor(a), torch.tensor(labels)), labels.sum(), n - labels.sum()
    q1, q2 = A / (2 - A), 2 * A * A / (1 + A)
    se = math.sqrt((A * (1 - A) + (p - 1) * (q1 - A * A) + (q - 1) * (q2 - A * A)) / (p * q))
    assert 0.8 * se < float(ba.std()) < 1.25 * se
    assert abs(float(ba.mean()) - A) < 0.2 * se
    # the paired difference is far tighter than either AUC: the resamples are the same rows
    assert float((ba - bb).std()) < 0.5 * float(ba.std())
    assert auc_bootstrap(torch.tensor([0.2, 0.3]), torch.tensor([1.0, 1.0]), 5).isnan().all()


def _grouped_reference(scores, labels, groups, k):
    """Plain Python: per group, pessimistic ranks, then the four metrics' means."""
    import math
    from collections import defaultdict

    by = defaultdict(list)
    for s, y, g in zip(scores, labels, groups, strict=True):
        by[g].append((s, y > 0.5))
    recall, hit, ndcg, mrr, sizes = [], [], [], [], []
    for rows in by.values():
        rel = [s for s, y in rows if y]
        if not rel:
            continue
        ranks = [sum(1 for t, _ in rows if t >= s) for s in rel]  # ties: pessimistic
        in_k = [r for r in ranks if r <= k]
        recall.append(len(in_k) / len(rel))
        hit.append(1.0 if in_k else 0.0)
        idcg = sum(1 / math.log2(i + 2) for i in range(min(len(rel), k)))
        ndcg.append(sum(1 / math.log2(r + 1) for r in in_k) / idcg)
        mrr.append(1 / min(ranks))
        sizes.append(len(rows))
    n = len(recall)
    return {f"recall@{k}": sum(recall) / n, f"hitrate@{k}": sum(hit) / n,
            f"ndcg@{k}": sum(ndcg) / n, "mrr": sum(mrr) / n, "queries": float(n),
            "candidates_per_query": sum(sizes) / n}


@pytest.mark.parametrize("seed", range(5))
def test_grouped_ranking_metrics_match_a_plain_python_reference(seed) -> None:
    from sampan.metrics import grouped_ranking_metrics

    rng = np.random.default_rng(seed)
    n = 3000
    groups = rng.integers(0, 200, n) * 7 - 50  # unsorted, sparse, negative ids too
    scores = np.round(rng.random(n), 2)  # many ties
    labels = (rng.random(n) < 0.15).astype(np.float32)
    for k in (1, 5, 10):
        got = grouped_ranking_metrics(torch.tensor(scores), torch.tensor(labels),
                                      torch.tensor(groups), k)
        want = _grouped_reference(scores.tolist(), labels.tolist(), groups.tolist(), k)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-12), (k, key)


def test_ctr_evaluation_reports_ranking_metrics_per_group() -> None:
    from sampan.metrics import RANKING_K, MetricAccumulator

    acc = MetricAccumulator()
    acc.update(torch.tensor([[2.0], [1.0], [0.0], [3.0]]), torch.tensor([[0.], [1.], [0.], [1.]]),
               torch.tensor([1, 1, 1, 2]))
    m = acc.compute()
    assert m["mrr"] == pytest.approx((1 / 2 + 1) / 2)
    assert m[f"hitrate@{RANKING_K}"] == 1.0


def test_an_auc_of_a_one_class_label_is_nan_and_said_why():
    from sampan.metrics import MetricAccumulator
    from sampan.train.experiment import one_class_note

    acc = MetricAccumulator()  # two labels; the first has no positive in this split
    acc.update(torch.randn(50, 2), torch.stack([torch.zeros(50), torch.arange(50) % 2], 1))
    m = acc.compute()
    assert math.isnan(m["auc_0"]) and not math.isnan(m["auc_1"])
    note = one_class_note({"test": m})
    assert note.startswith("test auc, test auc_0 are undefined (nan)") and "auc_1" not in note
    assert one_class_note({"test": {"auc": 0.7}}) is None
