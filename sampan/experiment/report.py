"""``sampan experiment report LOG_DIR``: per-arm results of an A/B test from its feedback log.

Per arm (forced requests left out): units, requests, impressions (served items), clicks; CTR
with its 95 % interval by the delta method over units; the relative lift over control with
its interval and two-sided p-value; CUPED-adjusted CTR and lift when a pre-period log is
given; GAUC (by unit) and MRR (by request) of the served scores. Over the arms: the
sample-ratio-mismatch chi-square of units against the configured shares. See
:mod:`sampan.experiment.stats` for the formulas.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from sampan.errors import DataError
from sampan.experiment import stats
from sampan.experiment.log import column, read_log
from sampan.metrics import gauc, grouped_ranking_metrics


def _units(table: pa.Table) -> np.ndarray:
    """Each row's unit key; a row without a unit is its request's own unit."""
    unit = pc.cast(table.column("unit"), pa.string())
    req = pc.cast(table.column("request_id"), pa.string())
    keys = pc.if_else(pc.is_null(unit), pc.binary_join_element_wise("r:", req, ""),
                      pc.binary_join_element_wise("u:", unit, ""))
    return keys.to_numpy(zero_copy_only=False).astype(str)


def _per_unit(keys: np.ndarray, clicks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(unit keys, clicks per unit, impressions per unit)``."""
    uniq, inv = np.unique(keys, return_inverse=True)
    c = np.bincount(inv, weights=clicks, minlength=len(uniq))
    m = np.bincount(inv, minlength=len(uniq)).astype(np.float64)
    return uniq, c, m


def analyze(table: pa.Table, shares: dict[str, float] | None = None,
            control: str | None = None, pre: pa.Table | None = None,
            ranking_k: int = 10) -> dict[str, Any]:
    """The report of a feedback log ``table`` as a dict (what ``--json`` writes).

    ``shares``: each arm's configured share of traffic (for the SRM check; default equal);
    ``control``: the arm the others are compared with (default ``control`` if present, else
    the first arm seen); ``pre``: a pre-period log of the same units, for CUPED."""
    forced = column(table, "forced").astype(bool)
    kept = table.filter(pa.array(~forced))
    variants = column(kept, "variant").astype(str)
    arms = list(dict.fromkeys(variants.tolist()))  # in order of first appearance
    if not arms:
        raise DataError("the feedback log has no unforced rows to analyse")
    if shares:
        unknown = [a for a in arms if a not in shares]
        if unknown:
            raise DataError(f"arm(s) {unknown} in the log have no configured share; "
                            f"shares given for {sorted(shares)}")
        arms = [a for a in shares if a in arms] + [a for a in arms if a not in shares]
    control = control or ("control" if "control" in arms else arms[0])
    if control not in arms:
        raise DataError(f"control arm {control!r} is not in the log; its arms: {arms}")
    keys = _units(kept)
    labels = column(kept, "label").astype(np.float64)
    scores = column(kept, "score").astype(np.float64)
    requests = column(kept, "request_id").astype(str)
    served_at = column(kept, "served_at").astype(np.float64)

    pre_units = pre_lin = None
    if pre is not None:  # each unit's linearised pre-period CTR (0, the mean, when absent)
        pre_f = pre.filter(pa.array(~column(pre, "forced").astype(bool)))
        pre_units, p_c, p_m = _per_unit(_units(pre_f), column(pre_f, "label").astype(np.float64))
        pre_lin = stats.ratio(p_c, p_m).lin

    per_arm: dict[str, Any] = {}
    ratios: dict[str, stats.Ratio] = {}
    pres: dict[str, np.ndarray] = {}
    for a in arms:
        sel = variants == a
        uniq, c, m = _per_unit(keys[sel], labels[sel])
        r = stats.ratio(c, m)
        ratios[a] = r
        if pre_units is not None and pre_lin is not None:
            at = np.minimum(np.searchsorted(pre_units, uniq), max(len(pre_units) - 1, 0))
            found = (pre_units[at] == uniq) if len(pre_units) else np.zeros(len(uniq), bool)
            pres[a] = np.where(found, pre_lin[at] if len(pre_lin) else 0.0, 0.0)
        lo, hi = r.interval()
        g = gauc(torch.from_numpy(scores[sel]), torch.from_numpy(labels[sel]),
                 torch.from_numpy(np.unique(keys[sel], return_inverse=True)[1]))
        rank = grouped_ranking_metrics(
            torch.from_numpy(scores[sel]), torch.from_numpy(labels[sel]),
            torch.from_numpy(np.unique(requests[sel], return_inverse=True)[1]), ranking_k)
        per_arm[a] = {"units": r.units, "requests": int(len(np.unique(requests[sel]))),
                      "impressions": int(r.den), "clicks": int(r.num), "ctr": r.value,
                      "ctr_ci95": [lo, hi], "ctr_se": r.se,
                      "gauc": g.value, "mrr": rank["mrr"],
                      "first_served_at": float(served_at[sel].min()),
                      "last_served_at": float(served_at[sel].max())}
    if pre is not None:
        theta = stats.cuped_theta([ratios[a].lin for a in arms], [pres[a] for a in arms])
        pre_mean = float(np.concatenate([pres[a] for a in arms]).mean())
        for a in arms:
            v, var = stats.cuped(ratios[a], pres[a], theta, pre_mean)
            per_arm[a]["cuped"] = {"ctr": v, "var": var, "theta": theta,
                                   "ctr_ci95": [v - stats.Z95 * math.sqrt(var),
                                                v + stats.Z95 * math.sqrt(var)]}
    for a in arms:
        if a == control:
            continue
        lf = stats.lift(ratios[a], ratios[control])
        per_arm[a]["lift"] = {"vs": control, "lift": lf.lift, "ci95": [lf.low, lf.high],
                              "p_value": lf.p_value, "diff": lf.diff, "diff_se": lf.diff_se}
        if pre is not None:
            ca, cc = per_arm[a]["cuped"], per_arm[control]["cuped"]
            lc = stats.lift(ratios[a], ratios[control], t_var=ca["var"], c_var=cc["var"],
                            t_value=ca["ctr"], c_value=cc["ctr"])
            ca["lift"] = {"lift": lc.lift, "ci95": [lc.low, lc.high], "p_value": lc.p_value}
    observed = {a: per_arm[a]["units"] for a in arms}
    configured = shares or {a: 1.0 / len(arms) for a in arms}
    s = stats.srm(observed, configured)
    return {"control": control, "arms": per_arm,
            "srm": {"chi2": s.chi2, "p_value": s.p_value, "flagged": s.flagged,
                    "expected_units": s.expected, "observed_units": s.observed,
                    "shares": configured, "shares_given": shares is not None},
            "rows": table.num_rows, "forced_rows": int(forced.sum())}


def cumulative(table: pa.Table, points: int = 40) -> dict[str, dict[str, list[float]]]:
    """Each arm's CTR and 95 % band over time (unforced rows up to each of ``points``
    times between the first and the last served_at)."""
    kept = table.filter(pa.array(~column(table, "forced").astype(bool)))
    t = column(kept, "served_at").astype(np.float64)
    keys, labels = _units(kept), column(kept, "label").astype(np.float64)
    variants = column(kept, "variant").astype(str)
    grid = np.linspace(t.min(), t.max(), points + 1)[1:]
    out: dict[str, dict[str, list[float]]] = {}
    for a in dict.fromkeys(variants.tolist()):
        sel = variants == a
        series: dict[str, list[float]] = {"t": [], "ctr": [], "low": [], "high": []}
        for g in grid:
            w = sel & (t <= g)
            if not w.any():
                continue
            _, c, m = _per_unit(keys[w], labels[w])
            r = stats.ratio(c, m)
            lo, hi = r.interval()
            series["t"].append(float(g - t.min()))
            series["ctr"].append(r.value)
            series["low"].append(lo)
            series["high"].append(hi)
        out[a] = series
    return out


def plot(curves: dict[str, dict[str, list[float]]], path: Path) -> Path:
    """A PNG of each arm's cumulative CTR with its 95 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for a, s in curves.items():
        t = np.asarray(s["t"]) / 60.0
        ax.plot(t, s["ctr"], label=a)
        ax.fill_between(t, s["low"], s["high"], alpha=0.2)
    ax.set_xlabel("minutes since the first served request")
    ax.set_ylabel("cumulative CTR (95 % band)")
    ax.set_title("CTR per arm")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def to_json(result: Any) -> str:
    """A report as strict JSON: a statistic that does not exist (one arm's lift, a test
    without data) is null, not NaN, so that any JSON reader takes the file."""
    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, (float, np.floating)):
            return float(v) if math.isfinite(v) else None
        return v
    return json.dumps(clean(result), indent=1, allow_nan=False)


def report(log_dir: str | Path, out: str | Path, shares: dict[str, float] | None = None,
           control: str | None = None, pre: str | Path | None = None) -> dict[str, Any]:
    """Analyse ``log_dir`` and write ``out/report.json`` and ``out/ctr.png``; returns the
    report. Shares default to ``LOG_DIR/experiment.json``'s arms when the server wrote one."""
    table = read_log(log_dir)
    if shares is None:
        meta = Path(log_dir) / "experiment.json"
        if meta.exists():
            arms = json.loads(meta.read_text()).get("arms", [])
            total = sum(a["weight"] for a in arms) or 1.0
            shares = {a["name"]: a["weight"] / total for a in arms}
    result = analyze(table, shares, control, read_log(pre) if pre is not None else None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(to_json(result))
    plot(cumulative(table), out / "ctr.png")
    return result
