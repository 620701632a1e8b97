"""``sampan report RUN [RUN ...]``: an HTML page and PNGs that show how runs trained and
how good their scores are.

For each run:

* ``curves.png``: train loss over steps (each logged value and a moving average), at every
  evaluation the validation metric early stopping followed (the best marked; a retrieval
  or next-item run's popularity baseline dashed) and every other validation metric the run
  logged (LogLoss, GAUC, Recall / NDCG / HitRate@K, MRR), the learning rate;
* ``roc.png``: the ROC curve on the chosen split, with its AUC;
* ``calibration.png``: the reliability curve (mean predicted probability against the
  observed positive rate in ten equal-count bins, with the expected calibration error) over
  the histogram of scores, positives and negatives apart;
* the HTML page: the split's metrics with their 95 % bootstrap intervals (the AUC's over
  the rows; a two-tower or next-item run's ranking metrics over the queries), every
  feature's ids and OOV share, and the rows rejected by reason.

Several runs are also drawn together (``compare_curves.png``, ``compare_roc.png``) with one
metric table. Figures are drawn with matplotlib's Agg backend (no display needed).
Retrieval and next-item runs have no ROC or calibration (they rank items: every row of a
next-item split is a positive); their curves and ranking metrics show.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sampan.errors import MissingExtraError, MissingPathError

BINS = 10
# the validation metrics a run logs (sampan.metrics, sampan.tasks): the rest of a record
# (rows, queries, ctr, counts of unknown ids, pop_* baselines, best) is not drawn as one
_METRIC = re.compile(r"(?P<f>auc|logloss)(?:_(?P<t>\d+))?|(?P<g>gauc|mrr)"
                     r"|(?P<r>recall|ndcg|hitrate)@(?P<k>\d+)")
_ORDER = ("auc", "gauc", "logloss", "recall", "ndcg", "hitrate", "mrr")
_NAMES = {"auc": "AUC", "gauc": "GAUC", "logloss": "LogLoss", "mrr": "MRR",
          "recall": "Recall", "ndcg": "NDCG", "hitrate": "HitRate"}


def _metric_order(name: str) -> tuple[int, int, int]:
    m = _METRIC.fullmatch(name)
    if m is None:
        return len(_ORDER), 0, 0
    return _ORDER.index(m["f"] or m["g"] or m["r"]), int(m["t"] or -1), int(m["k"] or 0)


def metric_names(records: Any) -> list[str]:
    """The metrics among the keys of ``records`` (dicts), in table order: AUC, GAUC,
    LogLoss (per label after the first's), Recall@K, NDCG@K, HitRate@K (by K), MRR."""
    found = {k for r in records for k, v in r.items()
             if _METRIC.fullmatch(k) and isinstance(v, int | float)}
    return sorted(found, key=_metric_order)


def metric_label(name: str) -> str:
    """``recall@10`` -> ``Recall@10``, ``auc_1`` -> ``AUC (label 1)``."""
    m = _METRIC.fullmatch(name)
    if m is None:
        return name
    if m["r"]:
        return f"{_NAMES[m['r']]}@{m['k']}"
    family = m["f"] or m["g"]
    return _NAMES[family] + (f" (label {m['t']})" if m["t"] else "")


@dataclass
class RunReport:
    """What the report shows of one run."""

    name: str
    path: Path
    results: dict[str, Any]
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    data: dict[str, Any]
    split: str
    probs: np.ndarray | None  # the split's probabilities of the first label
    labels: np.ndarray | None
    intervals: dict[str, list[float]]  # metric -> its 95 % bootstrap interval on the split
    kind: str | None = None  # the model's task: binary, retrieval, next_item (None: training)

    @property
    def metrics(self) -> dict[str, Any]:
        """The split's metrics as the run wrote them (``results.json``)."""
        return self.results.get(self.split, {})

    @property
    def auc_ci95(self) -> list[float] | None:
        return self.intervals.get("auc")

    def tracked(self) -> str | None:
        """The validation metric early stopping followed: the one equal to ``best`` at
        every evaluation that set it (ties: the first in table order)."""
        logged = metric_names(self.evals)
        hits = [e for e in self.evals if "best" in e and e.get("best_step") == e["step"]]
        same = [m for m in logged if hits and all(e.get(m) == e["best"] for e in hits)]
        return (same or logged or [None])[0]


def load_run(path: str | Path, split: str = "test", resamples: int = 500) -> RunReport:
    """Read a finished run: its logs, data manifest, and its best model's scores on
    ``split`` with the 95 % bootstrap intervals of its metrics from ``resamples`` resamples
    (the AUC's over the rows; a two-tower or next-item model's ranking metrics over the
    queries)."""
    import torch

    from sampan.metrics import auc_bootstrap
    from sampan.train.evaluate import probabilities
    from sampan.train.experiment import RunArtifacts

    run = Path(path)
    if not (run / "metrics.jsonl").is_file():
        raise MissingPathError(f"{run} is not a finished Sampan run (no metrics.jsonl)")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    results = json.loads((run / "results.json").read_text()) if (
        run / "results.json").is_file() else {}
    manifest = run / "data" / "manifest.json"
    data = json.loads(manifest.read_text()) if manifest.is_file() else {}
    probs = labels = None
    intervals: dict[str, list[float]] = {}
    art = RunArtifacts(run) if results else None  # still training: its curves only
    kind = getattr(art.model, "task", "binary") if art is not None else None
    if kind == "binary":  # a retrieval or next-item split's rows are all positives
        arrays = art.labelled(split)
        logits = art.evaluator.predict_logits(arrays)
        probs = probabilities(logits)[:, 0]
        labels = np.asarray(arrays.labels[:, 0], dtype=np.float64)
        b = auc_bootstrap(logits[:, 0], torch.from_numpy(labels.astype(np.float32)), resamples)
        b = b[~b.isnan()]
        if len(b):
            intervals["auc"] = [float(torch.quantile(b, 0.025)),
                                float(torch.quantile(b, 0.975))]
    elif kind in ("next_item", "retrieval") and resamples:  # the queries (users) resampled
        m = art.evaluate(split, bootstrap=resamples)
        intervals = {k.removesuffix("_ci95"): v for k, v in m.items() if k.endswith("_ci95")}
    return RunReport(name=run.name if run.name not in ("", ".") else str(run), path=run,
                     results=results, train=[r for r in rows if r.get("split") == "train"],
                     evals=[r for r in rows if r.get("split") == "valid"], data=data,
                     split=split, probs=probs, labels=labels, intervals=intervals, kind=kind)


def roc_curve(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """``(false positive rates, true positive rates, AUC)`` at every distinct score (ties
    move both rates at once, so the trapezoid area is the Mann-Whitney AUC)."""
    order = np.argsort(-probs, kind="stable")
    s, y = probs[order], labels[order] > 0.5
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # the last row of each score
    tp = np.cumsum(y)[last]
    fp = np.cumsum(~y)[last]
    pos, neg = max(int(y.sum()), 1), max(int((~y).sum()), 1)
    tpr, fpr = np.r_[0.0, tp / pos], np.r_[0.0, fp / neg]
    return fpr, tpr, float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))


def calibration(probs: np.ndarray, labels: np.ndarray, bins: int = BINS
                ) -> dict[str, Any]:
    """Reliability in ``bins`` equal-count bins of the predicted probability: each bin's
    mean prediction, observed positive rate and rows, and the expected calibration error
    (the rows-weighted mean of ``|observed - predicted|``)."""
    order = np.argsort(probs, kind="stable")
    parts = [p for p in np.array_split(order, bins) if len(p)]
    pred = np.array([probs[p].mean() for p in parts])
    obs = np.array([(labels[p] > 0.5).mean() for p in parts])
    rows = np.array([len(p) for p in parts])
    ece = float((np.abs(obs - pred) * rows).sum() / rows.sum()) if len(rows) else float("nan")
    return {"predicted": pred, "observed": obs, "rows": rows, "ece": ece}


def _plt():  # type: ignore[no-untyped-def]
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError("sampan report draws with matplotlib: pip install "
                                "'sampan[report]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(x: np.ndarray, k: int) -> np.ndarray:
    if len(x) < k or k < 2:
        return x
    c = np.cumsum(np.r_[0.0, x])
    head = c[1:k] / np.arange(1, k)
    return np.r_[head, (c[k:] - c[:-k]) / k]


def draw_curves(runs: list[RunReport], out: Path) -> Path:
    """Train loss, the validation metric early stopping followed, the other validation
    metrics the runs logged, and the learning rate over steps; the dense gradient norm and
    the embedding row norm (log scale: vanishing or exploding gradients) where the runs
    logged them."""
    plt = _plt()
    norms = any("grad_norm" in t for r in runs for t in r.train)
    fig, axes = plt.subplots(3 if norms else 2, 2, figsize=(11, 10.5 if norms else 7),
                             constrained_layout=True)
    (ax_loss, ax_metric), (ax_other, ax_lr) = axes[:2]
    panels = []
    if norms:
        ax_g, ax_e = axes[2]
        panels = [(ax_g, "dense gradient norm (logged steps)", "L2 norm"),
                  (ax_e, "embedding row norm (mean)", "L2 norm")]
    # one metric on the shared axis (a run without it is not drawn there)
    m = next((t for r in runs if (t := r.tracked()) is not None), None)
    others = [k for k in metric_names(e for r in runs for e in r.evals) if k != m]
    for i, r in enumerate(runs):
        color = f"C{i}"
        label = r.name if len(runs) > 1 else None
        steps = np.array([t["step"] for t in r.train])
        loss = np.array([t["loss"] for t in r.train], dtype=float)
        if len(steps):
            k = max(1, len(loss) // 20)
            if len(runs) == 1 or k == 1:
                ax_loss.plot(steps, loss, color=color, alpha=0.3 if k > 1 else 1.0,
                             lw=1 if k > 1 else 2, label=label or "logged")
            if k > 1:
                ax_loss.plot(steps, _smooth(loss, k), color=color, lw=2,
                             label=label or f"moving average of {k}")
            lr = [t.get("lr") for t in r.train]
            if all(v is not None for v in lr):
                ax_lr.plot(steps, lr, color=color, lw=2, label=label)
            if norms:
                _norm_lines(r, ax_g, ax_e, color, label)
        if m is not None:
            _tracked_line(r, m, ax_metric, color, label)
        for j, name in enumerate(others):
            ev = [e for e in r.evals if name in e]
            if ev:  # one run: a colour per metric; several: the run's colour, a line style
                ax_other.plot([e["step"] for e in ev], [e[name] for e in ev], marker="o",
                              lw=2, ms=4, color=color if label else f"C{j}",
                              ls=("-", "--", ":", "-.")[j % 4] if label else "-",
                              label=(f"{label}: " if label else "") + metric_label(name)
                              if len(others) > 1 else label)
    last = max((t["step"] for r in runs for t in [*r.train, *r.evals]), default=1)
    for ax in axes.flat:  # one step axis for all four
        ax.set_xlim(0, last * 1.03)
    name = metric_label(m) if m else "metric"
    for ax, title, y in ((ax_loss, "train loss", "loss"),
                         (ax_metric, f"validation {name}", name),
                         (ax_other, f"validation {metric_label(others[0])}"
                          if len(others) == 1 else "other validation metrics",
                          metric_label(others[0]) if len(others) == 1 else "value"),
                         (ax_lr, "learning rate", "lr"), *panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        elif not ax.lines:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center",
                    transform=ax.transAxes, color="grey")
    fig.suptitle("training curves" + (f": {runs[0].name}" if len(runs) == 1 else ""))
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _tracked_line(r: RunReport, m: str, ax: Any, color: str, label: str | None) -> None:
    """``m`` at every evaluation of ``r``, its best marked (when ``m`` is what the run's
    early stopping followed) and the popularity baseline a ranking task logs beside it."""
    ev = [e for e in r.evals if m in e]
    if not ev:
        return
    ax.plot([e["step"] for e in ev], [e[m] for e in ev], "o-", color=color, lw=2,
            label=label or f"valid {metric_label(m)}")
    best = r.results.get("best_step", ev[-1].get("best_step"))
    hit = [e for e in ev if e["step"] == best]
    if hit and r.tracked() == m:
        ax.plot([best], [hit[0][m]], "*", color=color, ms=16,
                label=None if label else f"best (step {best})")
    pop = [e[f"pop_{m}"] for e in ev if f"pop_{m}" in e]
    if pop:  # the same items ranked by training popularity: what the model has to beat
        ax.axhline(pop[-1], color=color, ls="--", lw=1,
                   label=None if label else f"popularity baseline {pop[-1]:.4f}")


def _norm_lines(r: RunReport, ax_g: Any, ax_e: Any, color: str, label: str | None) -> None:
    rows = [t for t in r.train if "grad_norm" in t]
    if rows:
        ax_g.plot([t["step"] for t in rows], [t["grad_norm"] for t in rows], color=color,
                  lw=1.5, label=label)
        ax_g.set_yscale("log")
    keys = sorted({k for t in r.train for k in t if k.startswith("embedding_norm")})
    for j, k in enumerate(keys):
        rows = [t for t in r.train if k in t]
        name = k.partition("/")[2] or "embedding"
        ax_e.plot([t["step"] for t in rows], [t[k] for t in rows], color=color, lw=1.5,
                  ls=("-", "--", ":", "-.")[j % 4],
                  label=(f"{label}: {name}" if label else name) if len(keys) > 1 else label)


def draw_roc(runs: list[RunReport], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5.5), constrained_layout=True)
    for i, r in enumerate(runs):
        if r.probs is None:
            continue
        fpr, tpr, area = roc_curve(r.probs, r.labels)
        ax.plot(fpr, tpr, color=f"C{i}", lw=2,
                label=f"{r.name + ': ' if len(runs) > 1 else ''}AUC {area:.4f}")
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=1, label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", xlim=(0, 1),
           ylim=(0, 1), title=f"ROC on the {runs[0].split} split")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def draw_calibration(r: RunReport, out: Path) -> Path:
    plt = _plt()
    cal = calibration(r.probs, r.labels)
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(6, 7), height_ratios=[2, 1],
                                   constrained_layout=True, sharex=True)
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=1, label="perfectly calibrated")
    ax.plot(cal["predicted"], cal["observed"], "o-", lw=2, color="C0",
            label=f"model (ECE {cal['ece']:.4f})")
    ax.set(ylabel="observed positive rate", ylim=(0, 1),
           title=f"calibration on the {r.split} split ({BINS} equal-count bins)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    edges = np.linspace(0, 1, 41)
    pos = r.labels > 0.5
    hist.hist(r.probs[~pos], bins=edges, alpha=0.6, color="C1", label="negatives")
    hist.hist(r.probs[pos], bins=edges, alpha=0.6, color="C0", label="positives")
    hist.set(xlabel="predicted probability", ylabel="rows", xlim=(0, 1))
    hist.legend(fontsize=8)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _table(head: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}" if abs(v) < 1e4 else f"{v:,.0f}"
        return html.escape(str(v))

    return ("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>"
                      for row in rows) + "</table>")


def _metrics_rows(runs: list[RunReport]) -> tuple[list[str], list[list[Any]]]:
    """One row per run: every metric any of the runs has on its split, each with its 95 %
    interval in brackets where one was taken."""
    keys = metric_names(r.metrics for r in runs)
    head = ["run", *map(metric_label, keys), "rows", "steps (best)"]
    rows = []
    for r in runs:
        m = r.metrics
        cells: list[Any] = []
        for k in keys:
            v, ci = m.get(k), r.intervals.get(k)
            cells.append("-" if v is None else f"{v:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]" if ci
                         else v)
        rows.append([r.name, *cells, f"{int(m.get('rows', 0)):,}",
                     f"{r.results.get('steps', '?')} ({r.results.get('best_step', '?')})"])
    return head, rows


def _intervals_note(runs: list[RunReport], resamples: int) -> str:
    """What the brackets of the metric table are, for the kinds of runs in it."""
    kinds = {r.kind for r in runs}
    ranked = bool(kinds & {"retrieval", "next_item"})
    said = []
    if any(r.intervals for r in runs):
        over = [w for w, there in (("of the split's rows for the AUC", "binary" in kinds),
                                   ("of its users for a two-tower or next-item run's "
                                    "ranking metrics", ranked)) if there]
        said.append("In brackets: the 95 % interval (the 2.5 and 97.5 percentiles over "
                    f"{resamples} bootstrap resamples {', '.join(over)}).")
    if ranked:
        said.append("Ranking metrics are means over the queries (users with a positive "
                    "in the split); the curves show the popularity baseline of the one "
                    "early stopping followed.")
    return f"<p>{' '.join(said)}</p>" if said else ""


@dataclass
class Report:
    """A written report: its page, the runs drawn on it (a study's defaults and best trial
    among them) and its studies."""

    page: Path
    runs: list[RunReport]
    studies: list[Any]  # sampan.tune.plots.StudySection

    @property
    def notes(self) -> list[str]:
        """What a reader must know before trusting a picture (also on the page)."""
        return [n for s in self.studies for n in s.notes]

    def describe(self) -> str:
        """``study tiny (5 completed and 1 pruned trials), 2 runs``: what the page shows
        (a study's runs are its defaults and its best trial)."""
        parts = [f"study {s.name} ({s.complete} completed and {s.pruned} pruned trials)"
                 for s in self.studies]
        n = len(self.runs)
        return ", ".join([*parts, f"{n} run{'s' * (n != 1)}"])


def write_report(paths: list[str | Path], out: str | Path, split: str = "test",
                 resamples: int = 500, refresh: float | None = None) -> Path:
    """Write ``out/index.html`` and its PNGs for the runs at ``paths``; returns the page
    (:func:`build_report` returns what it holds too)."""
    return build_report(paths, out, split, resamples, refresh).page


def build_report(paths: list[str | Path], out: str | Path, split: str = "test",
                 resamples: int = 500, refresh: float | None = None) -> Report:
    """Write ``out/index.html`` and its PNGs for the runs at ``paths``. A ``sampan tune``
    study folder among them adds its study section, and its defaults and best runs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    studies, run_paths = [], []
    for p in paths:
        from sampan.tune.plots import is_study, study_section

        if is_study(p):
            section = study_section(Path(p), out, _plt(), _table)
            studies.append(section)
            run_paths += section.runs
        else:
            run_paths.append(p)
    runs = [load_run(p, split, resamples) for p in run_paths]
    names = [r.name for r in runs]
    for r in runs:  # distinct names for the legends and file names
        if names.count(r.name) > 1:
            r.name = f"{r.path.parent.name}/{r.name}"
    head, rows = _metrics_rows(runs)
    parts = [f"<h1>Sampan report: {html.escape(', '.join(Path(p).name or str(p) for p in paths))}"
             "</h1>",
             *(s.html for s in studies),
             f"<h2>Metrics on the {html.escape(split)} split</h2>", _table(head, rows),
             _intervals_note(runs, resamples)]
    if len(runs) > 1:
        draw_curves(runs, out / "compare_curves.png")
        parts.append('<h2>Curves together</h2><img src="compare_curves.png">')
        if any(r.probs is not None for r in runs):
            draw_roc(runs, out / "compare_roc.png")
            parts.append('<img src="compare_roc.png">')
    for i, r in enumerate(runs):
        tag = f"run{i}_" if len(runs) > 1 else ""
        parts.append(f"<h2>{html.escape(r.name)}</h2><p>{html.escape(str(r.path))}</p>")
        parts += [f"<p><b>note</b>: {html.escape(n)}</p>" for n in r.results.get("notes", [])]
        draw_curves([r], out / f"{tag}curves.png")
        parts.append(f'<img src="{tag}curves.png">')
        if r.probs is not None:
            draw_roc([r], out / f"{tag}roc.png")
            draw_calibration(r, out / f"{tag}calibration.png")
            parts.append(f'<img src="{tag}roc.png"><img src="{tag}calibration.png">')
        feats = r.data.get("features") or []
        if feats:
            from sampan.data.store import unseen_share

            parts.append("<h3>Features</h3>" + _table(
                ["feature", "kind", "transform", "ids", "OOV / missing share"],
                [[f.get("feature"), f.get("kind"), f.get("transform", ""),
                  f.get("ids", "-"), unseen_share(f)] for f in feats]))
        rej = r.data.get("rejects") or {}
        if rej:
            reasons = ", ".join(f"{k}: {v:,}" for k, v in (rej.get("reasons") or {}).items())
            parts.append(f"<h3>Rows</h3><p>read {rej.get('read', 0):,}, kept "
                         f"{rej.get('kept', 0):,}, rejected {rej.get('rejected', 0):,}"
                         f"{' (' + html.escape(reasons) + ')' if reasons else ''}</p>")
    style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
             "padding:4px 8px;text-align:right}th{background:#f4f4f4}img{max-width:100%;"
             "margin:0.5em 0}")
    page = out / "index.html"
    reload = f"<meta http-equiv='refresh' content='{refresh:g}'>" if refresh else ""
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'>{reload}<title>Sampan "
                    f"report</title><style>{style}</style></head><body>{''.join(parts)}"
                    "</body></html>")
    return Report(page=page, runs=runs, studies=studies)
