"""``sampan tune`` for real: Optuna's SQLite storage, two worker processes, a kill of the
whole study half-way and its resume, the summary, best.yaml and the study's report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sampan.config import load_config
from sampan.train.experiment import run_experiment
from tests.conftest import tiny_config

optuna = pytest.importorskip("optuna")


def test_a_stop_reason_ends_training_at_that_validation(tmp_path):
    asked = []

    def should_stop(step, epochs, metrics):
        asked.append((step, epochs, "auc" in metrics))
        return "pruned"

    cfg = load_config(raw=tiny_config(tmp_path, rows=2000, epochs=3))
    res = run_experiment(cfg, tmp_path / "run", should_stop=should_stop)
    assert res["stopped_by"] == "pruned" and res["stopped_early"]
    assert len(asked) == 1 and asked[0][1] == pytest.approx(1.0) and asked[0][2]
    assert res["steps"] == asked[0][0] and "auc" in res["test"]


def _study(folder: Path) -> dict[str, int]:
    url = f"sqlite:///{folder / 'study.db'}"
    if not (folder / "study.json").exists():  # written once the study is made
        return {}
    try:
        trials = optuna.load_study(study_name="tiny", storage=url).get_trials(deepcopy=False)
    except Exception:  # noqa: BLE001 - not created yet, or the database is busy
        return {}
    out: dict[str, int] = {}
    for t in trials:
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def _tune_processes(folder: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if " tune " in cmd and str(folder) in cmd:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_a_killed_study_resumes_to_its_budget(tmp_path):
    raw = tiny_config(tmp_path, rows=2500, epochs=2)
    raw["tune"] = {"trials": 6, "startup_trials": 2, "space": {
        "train.lr": {"low": 1.0e-3, "high": 2.0e-2, "log": True},
        "model.mlp": {"choices": [[8], [16]]}}}
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(raw))
    folder = tmp_path / "study"
    cmd = [sys.executable, "-m", "sampan", "tune", str(config), "--out", str(folder),
           "--workers", "2"]
    main = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own group: kill -9 the whole job
    deadline = time.time() + 120
    while time.time() < deadline and main.poll() is None:
        s = _study(folder)
        if s.get("COMPLETE", 0) + s.get("PRUNED", 0) >= 2 and s.get("RUNNING", 0):
            break
        time.sleep(0.2)
    assert main.poll() is None, main.stdout.read().decode()
    os.killpg(main.pid, signal.SIGKILL)  # the command and its workers, mid-trial
    main.wait()
    while _tune_processes(folder) and time.time() < deadline:
        time.sleep(0.2)
    assert not _tune_processes(folder)
    killed = _study(folder)
    assert killed.get("RUNNING", 0) >= 1
    assert killed.get("COMPLETE", 0) + killed.get("PRUNED", 0) < 6

    # resumed by one process (the workers' own loop, in the command's process)
    done = subprocess.run([*cmd[:-1], "1"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is gone; its values are queued again" in done.stdout
    final = _study(folder)
    assert final.get("COMPLETE", 0) + final.get("PRUNED", 0) == 6, final
    assert final.get("RUNNING", 0) == 0 and final.get("FAIL", 0) == killed["RUNNING"]

    summary = json.loads((folder / "summary.json").read_text())
    best = summary["best"]
    assert Path(best["run_dir"], "results.json").is_file()
    assert summary["defaults"]["test"]["auc"] > 0.5 and len(best["test"]["auc_ci95"]) == 2
    lo, hi = summary["best_vs_defaults"]["diff_ci95"]
    assert lo <= summary["best_vs_defaults"]["diff"] <= hi
    cfg = load_config(folder / "best.yaml")
    assert cfg.tune is None and cfg.train.lr == pytest.approx(best["params"]["train.lr"])
    # a finished trial's data is the defaults' own, linked (same data and features
    # sections); the last one started after the defaults had theirs
    finished = [t for t in optuna.load_study(
        study_name="tiny", storage=f"sqlite:///{folder / 'study.db'}").trials
        if t.state.name in ("COMPLETE", "PRUNED")]
    dirs = [folder / t.user_attrs["run_dir"] for t in finished]
    assert all((d / "data" / "manifest.json").is_file() for d in dirs)
    assert os.stat(dirs[-1] / "data" / "manifest.json").st_ino == os.stat(
        folder / "defaults" / "data" / "manifest.json").st_ino

    from tests.integration.test_cli import sampan_here

    report = sampan_here("report", str(folder), "--out", str(tmp_path / "report"),
                         "--resamples", "50")
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report" / "index.html").read_text()
    for png in ("study_history.png", "study_curves.png", "study_parallel.png"):
        assert (tmp_path / "report" / png).stat().st_size > 5000 and png in page
    assert "Study tiny" in page and "defaults" in page


def test_a_database_made_by_another_process_at_the_same_moment_is_used(tmp_path, monkeypatch):
    # two processes opening a new study database at once both write its schema; the one
    # that loses gets an IntegrityError (seen in CI: the schema version row) and then
    # finds the tables made
    import optuna
    from sqlalchemy.exc import IntegrityError

    from sampan.config import TuneConfig
    from sampan.tune.study import TuneJob

    url = f"sqlite:///{tmp_path / 'study.db'}"
    real = optuna.storages.RDBStorage
    calls = []

    class Racing(real):
        def __init__(self, *args, **kwargs):
            calls.append(args)
            if len(calls) == 1:  # the other process wins the race
                real(url)
                raise IntegrityError("INSERT INTO alembic_version", {}, Exception("UNIQUE"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", Racing)
    job = TuneJob(config=tmp_path / "x.yaml", overrides=[], folder=tmp_path,
                  tune=TuneConfig.model_construct(), name="s", storage_url=url, metric="auc",
                  direction="maximize", budget=1)
    study = optuna.create_study(study_name="s", storage=job.storage())
    assert len(calls) == 2 and study.study_name == "s"
