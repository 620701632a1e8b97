"""The study plots' y axis: every value in view but a diverged one, which is counted."""

from __future__ import annotations

import pytest

from sampan.report import _plt
from sampan.tune.plots import _zoom

pytest.importorskip("matplotlib")


@pytest.mark.parametrize("ys,keep,hidden", [
    # six close trials: the lowest is in view (a percentile cut once hid it)
    ([0.6918, 0.6927, 0.6918, 0.6922, 0.6925, 0.6909], 0.6922, []),
    # a diverged trial (AUC 0.5; LogLoss 9.3) would flatten the rest: it is left off
    ([0.81, 0.812, 0.809, 0.5, 0.811], None, [0.5]),
    ([0.41, 0.405, 9.3, 0.42], 0.43, [9.3]),
])
def test_the_axis_shows_every_value_but_a_diverged_one(ys, keep, hidden):
    plt = _plt()
    fig, ax = plt.subplots()
    _zoom(ax, ys, keep=[keep])
    lo, hi = ax.get_ylim()
    shown = [y for y in ys if lo <= y <= hi]
    assert sorted(set(ys) - set(shown)) == hidden
    assert keep is None or lo <= keep <= hi
    said = " ".join(t.get_text() for t in ax.texts)
    assert ("off the axis" in said) == bool(hidden)
    assert all(f"{y:.4g}" in said for y in hidden)
    plt.close(fig)


def test_the_best_trial_stays_in_view_however_far_it_is_from_the_rest():
    """Three trials, one far better than the others (a newcomer's study: its curve was off
    the axis): the values kept in view are never counted off it."""
    plt = _plt()
    fig, ax = plt.subplots()
    ys = [0.8521, 0.8523, 0.8522, 0.8524, 0.8520, 0.8676, 0.8687, 0.8688]
    _zoom(ax, ys, keep=[0.8676, 0.8687, 0.8688])
    lo, hi = ax.get_ylim()
    assert lo <= min(ys) and max(ys) <= hi
    assert not ax.texts
    plt.close(fig)
    fig, ax = plt.subplots()
    _zoom(ax, ys)  # without it, those are the far ones
    assert "off the axis" in " ".join(t.get_text() for t in ax.texts)
    plt.close(fig)
