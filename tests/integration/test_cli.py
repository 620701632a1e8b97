"""The CLI as a user runs it: train on the built-in data, evaluate, predict, resume after a
kill, and fail clearly on a bad config."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from tests.conftest import tiny_config

SAMPAN = [sys.executable, "-m", "sampan"]
ENV = {**os.environ, "COLUMNS": "120"}


def sampan(*args, check=True, timeout=300):
    r = subprocess.run([*SAMPAN, *args], capture_output=True, text=True, timeout=timeout,
                       env=ENV)
    if check and r.returncode != 0:
        raise AssertionError(f"sampan {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def sampan_here(*args, check=False):
    """``sampan ARGS`` in this process (no interpreter start, for commands whose process
    itself is not under test); the same handler, exit code and streams as the command
    line. ``check``: fail the test on a non-zero exit."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from sampan.cli import app

    r = CliRunner(env={"COLUMNS": "120"}).invoke(app, list(args), catch_exceptions=False)
    if check and r.exit_code != 0:
        raise AssertionError(f"sampan {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return SimpleNamespace(returncode=r.exit_code, stdout=r.stdout, stderr=r.stderr)


def write_cfg(tmp_path, cfg):
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_train_prints_test_auc_next_to_oracle_then_eval_and_predict(tmp_path):
    cfg = write_cfg(tmp_path, tiny_config(tmp_path, rows=4000))
    run = tmp_path / "run"
    r = sampan("train", str(cfg), "--run-dir", str(run))
    assert "oracle AUC" in r.stdout
    # written to a pipe, a line longer than the terminal's 120 columns stays one line
    assert max(len(x) for x in r.stdout.splitlines() if x.startswith("schedule:")) > 120
    results = json.loads((run / "results.json").read_text())
    test = results["test"]
    assert 0.5 < test["auc"] <= test["oracle_auc"] + 0.02
    assert test["rows"] == 400
    for f in ("config.yaml", "metrics.jsonl", "checkpoints/last.pt", "checkpoints/best.pt",
              "data/manifest.json", "data/pipeline/pipeline.json"):
        assert (run / f).exists(), f
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"train", "valid"} <= {x["split"] for x in records}

    # eval on the stored test split reproduces the training run's number
    r = sampan_here("eval", str(run), check=True)
    assert json.loads(r.stdout)["auc"] == pytest.approx(test["auc"], abs=1e-6)
    # --bootstrap adds the AUC's 95 % interval over resampled test rows; its width agrees
    # with the Hanley-McNeil standard error of an AUC on this many positives / negatives
    lo, hi = json.loads(sampan_here("eval", str(run), "--bootstrap", "400",
                                    check=True).stdout)["auc_ci95"]
    a, p = test["auc"], round(test["ctr"] * test["rows"])
    q = test["rows"] - p
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = ((a * (1 - a) + (p - 1) * (q1 - a * a) + (q - 1) * (q2 - a * a)) / (p * q)) ** 0.5
    assert lo < a < hi
    assert 0.7 * 3.92 * se < hi - lo < 1.3 * 3.92 * se

    # predict from raw rows: write the test rows' raw form as a headerless Criteo TSV
    from sampan.config import SyntheticConfig
    from sampan.data.synthetic import iter_synthetic

    t = next(iter_synthetic(SyntheticConfig(rows=50, seed=99)))
    raw = tmp_path / "new.tsv"
    cols = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    with open(raw, "w") as f:
        for row in zip(*[t.column(c).to_pylist() for c in cols], strict=True):
            vals = ["" if v is None else (str(int(v)) if isinstance(v, float) else v)
                    for v in row]
            f.write("\t".join(vals) + "\n")
    out = tmp_path / "pred.csv"
    sampan_here("predict", str(run), str(raw), "--out", str(out), check=True)
    pred = np.genfromtxt(out, delimiter=",", names=True)
    assert len(pred) == 50
    assert pred["line"].tolist() == list(range(1, 51))
    assert ((pred["probability"] > 0) & (pred["probability"] < 1)).all()
    # the file scored in many small chunks gives the same lines and probabilities
    from sampan.train.experiment import RunArtifacts

    art = RunArtifacts(run)
    art.cfg = art.cfg.model_copy(update={"data": art.cfg.data.model_copy(
        update={"block_size": 512})})
    chunks = list(art.predict_chunks(str(raw)))
    assert len(chunks) > 3
    np.testing.assert_array_equal(np.concatenate([c[0] for c in chunks]), pred["line"])
    np.testing.assert_allclose(np.concatenate([c[1] for c in chunks])[:, 0],
                               pred["probability"], atol=1e-8)
    # too many bad rows: the command fails and leaves no output behind
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join("1\tnot-a-number\n" for _ in range(5)))
    r = sampan_here("predict", str(run), str(bad), "--out", str(tmp_path / "bad.csv"))
    assert r.returncode != 0 and "rejected" in (r.stdout + r.stderr).lower()
    assert not (tmp_path / "bad.csv").exists() and not list(tmp_path.glob(".bad.csv*"))
    # the same rows evaluated through `eval --data` give the AUC of those probabilities
    from sklearn.metrics import roc_auc_score

    r = sampan_here("eval", str(run), "--data", str(raw), check=True)
    labels = np.array(t.column("label").to_pylist())
    assert json.loads(r.stdout)["auc"] == pytest.approx(
        roc_auc_score(labels, pred["probability"]), abs=1e-6)


def test_misspelt_key_fails_with_nearest_key_and_exit_code_2(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg["train"]["learning_rate"] = 0.1
    r = sampan_here("train", str(write_cfg(tmp_path, cfg)))
    assert r.returncode == 2
    assert "learning_rate" in r.stderr and "valid keys" in r.stderr
    assert "did you mean 'lr'" in r.stderr  # another framework's name for it
    r = sampan_here("train", "--set", "train.epoch=3")
    assert r.returncode == 2 and "did you mean 'epochs'" in r.stderr


def test_a_missing_data_file_says_where_it_looked_and_leaves_no_run_behind(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg["data"] = {"train": "ratings.csv", "joins": [{"path": "users.csv", "by": "u"}]}
    cfg["features"] = {"label": "y", "categorical": ["u"]}
    r = sampan_here("train", str(write_cfg(tmp_path, cfg)))
    assert r.returncode == 2
    assert "data file 'ratings.csv' does not exist (relative to the current directory " \
        f"{os.getcwd()})" in r.stderr
    assert not (tmp_path / "runs").exists()
    # a folder of runs is not a run: the error names the runs in it
    (tmp_path / "runs" / "tiny" / "20261206-101010").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / "20261206-101010" / "config.yaml").write_text("{}")
    r = sampan_here("export", str(tmp_path / "runs" / "tiny"), "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "the runs under it, newest first: " \
        f"{tmp_path / 'runs' / 'tiny' / '20261206-101010'}" in r.stderr


def test_help_is_there_for_every_command():
    for cmd in ("train", "eval", "predict", "models", "tune", "report"):
        r = sampan_here(cmd, "--help")
        assert r.returncode == 0 and "Usage" in r.stdout
    assert "deepfm" in sampan("models").stdout  # and once from a real process


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_final_metrics(tmp_path):
    cfg = tiny_config(tmp_path, rows=6000, checkpoint_every_steps=10, batch_size=64,
                      epochs=4)
    cfg["model"]["dropout"] = 0.1  # dropout consumes RNG: resuming must restore it
    cfg["train"]["early_stopping"] = {"patience": 10}
    path = write_cfg(tmp_path, cfg)

    straight = tmp_path / "straight"
    sampan("train", str(path), "--run-dir", str(straight))
    want = json.loads((straight / "results.json").read_text())

    run = tmp_path / "interrupted"
    proc = subprocess.Popen([*SAMPAN, "train", str(path), "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    last = run / "checkpoints" / "last.pt"
    deadline = time.time() + 240
    while not last.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert last.exists(), "no checkpoint was written before the deadline"
    assert not (run / "results.json").exists(), "the run finished before it could be killed"
    import torch

    step = torch.load(last, weights_only=True)["state"]["step"]
    assert 0 < step < want["steps"]

    r = sampan("train", "--resume", str(run))
    assert f"at step {step}" in r.stdout
    got = json.loads((run / "results.json").read_text())
    assert got["steps"] == want["steps"]
    assert got["best_step"] == want["best_step"]
    for split in ("valid", "test"):
        for k in ("auc", "logloss"):
            assert got[split][k] == pytest.approx(want[split][k], abs=1e-7), (split, k)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # records past the checkpoint were rewritten, not duplicated
    # a finished run has nothing to resume: said, with its results, and nothing is trained
    logged = (run / "metrics.jsonl").read_text()
    r = sampan_here("train", "--resume", str(run), check=True)
    assert f"has finished ({want['steps']} steps); nothing to resume" in " ".join(
        r.stdout.split()), r.stdout
    assert (run / "metrics.jsonl").read_text() == logged


def test_compare_two_runs_paired_bootstrap(tmp_path):
    """`sampan compare A B`: both AUCs and B - A on the same test rows, with an interval
    from resamples shared by the two models; a run against itself differs by exactly 0;
    runs on different rows are refused."""
    from rich.console import Console

    from sampan.config import load_config
    from sampan.train.experiment import run_experiment

    runs = {}
    for name, rows in (("lr", 6000), ("deepfm", 6000), ("other", 3000)):
        cfg = tiny_config(tmp_path, rows=rows)
        cfg["model"] = {"name": name} if name == "lr" else cfg["model"]
        runs[name] = tmp_path / name  # trained here: the commands under test are compare, eval
        run_experiment(load_config(raw=cfg), run_dir=runs[name], console=Console(quiet=True))
    test = {n: json.loads((runs[n] / "results.json").read_text())["test"] for n in runs}
    out = json.loads(sampan_here("compare", str(runs["lr"]), str(runs["deepfm"]),
                            "--resamples", "400").stdout)
    assert out["a"]["auc"] == pytest.approx(test["lr"]["auc"], abs=1e-6)
    assert out["b"]["auc"] == pytest.approx(test["deepfm"]["auc"], abs=1e-6)
    assert out["diff"] == pytest.approx(test["deepfm"]["auc"] - test["lr"]["auc"], abs=1e-6)
    lo, hi = out["diff_ci95"]
    assert lo < out["diff"] < hi and out["rows"] == 600 and 0 <= out["p_b_better"] <= 1
    # the paired interval is narrower than either AUC's own interval
    own = json.loads(sampan_here("eval", str(runs["lr"]), "--bootstrap", "400",
                                 check=True).stdout)["auc_ci95"]
    assert hi - lo < own[1] - own[0]
    same = json.loads(sampan_here("compare", str(runs["lr"]), str(runs["lr"]),
                             "--resamples", "200").stdout)
    assert same["diff"] == 0 and same["diff_ci95"] == [0.0, 0.0] and same["p_b_better"] == 0
    r = sampan_here("compare", str(runs["lr"]), str(runs["other"]))
    assert r.returncode == 2 and "do not hold the same rows" in r.stderr


@pytest.mark.parametrize("override,message", [
    ("name=../../x", "name: String should match pattern"),
    ("seed=-1", "seed: Input should be greater than or equal to 0"),
    (f"seed={2 ** 70}", "seed: Input should be less than 4294967296"),
    ("model.mlp=[0]", "model.mlp[0]: Input should be greater than 0"),
    ("train.device=gpu", "train.device: String should match pattern"),
])
def test_bad_values_are_one_line_errors_at_load_time(tmp_path, override, message):
    r = sampan_here("train", "--set", override, "--set", f"output_dir={tmp_path / 'runs'}")
    assert r.returncode == 2 and message in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr
    assert not any(tmp_path.parent.glob("x")) and not (tmp_path / "runs").exists()


def test_a_cuda_device_this_machine_lacks_is_a_one_line_error(tmp_path):
    import torch

    n = torch.cuda.device_count()
    r = sampan_here("train", "--set", f"train.device=cuda:{n + 7}", "--set",
                    f"output_dir={tmp_path}", "--set", "data.synthetic.rows=500")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    want = "CUDA is not available" if n == 0 else f"has {n} CUDA device(s)"
    assert want in " ".join(r.stderr.split())
    if n < 2:  # ... before any process is launched: once, not once a process
        r = sampan_here("train", "--nproc-per-node", "2", "--set", "train.device=cuda",
                        "--set", f"output_dir={tmp_path}", "--set", "data.synthetic.rows=500")
        assert r.returncode == 2 and "launching" not in r.stdout, r.stdout
        want = "CUDA is not available" if n == 0 else "2 processes on train.device='cuda'"
        assert want in " ".join(r.stderr.split()), r.stderr


def test_corrupt_truncated_or_empty_checkpoints_are_one_line_errors(tmp_path):
    """Issue 13: 16 flipped bytes in best.pt made `sampan eval` report another AUC with no
    warning; an empty last.pt printed "Aborted."; a truncated one a 50-line traceback."""
    path = write_cfg(tmp_path, tiny_config(tmp_path, rows=1500, epochs=1))
    run = tmp_path / "run"
    assert sampan_here("train", str(path), "--run-dir", str(run)).returncode == 0
    best, last = run / "checkpoints" / "best.pt", run / "checkpoints" / "last.pt"
    data = bytearray(best.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0x55
    best.write_bytes(bytes(data))
    r = sampan_here("eval", str(run))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "is corrupt" in " ".join(r.stderr.split()) and "best.pt" in r.stderr
    (run / "results.json").unlink()  # as if it was stopped before the end
    for content, message in ((b"", "is empty"), (last.read_bytes()[:5000], "no Sampan checksum")):
        last.write_bytes(content)
        r = sampan_here("train", "--resume", str(run))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert message in " ".join(r.stderr.split()) and "Aborted" not in r.stderr


def test_resume_of_a_run_still_training_is_refused(tmp_path):
    """Issue 13: the run directory is locked; both processes used to exit 0 and write
    duplicate records into metrics.jsonl. The lock goes with the process (kill -9 too)."""
    from sampan.train.rundir import is_training

    cfg = tiny_config(tmp_path, rows=20000, checkpoint_every_steps=5, batch_size=32,
                      epochs=30)
    path = write_cfg(tmp_path, cfg)
    run = tmp_path / "run"
    proc = subprocess.Popen([*SAMPAN, "train", str(path), "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    try:
        deadline = time.time() + 120
        while not (run / "checkpoints" / "last.pt").exists() and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        r = sampan_here("train", "--resume", str(run))  # flock: refused here as anywhere
        assert r.returncode == 2 and "is in use by process" in " ".join(r.stderr.split())
        assert "Traceback" not in r.stderr
        assert proc.poll() is None  # the first run goes on
        assert is_training(run)  # as sampan report --follow sees it
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    from sampan.train.experiment import lock_run

    assert not is_training(run) and (run / ".lock").is_file()  # the file stays, not its lock
    lock_run(run).close()  # released by the kill: the run can be resumed


def test_new_user_defects_of_issue_13(tmp_path):
    """`sampan models` lists options, `data inspect` reads the Parquet that
    `build-sequences` writes (list columns), `build-sequences` refuses a header-less file
    instead of taking its first event for names, and a dataset too small to split fails."""
    out = sampan_here("models").stdout
    flat = " ".join(out.split())
    assert "Every model takes embedding_dim=16" in flat
    assert "deepfm: DeepFM (Guo et al., 2017)" in flat and "``" not in out
    assert "cross_layers=3" in flat and "mlp=[256, 128]" in flat
    events = tmp_path / "events.csv"
    events.write_text("".join(f"u{i % 7},i{i % 13},{i}\n" for i in range(300)))
    r = sampan_here("data", "build-sequences", str(events), "--out",
                    str(tmp_path / "s.parquet"), "--category", "", "--action", "")
    assert r.returncode == 2 and "looks like data, not a header" in " ".join(r.stderr.split())
    r = sampan_here("data", "build-sequences", str(events), "--out",
                    str(tmp_path / "s.parquet"), "--category", "", "--action", "",
                    "--columns", "user_id,item_id,timestamp")
    assert "wrote 300 samples" in " ".join(r.stdout.split())
    r = sampan_here("data", "inspect", str(tmp_path / "s.parquet"))
    assert "hist_item_id" in r.stdout and "large_list" in r.stdout
    r = sampan_here("train", "--set", "data.synthetic.rows=1", "--set",
                    f"output_dir={tmp_path}")
    assert r.returncode == 2 and "came out empty" in " ".join(r.stderr.split()), r.stderr


def test_a_launch_whose_batch_cannot_feed_its_processes_fails_before_it_starts_them():
    r = sampan_here("train", "--nproc-per-node", "2", "--set", "train.batch_size=3")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "train.batch_size 3 (the global batch) must give each of the 2 processes two rows " \
        "or more: --set train.batch_size=4 or more" in " ".join(r.stderr.split())
    assert "launching" not in r.stdout and "Traceback" not in r.stderr
