"""A study's pictures for ``sampan report STUDY_FOLDER``.

* ``study_history.png``: every trial's value in trial order (pruned ones at their last
  reported value), the best so far, and the defaults run's value;
* ``study_curves.png``: the validation metric over epochs of every trial, pruned ones grey:
  where the pruner stopped them;
* ``study_importance.png``: each parameter's share of the value's variance (Optuna's fANOVA
  importances over the completed trials), drawn once there are
  :data:`MIN_IMPORTANCE_TRIALS` completed trials (before, a note says why it is not);
* ``study_parallel.png``: parallel coordinates: one line per completed trial through its
  parameters (log ranges on a log axis, choices evenly spaced), coloured by its value (the
  colour bar gives the scale).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sampan.errors import MissingPathError
from sampan.tune.study import EPOCH_UNITS, STUDY_FILE, _optuna

# Below this many completed trials the importances are not drawn: fANOVA fits a random
# forest to (parameters, value) and with a handful of points it mostly fits noise. Measured
# (random sampler, 16 seeds, 3 parameters, one of them 93 % of the variance): with 3 trials
# the dominant parameter came first 2 times in 16 (chance: 5), with 5 trials 8 times, with
# 10 trials 16 times (share 0.75 +- 0.12), with 20 trials 0.92 +- 0.05. More parameters
# need more trials than this.
MIN_IMPORTANCE_TRIALS = 10


@dataclass
class StudySection:
    """A study's part of the report: its HTML, the runs drawn with it (the defaults and the
    best trial, when they exist), its trial counts and what a reader must be told."""

    name: str
    html: str
    runs: list[Path]
    complete: int
    pruned: int
    notes: list[str] = field(default_factory=list)


def is_study(path: str | Path) -> bool:
    return (Path(path) / STUDY_FILE).is_file()


def load_study(folder: Path) -> tuple[dict[str, Any], Any]:
    meta = json.loads((folder / STUDY_FILE).read_text())
    optuna = _optuna()
    try:
        study = optuna.load_study(study_name=meta["study"], storage=meta["storage"])
    except KeyError:
        raise MissingPathError(f"{folder}: the study {meta['study']!r} is not in "
                               f"{meta['storage']}") from None
    return meta, study


def _finished(study: Any) -> tuple[list[Any], list[Any]]:
    optuna = _optuna()
    S = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    return ([t for t in trials if t.state == S.COMPLETE],
            [t for t in trials if t.state == S.PRUNED])


def draw_history(study: Any, meta: dict[str, Any], defaults: float | None, out: Path,
                 plt: Any) -> Path:
    from matplotlib.ticker import MaxNLocator  # matplotlib is optional: plt brought it

    complete, pruned = _finished(study)
    maximize = meta["direction"] == "maximize"
    fig, ax = plt.subplots(figsize=(9, 4.2), constrained_layout=True)
    if pruned:
        ax.scatter([t.number for t in pruned],
                   [t.intermediate_values[max(t.intermediate_values)] for t in pruned],
                   marker="x", color="0.6", label=f"pruned ({len(pruned)}): last value")
    xs = [t.number for t in complete]
    ys = [t.value for t in complete]
    ax.scatter(xs, ys, color="C0", zorder=3, label=f"completed ({len(complete)})")
    if ys:
        best = np.maximum.accumulate(ys) if maximize else np.minimum.accumulate(ys)
        ax.step(xs, best, where="post", color="C3", label="best so far")
    if defaults is not None:
        ax.axhline(defaults, color="k", ls="--", lw=1, label=f"defaults {defaults:.4f}")
    ax.set(xlabel="trial", ylabel=f"valid {meta['metric']}",
           title=f"study {meta['study']}: {meta['direction']} valid {meta['metric']}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # trial numbers
    _zoom(ax, ys, keep=[defaults, (max if maximize else min)(ys) if ys else None])
    ax.legend(fontsize=8, loc="lower right" if maximize else "upper right")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _zoom(ax: Any, ys: list[float], keep: list[float | None] | None = None) -> None:
    """Limit the y axis to the values that matter: a diverged trial, more than ten median
    absolute deviations from the median (about seven standard deviations of normal noise),
    would flatten the rest. Those are left off the axis and counted on the plot; every other
    value is in view, and those of ``keep`` (the defaults' value, the best trial's) too."""
    ys = [y for y in ys if y is not None and math.isfinite(y)]
    if len(ys) < 2:
        return
    kept = {y for y in keep or [] if y is not None and math.isfinite(y)}
    mid = float(np.median(ys))
    reach = 10 * max(float(np.median(np.abs(np.array(ys) - mid))), 1e-4)
    inside = [y for y in ys if abs(y - mid) <= reach or y in kept]
    lo, hi = min([*inside, *kept]), max([*inside, *kept])
    pad = max(hi - lo, 1e-4) * 0.25
    ax.set_ylim(lo - pad, hi + pad)
    if off := len(ys) - len(inside):
        ax.text(0.01, 0.98, f"{off} value(s) off the axis, far from the rest: "
                + ", ".join(f"{y:.4g}" for y in sorted(set(ys) - set(inside))[:3]),
                transform=ax.transAxes, fontsize=8, va="top")


def draw_curves(study: Any, meta: dict[str, Any], out: Path, plt: Any) -> Path:
    complete, pruned = _finished(study)
    fig, ax = plt.subplots(figsize=(9, 4.2), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    values = [t.value for t in complete]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    for t in pruned:
        steps = sorted(t.intermediate_values)
        ax.plot(np.array(steps) / EPOCH_UNITS, [t.intermediate_values[s] for s in steps],
                color="0.7", lw=1, marker="x", ms=4)
    for t in complete:
        steps = sorted(t.intermediate_values)
        shade = (t.value - lo) / (hi - lo) if hi > lo else 1.0
        ax.plot(np.array(steps) / EPOCH_UNITS, [t.intermediate_values[s] for s in steps],
                color=cmap(shade), lw=1.3)
    ax.plot([], [], color="0.7", marker="x", label="pruned")
    ax.plot([], [], color=cmap(1.0), label="completed (colour: final value)")
    if complete:
        _colorbar(fig, ax, plt, cmap, lo, hi, f"final valid {meta['metric']}")
    ax.set(xlabel="epochs", ylabel=f"valid {meta['metric']}",
           title="validation curve of every trial")
    # the best trial's curve stays in view, however far it is from the rest
    best = (max if meta["direction"] == "maximize" else min)(
        complete, key=lambda t: t.value) if complete else None
    _zoom(ax, [v for t in complete for v in t.intermediate_values.values()],
          keep=list(best.intermediate_values.values()) if best is not None else None)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def draw_importance(study: Any, out: Path, plt: Any) -> Path | None:
    """The fANOVA importances of the completed trials (``None``: under
    :data:`MIN_IMPORTANCE_TRIALS` of them, or nothing varied)."""
    optuna = _optuna()
    complete, _ = _finished(study)
    if len(complete) < MIN_IMPORTANCE_TRIALS:
        return None
    try:  # fANOVA by name: Optuna's default is no longer it (PED-ANOVA in 5.1, which scores
        # reaching the best trials, not the variance the axis names); seeded: the same
        # study draws the same bars
        imp = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
    except (RuntimeError, ValueError):  # nothing varied
        return None
    if not imp:
        return None
    names = list(imp)[::-1]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.4), constrained_layout=True)
    ax.barh(names, [imp[n] for n in names], color="C0")
    for y, n in enumerate(names):
        ax.text(imp[n], y, f" {imp[n]:.2f}", va="center", fontsize=8)
    ax.set(xlabel="share of the value's variance (fANOVA)", xlim=(0, 1.1),
           title=f"parameter importance ({len(complete)} completed trials)")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def importance_note(study: Any) -> str | None:
    """Why the importance plot is missing, when it is for too few completed trials."""
    n = len(_finished(study)[0])
    if n >= MIN_IMPORTANCE_TRIALS:
        return None
    return (f"parameter importance not drawn: {n} completed trial{'s' * (n != 1)}, and "
            f"with fewer than {MIN_IMPORTANCE_TRIALS} the importances are mostly noise (the "
            "parameter that matters most is often not ranked first); run more trials")


def draw_parallel(study: Any, meta: dict[str, Any], out: Path, plt: Any) -> Path | None:
    complete, _ = _finished(study)
    params = sorted({p for t in complete for p in t.params})
    if not complete or not params:
        return None
    axes_pos: dict[str, dict[Any, float] | tuple[float, float, bool]] = {}
    for p in params:
        dist = next(t.distributions[p] for t in complete if p in t.distributions)
        if hasattr(dist, "choices"):
            axes_pos[p] = {c: i / max(len(dist.choices) - 1, 1)
                           for i, c in enumerate(dist.choices)}
        else:
            axes_pos[p] = (float(dist.low), float(dist.high), bool(dist.log))

    def where(p: str, v: Any) -> float:
        pos = axes_pos[p]
        if isinstance(pos, dict):
            return pos[v]
        lo, hi, log = pos
        if log:
            return (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return (v - lo) / (hi - lo) if hi > lo else 0.5

    values = np.array([t.value for t in complete])
    lo, hi = float(values.min()), float(values.max())
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * (len(params) + 1)), 4.6),
                           constrained_layout=True)
    for t, v in sorted(zip(complete, values, strict=True), key=lambda x: x[1]):
        shade = (v - lo) / (hi - lo) if hi > lo else 1.0
        ys = [where(p, t.params[p]) if p in t.params else np.nan for p in params] + [shade]
        ax.plot(range(len(params) + 1), ys, color=cmap(shade), lw=1.2, alpha=0.85)
    for i, p in enumerate(params):
        ax.axvline(i, color="0.3", lw=0.8)
        pos = axes_pos[p]
        labels = ([(y, str(c)) for c, y in pos.items()] if isinstance(pos, dict) else
                  [(0.0, f"{pos[0]:.3g}"), (1.0, f"{pos[1]:.3g}")])
        for y, text in labels:
            ax.text(i + 0.03, y, text, fontsize=7, va="center")
    ax.axvline(len(params), color="0.3", lw=0.8)
    ax.text(len(params) + 0.03, 0.0, f"{lo:.4f}", fontsize=7)
    ax.text(len(params) + 0.03, 1.0, f"{hi:.4f}", fontsize=7)
    ax.set_xticks(range(len(params) + 1),
                  [p.rsplit(".", 1)[-1] for p in params] + [meta["metric"]], fontsize=8)
    ax.set_yticks([])
    ax.set(xlim=(-0.1, len(params) + 0.5), ylim=(-0.05, 1.05),
           title="completed trials through their parameters (colour: value)")
    _colorbar(fig, ax, plt, cmap, lo, hi, f"valid {meta['metric']}")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _colorbar(fig: Any, ax: Any, plt: Any, cmap: Any, lo: float, hi: float,
              label: str) -> None:
    """The scale of the trials' colours: ``lo`` (dark) to ``hi`` (light) of the value."""
    from matplotlib.colors import Normalize

    norm = Normalize(lo, hi if hi > lo else lo + 1e-12)  # one value: one colour, the top
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=label, pad=0.01)


def study_section(folder: Path, out: Path, plt: Any, table: Any) -> StudySection:
    """The study's HTML and pictures, and the runs the report shows with it (the defaults
    and the best trial, when they exist)."""
    import html

    meta, study = load_study(folder)
    summary = json.loads((folder / "summary.json").read_text()) if (
        folder / "summary.json").is_file() else {}
    defaults = (summary.get("defaults") or {}).get("value")
    parts = [f"<h2>Study {html.escape(meta['study'])}</h2><p>{html.escape(str(folder))}: "
             f"{meta['direction']} valid {meta['metric']}, storage "
             f"{html.escape(meta['storage'])}</p>"]
    if t := summary.get("time"):
        c = summary.get("trials", {})
        parts.append(f"<p>{c.get('complete', 0)} completed, {c.get('pruned', 0)} pruned, "
                     f"{c.get('fail', 0)} failed trials; they took {t['trial_seconds']:.0f} "
                     f"s; the pruned ones would have taken about "
                     f"{t['saved_seconds_estimate']:.0f} s more run to the end.</p>")
    if cmp := summary.get("best_vs_defaults"):
        lo, hi = cmp["diff_ci95"]
        parts.append(f"<p>Test AUC of the best trial minus the defaults': "
                     f"{cmp['diff']:+.4f}, 95 % interval [{lo:+.4f}, {hi:+.4f}] (paired "
                     f"bootstrap, {cmp['rows']:,} rows).</p>")
    notes = [n for n in (importance_note(study),) if n]
    for png in (draw_history(study, meta, defaults, out / "study_history.png", plt),
                draw_curves(study, meta, out / "study_curves.png", plt),
                draw_importance(study, out / "study_importance.png", plt),
                draw_parallel(study, meta, out / "study_parallel.png", plt)):
        if png is not None:
            parts.append(f'<img src="{png.name}">')
    if not any("study_importance.png" in x for x in parts):  # not a stale one beside the page
        (out / "study_importance.png").unlink(missing_ok=True)
    parts += [f"<p><b>note</b>: {html.escape(n)}.</p>" for n in notes]
    complete, pruned = _finished(study)
    top = sorted(complete, key=lambda t: t.value, reverse=meta["direction"] == "maximize")
    parts.append("<h3>Best trials</h3>" + table(
        ["trial", f"valid {meta['metric']}", "seconds", "parameters"],
        [[t.number, t.value, t.user_attrs.get("seconds", "-"),
          ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in t.params.items())] for t in top[:10]]))
    runs = [p for p in ([folder / "defaults"] + (
        [folder / top[0].user_attrs["run_dir"]] if top else []))
        if (p / "results.json").is_file()]
    return StudySection(name=meta["study"], html="".join(parts), runs=runs,
                        complete=len(complete), pruned=len(pruned), notes=notes)
