"""The statistics of an A/B report, with the user (the unit of assignment) as the unit.

CTR is a ratio of two per-user sums (clicks over impressions), and a user's impressions are
not independent of each other, so its variance comes from the delta method over users (Deng
et al., "Applying the Delta Method in Metric Analytics", KDD 2018), not from a binomial over
impressions, which would be far too narrow:

``Var(R) ~= (Var(c) - 2 R Cov(c, m) + R^2 Var(m)) / (n * mean(m)^2)``

for ``R = sum(c) / sum(m)`` over ``n`` users with clicks ``c`` and impressions ``m``. The same
linearisation, ``l = (c - R m) / mean(m)`` per user, carries CUPED (Deng et al., WSDM 2013):
the pre-period's metric ``x`` per user, ``theta = Cov(l, x) / Var(x)`` pooled over arms, and
``R - theta (mean_arm(x) - mean_all(x))`` with the variance of ``l - theta x``.

The sample-ratio-mismatch check is Pearson's chi-square of the units per arm against the
configured shares, flagged at p < 0.001 (as GrowthBook and Statsig do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

Z95 = 1.959963984540054


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for a chi-square with ``dof`` degrees of freedom (the regularised upper
    incomplete gamma function)."""
    if dof <= 0:
        return math.nan
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


@dataclass
class Ratio:
    """A per-unit ratio metric of one arm: ``value = sum(num) / sum(den)`` and the delta
    method's variance of it; ``lin`` is each unit's linearised contribution."""

    units: int
    num: float
    den: float
    value: float
    var: float
    lin: np.ndarray

    @property
    def se(self) -> float:
        return math.sqrt(self.var) if self.var >= 0 else math.nan

    def interval(self) -> tuple[float, float]:
        return self.value - Z95 * self.se, self.value + Z95 * self.se


def ratio(num: np.ndarray, den: np.ndarray) -> Ratio:
    """The delta-method ratio of per-unit sums ``num`` / ``den`` (one entry per unit)."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    n = len(num)
    if n == 0 or den.sum() <= 0:
        return Ratio(n, float(num.sum()), float(den.sum()), math.nan, math.nan, np.zeros(n))
    r = num.sum() / den.sum()
    mden = den.mean()
    lin = (num - r * den) / mden
    var = lin.var(ddof=1) / n if n > 1 else math.nan
    return Ratio(n, float(num.sum()), float(den.sum()), float(r), float(var), lin)


@dataclass
class Lift:
    """Relative lift of a treatment's ratio over control's: ``t / c - 1``, its 95 % interval
    (delta method on the log of the ratio) and the two-sided p-value of ``t - c = 0``."""

    lift: float
    low: float
    high: float
    p_value: float
    diff: float
    diff_se: float


def lift(t: Ratio, c: Ratio, t_var: float | None = None, c_var: float | None = None,
         t_value: float | None = None, c_value: float | None = None) -> Lift:
    """``t`` against ``c``; the ``*_var`` / ``*_value`` overrides carry CUPED's adjusted
    figures."""
    tv = t.value if t_value is None else t_value
    cv = c.value if c_value is None else c_value
    tvar = t.var if t_var is None else t_var
    cvar = c.var if c_var is None else c_var
    if not (tv > 0 and cv > 0) or math.isnan(tvar) or math.isnan(cvar):
        return Lift(math.nan, math.nan, math.nan, math.nan, tv - cv, math.nan)
    diff_se = math.sqrt(tvar + cvar)
    p = 2 * normal_sf(abs(tv - cv) / diff_se) if diff_se > 0 else math.nan
    log_se = math.sqrt(tvar / tv**2 + cvar / cv**2)
    log_ratio = math.log(tv / cv)
    return Lift(tv / cv - 1, math.exp(log_ratio - Z95 * log_se) - 1,
                math.exp(log_ratio + Z95 * log_se) - 1, p, tv - cv, diff_se)


@dataclass
class SRM:
    chi2: float
    p_value: float
    flagged: bool
    expected: dict[str, float]
    observed: dict[str, int]


def srm(observed: dict[str, int], shares: dict[str, float], alpha: float = 0.001) -> SRM:
    """Pearson's chi-square of units per arm against the configured ``shares`` (arms with a
    share of 0 are left out); ``flagged`` when p < ``alpha``."""
    arms = [a for a, s in shares.items() if s > 0]
    total = sum(observed.get(a, 0) for a in arms)
    norm = sum(shares[a] for a in arms)
    expected = {a: total * shares[a] / norm for a in arms}
    if total == 0 or len(arms) < 2:
        return SRM(math.nan, math.nan, False, expected, {a: observed.get(a, 0) for a in arms})
    chi2 = sum((observed.get(a, 0) - e) ** 2 / e for a, e in expected.items())
    p = chi2_sf(chi2, len(arms) - 1)
    return SRM(chi2, p, p < alpha, expected, {a: observed.get(a, 0) for a in arms})


def cuped_theta(lins: list[np.ndarray], pres: list[np.ndarray]) -> float:
    """CUPED's pooled ``theta = Cov(l, x) / Var(x)`` over all arms' units (each arm's ``l``
    centred on its own mean, so the arms' difference does not leak into theta)."""
    l_all = np.concatenate([lv - lv.mean() for lv in lins if len(lv)])
    x_all = np.concatenate([xv - xv.mean() for xv in pres if len(xv)])
    vx = x_all.var()
    return float((l_all * x_all).mean() / vx) if vx > 0 else 0.0


def cuped(r: Ratio, pre: np.ndarray, theta: float, pre_mean_all: float) -> tuple[float, float]:
    """CUPED-adjusted ``(value, variance)`` of one arm's ratio, given each unit's pre-period
    metric ``pre`` (aligned with the units of ``r``), the pooled ``theta`` and the pre-period
    mean over every arm."""
    adj = r.lin - theta * pre
    n = len(adj)
    value = r.value - theta * (float(pre.mean()) - pre_mean_all)
    return value, float(adj.var(ddof=1) / n) if n > 1 else math.nan
