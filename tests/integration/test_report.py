"""`sampan report`: the page and pictures of one run and of two together, and the numbers
drawn checked against plain Python."""

import json
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from sampan.config import load_config
from sampan.report import calibration, load_run, roc_curve
from sampan.train.experiment import run_experiment
from tests.conftest import tiny_config

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
    r = subprocess.run([sys.executable, "-m", "sampan.cli", "report", *map(str, runs),
                        "--out", str(tmp_path / "rep"), "--resamples", "200"],
                       capture_output=True, text=True)
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
    assert "AUC 95 % interval" in page and "OOV / missing share" in page


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
