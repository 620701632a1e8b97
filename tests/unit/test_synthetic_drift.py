"""The drifting modes of the built-in data: popularity moves along the rows (drift) or each
rank's id is replaced by new ones (churn), so ids keep appearing that the first rows never
held, while oracle_p stays the true probability; with neither the rows are the stationary
ones."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from sampan.config import SyntheticConfig
from sampan.data.synthetic import iter_synthetic


def rows(**kw):
    return pa.concat_tables(list(iter_synthetic(SyntheticConfig(**kw))))


def unseen_share(t, col):
    """Share of the last fifth's values of ``col`` that the first half never held."""
    n = t.num_rows
    seen = set(t.column(col).slice(0, n // 2).drop_null().to_pylist())
    late = t.column(col).slice(int(0.8 * n)).drop_null().to_pylist()
    return np.mean([v not in seen for v in late])


def test_drift_brings_new_ids_and_keeps_the_oracle_true():
    still, moving = rows(rows=80_000), rows(rows=80_000, drift=1.0)
    assert "t" not in still.column_names
    t = np.asarray(moving.column("t"))
    assert t[0] == 0.0 and t[-1] == 1.0 and bool((np.diff(t) > 0).all())
    for col in ("C3", "C10", "C21"):  # large vocabularies: the head moves far
        assert unseen_share(still, col) < 0.1 < 0.6 < unseen_share(moving, col)
    # oracle_p is the probability the labels are drawn with: calibrated in every period
    p, y = np.asarray(moving.column("oracle_p")), np.asarray(moving.column("label"))
    for part in np.array_split(np.arange(len(p)), 4):
        assert y[part].mean() == pytest.approx(p[part].mean(), abs=0.01)


def test_no_drift_leaves_the_rows_as_they_were():
    # the stationary rows as they were before the drifting mode existed (the values of
    # the code before it, checked by a hash of 70,000 rows when it was added)
    first = rows(rows=4)
    assert np.asarray(first.column("oracle_p")) == pytest.approx(
        [0.1859830946, 0.4840141275, 0.6677713151, 0.9401608334], abs=1e-9)
    assert first.column("C1").to_pylist() == ["a5718ece", "a5718ece", "73cad1cd", "425fb9f6"]
    a, c = rows(rows=3000), rows(rows=3000, drift=0.5)
    assert not np.array_equal(np.asarray(a.column("oracle_p")), np.asarray(c.column("oracle_p")))


def top_share(t, col, k=10):
    """Share of rows 60,000-80,000 that hold one of their ``k`` commonest values of col."""
    counts = pc.value_counts(t.column(col).slice(60_000, 20_000)).field("counts")
    return np.sort(counts.to_numpy())[-k:].sum() / 20_000


def test_churn_replaces_each_ranks_id_and_keeps_the_popularity_and_the_oracle_true():
    still, churned = rows(rows=80_000), rows(rows=80_000, churn=1.0)
    t = np.asarray(churned.column("t"))
    assert t[0] == 0.0 and t[-1] == 1.0
    for col in ("C3", "C10", "C21"):
        assert unseen_share(still, col) < 0.1 < 0.25 < unseen_share(churned, col)
    # the popularity curve stays the stationary one: the ten commonest ids' share of each
    # quarter is the stationary rows' share (new ids take over whole ranks)
    for col in ("C3", "C10"):
        assert top_share(churned, col) == pytest.approx(top_share(still, col), rel=0.15)
    p, y = np.asarray(churned.column("oracle_p")), np.asarray(churned.column("label"))
    for part in np.array_split(np.arange(len(p)), 4):
        assert y[part].mean() == pytest.approx(p[part].mean(), abs=0.01)


def test_churn_and_drift_combine_and_without_churn_drift_is_as_it_was():
    # the last rows of drift 0.5 as the code before churn existed made them
    a = rows(rows=3000, drift=0.5).slice(2997)
    assert np.asarray(a.column("oracle_p")) == pytest.approx(
        [0.0506931738, 0.4206932504, 0.2497070198], abs=1e-9)
    assert a.column("C3").to_pylist() == ["b9755eb9", "a9f77ea1", "9bf17597"]
    both = rows(rows=20_000, drift=1.0, churn=1.0)
    drift_only = rows(rows=20_000, drift=1.0)
    assert unseen_share(both, "C10") > unseen_share(drift_only, "C10")


def test_drift_and_churn_are_bounded_where_the_generator_stays_quick():
    # each field holds (1 + drift) x (1 + churn) x its vocabulary of ids, all made up front
    from pydantic import ValidationError

    for key in ("drift", "churn"):
        with pytest.raises(ValidationError, match=key):
            SyntheticConfig(**{key: 50})
