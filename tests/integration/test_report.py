"""`sampan report`: the page and pictures of one run and of two together, and the numbers
drawn checked against plain Python; a retrieval and a next-item run's ranking metrics; a
study's counts, axes, colour scale and importances."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from rich.console import Console

from sampan.config import load_config
from sampan.report import calibration, load_run, roc_curve, write_report
from sampan.train.experiment import RunArtifacts, run_experiment
from tests.conftest import tiny_config
from tests.integration.test_cli import sampan_here

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    out = []
    for name, seed in (("a", 0), ("b", 1)):
        cfg = tiny_config(root, rows=4000, epochs=3)
        cfg["seed"] = seed
        run_experiment(load_config(raw=cfg), run_dir=root / name, console=Console(quiet=True))
        out.append(root / name)
    return out


def test_one_run_and_two_together(runs, tmp_path):
    r = sampan_here("report", *map(str, runs), "--out", str(tmp_path / "rep"),
                    "--resamples", "200")
    assert r.returncode == 0, r.stderr
    files = {p.name for p in (tmp_path / "rep").iterdir()}
    assert files == {"index.html", "compare_curves.png", "compare_roc.png",
                     *(f"run{i}_{k}.png" for i in (0, 1) for k in ("curves", "roc",
                                                                     "calibration"))}
    for f in files - {"index.html"}:
        data = (tmp_path / "rep" / f).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, f
    page = (tmp_path / "rep" / "index.html").read_text()
    for run in runs:
        auc = json.loads((run / "results.json").read_text())["test"]["auc"]
        assert f"{auc:.4f}" in page
    assert "OOV / missing share" in page
    # each feature's share as the console shows it: a number's missing share too
    feats = json.loads((runs[0] / "data" / "manifest.json").read_text())["features"]
    numeric = next(f for f in feats if "missing_share" in f)
    assert f"<td>{100 * numeric['missing_share']:.1f}%</td>" in page and "None" not in page
    for r in (load_run(run, resamples=200) for run in runs):  # the AUC's interval
        lo, hi = r.auc_ci95
        assert f"{r.metrics['auc']:.4f} [{lo:.4f}, {hi:.4f}]" in page


def test_the_drawn_numbers(runs):
    rep = load_run(runs[0], resamples=200)
    auc = json.loads((runs[0] / "results.json").read_text())["test"]["auc"]
    fpr, tpr, area = roc_curve(rep.probs, rep.labels)
    assert area == pytest.approx(auc, abs=1e-6)
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1
    assert rep.auc_ci95[0] < auc < rep.auc_ci95[1]
    # equal-count bins, in plain Python
    pairs = sorted(zip(rep.probs.tolist(), rep.labels.tolist(), strict=True),
                   key=lambda t: t[0])
    n = len(pairs)
    sizes = [n // 10 + (i < n % 10) for i in range(10)]  # the first n % 10 one row more
    got = calibration(rep.probs, rep.labels)
    start = 0
    ece = 0.0
    for i, size in enumerate(sizes):
        part = pairs[start:start + size]
        start += size
        pred = sum(p for p, _ in part) / size
        obs = sum(y > 0.5 for _, y in part) / size
        assert got["predicted"][i] == pytest.approx(pred)
        assert got["observed"][i] == pytest.approx(obs)
        ece += abs(obs - pred) * size / n
    assert got["ece"] == pytest.approx(ece)
    # a tiny case by hand: scores 0.1 0.4 0.35 0.8, labels 0 0 1 1 -> AUC 0.75
    fpr, tpr, area = roc_curve(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1.0]))
    assert area == 0.75 and fpr.tolist() == [0, 0, 0.5, 0.5, 1] and tpr.tolist() == [
        0, 0.5, 0.5, 1, 1]


def test_norms_are_logged_and_a_run_still_training_is_drawn(runs, tmp_path):
    import shutil

    import torch

    from sampan.report import write_report

    train = [json.loads(x) for x in (runs[0] / "metrics.jsonl").read_text().splitlines()
             if '"train"' in x]
    assert train and all("grad_norm" in t and "embedding_norm/features.embedding" in t
                         for t in train)
    # the last record's embedding norm is that of the final weights (last.pt), taken again
    from sampan.train import checkpoint as ckpt

    last = ckpt.load(runs[0] / "checkpoints" / "last.pt")
    assert last["state"]["step"] == train[-1]["step"]
    w = last["model"]["features.embedding.weight"]
    rows = torch.linspace(0, len(w) - 1, min(len(w), 4096)).long()
    assert train[-1]["embedding_norm/features.embedding"] == pytest.approx(
        float(w[rows].norm(dim=1).mean()), rel=1e-5)
    assert all(0 < t["grad_norm"] < 100 for t in train)
    # a run still training (no results.json yet): its curves, and a page that reloads itself
    live = tmp_path / "live"
    shutil.copytree(runs[1], live)
    (live / "results.json").unlink()
    page = write_report([live], tmp_path / "rep", refresh=5)
    html = page.read_text()
    assert "http-equiv='refresh' content='5'" in html
    assert (tmp_path / "rep" / "curves.png").exists()
    assert not (tmp_path / "rep" / "roc.png").exists()


def test_a_runs_notes_are_on_its_page(runs, tmp_path):
    import shutil

    from sampan.report import write_report

    run = shutil.copytree(runs[0], tmp_path / "noted")
    res = json.loads((run / "results.json").read_text())
    res["notes"] = ["probabilities <over-confident>"]
    (run / "results.json").write_text(json.dumps(res))
    page = write_report([run], tmp_path / "rep", resamples=50).read_text()
    assert "<b>note</b>: probabilities &lt;over-confident&gt;" in page


# ---------------------------------------------------------------- ranking runs and studies
@pytest.fixture
def figures(monkeypatch):
    """Every figure the report saves, by file name: what it drew, looked at."""
    from matplotlib.figure import Figure

    saved = {}
    real = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        saved[Path(fname).name] = self
        return real(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _panel(fig, title):
    titles = [ax.get_title() for ax in fig.axes]
    assert title in titles, titles
    return fig.axes[titles.index(title)]


def _valid(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
            if '"valid"' in x]


@pytest.fixture(scope="module")
def ranking_runs(tmp_path_factory):
    """A two-tower run (Recall/NDCG/HitRate@10, MRR) and a SASRec run (HitRate/NDCG@5,10,
    20, MRR), a few seconds each."""
    import pyarrow.parquet as pq

    from sampan.data.behaviour import BuildOptions, build_sequences
    from sampan.data.synthetic import interaction_samples
    from tests.integration.test_learning import TRAIN, markov_lines
    from tests.integration.test_next_item import sasrec_raw

    root = tmp_path_factory.mktemp("ranking")
    clicks = root / "clicks.parquet"
    pq.write_table(interaction_samples(users=200, items=300, per_user=10, seed=0), clicks)
    samples = root / "samples.parquet"
    build_sequences(str(markov_lines(root / "seq.txt", users=300)), samples,
                    BuildOptions(format="sequence_lines", max_len=10))
    raws = {"two_tower": {
        "data": {"train": str(clicks),
                 "split": {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}},
        "features": {"group": "user_id", "categorical": ["user_id", "item_id"]},
        "model": {"name": "two_tower", "item_features": ["item_id"], "embedding_dim": 8,
                  "k": 10},
        "train": {**TRAIN, "epochs": 2, "batch_size": 128}}, "sasrec": sasrec_raw(samples)}
    for name, raw in raws.items():
        run_experiment(load_config(raw={"output_dir": str(root), **raw}),
                       run_dir=root / name, console=Console(quiet=True))
    return {name: root / name for name in raws}


def test_a_retrieval_run_draws_and_tabulates_the_metrics_it_logged(ranking_runs, figures,
                                                                    tmp_path):
    run = ranking_runs["two_tower"]
    evals, test = _valid(run), json.loads((run / "results.json").read_text())["test"]
    page = write_report([run], tmp_path / "rep", resamples=50).read_text()
    fig = figures["curves.png"]
    # the metric early stopping followed (Recall@K for a two-tower model), its best marked,
    # and the popularity baseline it is judged against
    ax = _panel(fig, "validation Recall@10")
    assert ax.lines[0].get_ydata().tolist() == [e["recall@10"] for e in evals]
    assert [t.get_text() for t in ax.texts] == []  # not "not logged by this run"
    best = json.loads((run / "results.json").read_text())["best_step"]
    assert [ln.get_xdata()[0] for ln in ax.lines if ln.get_marker() == "*"] == [best]
    pop = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert len(pop) == 1 and pop[0].get_ydata()[0] == evals[-1]["pop_recall@10"]
    drawn = {ln.get_label(): ln.get_ydata().tolist()
             for ln in _panel(fig, "other validation metrics").lines}
    assert drawn == {"NDCG@10": [e["ndcg@10"] for e in evals],
                     "HitRate@10": [e["hitrate@10"] for e in evals],
                     "MRR": [e["mrr"] for e in evals]}
    # the table: its metrics, nothing of AUC (no interval column left empty), no ROC
    # each ranking metric with its interval over the users, as `sampan eval` gives it
    m = RunArtifacts(run).evaluate("test", bootstrap=50)
    for key, head in (("recall@10", "Recall@10"), ("ndcg@10", "NDCG@10"),
                      ("hitrate@10", "HitRate@10"), ("mrr", "MRR")):
        lo, hi = m[f"{key}_ci95"]
        assert lo <= test[key] <= hi and lo < hi
        assert f"<th>{head}</th>" in page
        assert f"<td>{test[key]:.4f} [{lo:.4f}, {hi:.4f}]</td>" in page
    assert "AUC" not in page and "users for a two-tower or next-item run" in page
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["curves.png",
                                                                    "index.html"]


def test_a_next_item_run_has_intervals_over_its_users_and_no_roc(ranking_runs, figures,
                                                                 tmp_path):
    run = ranking_runs["sasrec"]
    evals, test = _valid(run), json.loads((run / "results.json").read_text())["test"]
    page = write_report([run], tmp_path / "rep", resamples=400).read_text()
    # every row of a next-item split is a positive: a ROC of it was a vertical line at 0
    assert not (tmp_path / "rep" / "roc.png").exists()
    assert "<th>NDCG@10</th>" in page and "AUC" not in page
    rep = load_run(run, resamples=400)
    assert rep.kind == "next_item" and rep.probs is None and rep.auc_ci95 is None
    lo, hi = rep.intervals["ndcg@10"]
    assert f"<td>{test['ndcg@10']:.4f} [{lo:.4f}, {hi:.4f}]</td>" in page
    assert "resamples of its users" in page
    metrics = ["ndcg@5", "ndcg@10", "ndcg@20", "hitrate@5", "hitrate@10", "hitrate@20",
               "mrr"]
    assert sorted(rep.intervals) == sorted(metrics)
    n = test["queries"]
    for k in metrics:
        lo, hi = rep.intervals[k]
        assert lo <= test[k] <= hi
    for k in ("hitrate@5", "hitrate@10", "hitrate@20"):  # a share of n users: its normal
        p = test[k]                                        # interval is 2 x 1.96 SE wide
        lo, hi = rep.intervals[k]
        assert hi - lo == pytest.approx(2 * 1.96 * (p * (1 - p) / n) ** 0.5, rel=0.25)
    fig = figures["curves.png"]
    ax = _panel(fig, "validation NDCG@10")  # a next-item model's early-stopping metric
    assert ax.lines[0].get_ydata().tolist() == [e["ndcg@10"] for e in evals]
    others = {ln.get_label() for ln in _panel(fig, "other validation metrics").lines}
    assert others == {"NDCG@5", "NDCG@20", "HitRate@5", "HitRate@10", "HitRate@20", "MRR"}


def test_the_metric_early_stopping_followed_is_the_one_drawn_with_its_best(runs, figures,
                                                                          tmp_path):
    """The tiny runs stop on LogLoss (their validation split is too small for AUC): the
    star of the best step was drawn on the AUC curve."""
    evals = _valid(runs[0])
    hits = [e for e in evals if e["best_step"] == e["step"]]
    metric = "logloss" if all(e["best"] == e["logloss"] for e in hits) else "auc"
    write_report([runs[0]], tmp_path / "rep", resamples=0)
    fig = figures["curves.png"]
    name = {"auc": "AUC", "logloss": "LogLoss"}
    ax = _panel(fig, f"validation {name[metric]}")
    assert ax.lines[0].get_ydata().tolist() == [e[metric] for e in evals]
    assert [ln.get_xdata()[0] for ln in ax.lines if ln.get_marker() == "*"] == [
        json.loads((runs[0] / "results.json").read_text())["best_step"]]
    other = "auc" if metric == "logloss" else "logloss"
    assert _panel(fig, f"validation {name[other]}").lines[0].get_ydata().tolist() == [
        e[other] for e in evals]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """`sampan tune` for real: three trials of two parameters, no pruning (seconds)."""
    pytest.importorskip("optuna")
    root = tmp_path_factory.mktemp("study")
    raw = tiny_config(root, rows=2000, epochs=2)
    raw["tune"] = {"trials": 3, "pruner": "none", "seed": 0, "space": {
        "train.lr": {"low": 1.0e-3, "high": 2.0e-2, "log": True},
        "model.dropout": {"low": 0.0, "high": 0.5}}}
    (root / "exp.yaml").write_text(yaml.safe_dump(raw))
    r = sampan_here("tune", str(root / "exp.yaml"), "--out", str(root / "study"))
    assert r.returncode == 0, r.stdout + r.stderr
    return root / "study"


def test_a_study_report_counts_its_runs_and_draws_honest_axes(study, figures, tmp_path):
    import optuna
    from typer.testing import CliRunner

    from sampan.cli import app

    r = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["report", str(study), "--out", str(tmp_path / "rep"), "--resamples", "50"],
        catch_exceptions=False)
    assert r.exit_code == 0, r.stdout
    said = " ".join(r.stdout.split())
    # one folder given; drawn: the study, its defaults run and its best trial's run
    assert "(study tiny (3 completed and 0 pruned trials), 2 runs; open it" in said
    assert {"run0_curves.png", "run1_curves.png"} <= {p.name for p in (tmp_path / "rep")
                                                      .iterdir()}
    # three trials are too few for importances: not drawn, and said so on both
    note = "parameter importance not drawn: 3 completed trials"
    page = (tmp_path / "rep" / "index.html").read_text()
    assert f"note: {note}" in said and note in page
    assert "study_importance.png" not in page
    assert not (tmp_path / "rep" / "study_importance.png").exists()
    values = [t.value for t in optuna.load_study(
        study_name="tiny", storage=f"sqlite:///{study / 'study.db'}").trials]
    # trial numbers on whole ticks
    ax = figures["study_history.png"].axes[0]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks == [0.0, 1.0, 2.0]
    # the parallel coordinates' colours have their scale, named by the objective
    fig = figures["study_parallel.png"]
    bar = [a for a in fig.axes if a.get_ylabel() == "valid auc"]
    assert len(bar) == 1 and bar[0].get_ylim() == pytest.approx((min(values), max(values)))


def test_importances_from_ten_completed_trials_are_fanova_shares(figures, tmp_path):
    optuna = pytest.importorskip("optuna")
    from sampan.report import _plt
    from sampan.tune import plots

    def objective(t):  # x: 0.302 of the variance, y: 0.021, z: none -> x 0.94 of it
        x, y, _ = (t.suggest_float(n, 0, 1) for n in "xyz")
        return 4 * (x - 0.3) ** 2 + 0.5 * y

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(objective, n_trials=9)
    assert plots.draw_importance(study, tmp_path / "few.png", _plt()) is None
    assert plots.MIN_IMPORTANCE_TRIALS == 10
    assert "not drawn: 9 completed trials" in plots.importance_note(study)
    study.optimize(objective, n_trials=21)
    assert plots.importance_note(study) is None
    assert plots.draw_importance(study, tmp_path / "imp.png", _plt()) == tmp_path / "imp.png"
    ax = figures["imp.png"].axes[0]
    shares = dict(zip([t.get_text() for t in ax.get_yticklabels()],
                      [p.get_width() for p in ax.patches], strict=True))
    assert shares["x"] == pytest.approx(0.94, abs=0.06) and shares["z"] < 0.05
    assert ax.get_title() == "parameter importance (30 completed trials)"
