"""`sampan experiment report` and `sampan experiment ope` as a user runs them: a feedback log
of synthetic traffic, a real exported bundle as the candidate."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from sampan.cli import app
from sampan.config import SyntheticConfig, load_config
from sampan.data.synthetic import iter_synthetic
from sampan.experiment.log import write_log
from sampan.export import export_run
from sampan.serving import Predictor
from sampan.train.experiment import run_experiment
from tests.conftest import tiny_config

K = 5  # items a request


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ope")
    run_experiment(load_config(raw=tiny_config(tmp, rows=3000, epochs=1)), run_dir=tmp / "run")
    return export_run(tmp / "run", tmp / "bundle")


def served_log(seed: int, requests: int) -> pa.Table:
    """Synthetic rows as served items: K a request, the first one picked uniformly at random
    (propensity 1/K), clicks drawn with the world's true probability."""
    rng = np.random.default_rng(seed)
    t = next(iter_synthetic(SyntheticConfig(rows=requests * K, seed=seed)))
    n = t.num_rows
    req = np.arange(n) // K
    first = rng.integers(0, K, requests)
    pos = np.where(np.arange(n) % K == first[req], 0, 1 + np.arange(n) % K)
    label = (rng.random(n) < t.column("oracle_p").to_numpy()).astype(np.int8)
    feats = t.drop_columns(["label", "oracle_p"])
    return feats.append_column("request_id", pa.array([f"r{i}" for i in req])) \
        .append_column("position", pa.array(pos, pa.int32())) \
        .append_column("unit", pa.array([f"u{i % 300}" for i in req])) \
        .append_column("variant", pa.array(np.where(req % 2 == 0, "control", "candidate"))) \
        .append_column("forced", pa.array(np.zeros(n, bool))) \
        .append_column("served_at", pa.array(1.7e9 + np.arange(n, dtype=np.float64))) \
        .append_column("score", pa.array(rng.random(n))) \
        .append_column("propensity", pa.array(np.full(n, 1.0 / K))) \
        .append_column("label", pa.array(label))


def test_ope_on_a_bundle_equals_the_estimate_worked_by_hand(tmp_path, bundle):
    log = served_log(3, 400)
    write_log(log, tmp_path / "log", "20261204/10")
    out = tmp_path / "ope.json"
    r = CliRunner().invoke(app, ["experiment", "ope", str(tmp_path / "log"), "--candidate",
                                 str(bundle), "--resamples", "200", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "SNIPS" in r.output and "logged policy" in r.output
    got = json.loads(out.read_text())["estimates"]
    # by hand: the candidate's scores of every served item, its top item per request; a
    # uniform logger shows it first with probability 1/K, so IPS = mean(K r [shown == top])
    feats = log.drop_columns(["request_id", "position", "unit", "variant", "forced",
                              "served_at", "score", "propensity", "label"])
    s = Predictor(bundle).predict(feats.to_pylist())[:, 0].reshape(-1, K)
    pos = log.column("position").to_numpy().reshape(-1, K)
    y = log.column("label").to_numpy().reshape(-1, K)
    shown = pos.argmin(1)
    hit = shown == s.argmax(1)
    r_shown = y[np.arange(len(y)), shown]
    assert got["ips"]["estimate"] == pytest.approx(np.mean(K * r_shown * hit))
    assert got["snips"]["estimate"] == pytest.approx((r_shown * hit).sum() / hit.sum())
    for e in got.values():
        assert e["low"] <= e["estimate"] <= e["high"]
    # an arm whose model read fewer features logged only those: it cannot be scored by
    # the candidate and is left out, said so
    arms = log.column("variant").to_numpy(zero_copy_only=False)
    c1 = pa.array(np.where(arms == "candidate", None, log.column("C1").to_numpy(
        zero_copy_only=False)), pa.string())
    write_log(log.set_column(log.column_names.index("C1"), "C1", c1), tmp_path / "log2",
              "20261204/10")
    r = CliRunner().invoke(app, ["experiment", "ope", str(tmp_path / "log2"), "--candidate",
                                 str(bundle), "--resamples", "200", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "arm candidate left out" in " ".join(r.output.split())
    two = json.loads(out.read_text())
    assert two["variants"] == ["control"] and two["requests"] == 200
    assert two["left_out"] == {"candidate": {"missing_inputs": ["C1"]}}


def test_report_on_the_command_line_and_its_errors(tmp_path):
    log = served_log(4, 400)
    write_log(log, tmp_path / "log", "20261204/10")
    r = CliRunner().invoke(app, ["experiment", "report", str(tmp_path / "log"), "-w",
                                 "control=1", "-w", "candidate=1", "-o", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert "sample ratio" in r.output and (tmp_path / "rep" / "ctr.png").exists()
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["arms"]["control"]["impressions"] == int(pc.sum(pc.equal(
        log["variant"], "control")).as_py())
    bad = CliRunner().invoke(app, ["experiment", "report", str(tmp_path / "log"), "-w",
                                   "control=x"])
    assert bad.exit_code == 2 and "ARM=WEIGHT" in bad.output
    missing = CliRunner().invoke(app, ["experiment", "report", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    write_log(log.drop_columns(["propensity"]), tmp_path / "noprop", "20261204/10")
    r = CliRunner().invoke(app, ["experiment", "ope", str(tmp_path / "noprop"),
                                 "--candidate", str(tmp_path)])
    assert r.exit_code == 2 and "explore" in r.output


def test_the_feedback_log_trains_a_model_with_sampan_stream(tmp_path):
    """Served items journaled with their features, clicks posted for some, joined into the
    hourly Parquet log: `sampan stream`'s directory source trains on it as it is."""
    import time

    from sampan.serving.feedback import Joiner, JournalWriter
    from sampan.train.online import run_stream

    base = tiny_config(tmp_path, rows=3000, epochs=1)
    run_experiment(load_config(raw=base), run_dir=tmp_path / "base")
    rng = np.random.default_rng(0)
    log = tmp_path / "feedback"
    w = JournalWriter(log, flush_seconds=60)
    # the training run's world (its seed), rows after those it was trained on
    t = pa.concat_tables(iter_synthetic(SyntheticConfig(rows=9000))).slice(3000)
    p = t.column("oracle_p").to_numpy()
    feats = t.drop_columns(["label", "oracle_p"])
    start = time.time() - 4 * 3600  # served hours ago: the hours are closed
    clicks = []
    for r in range(0, 6000, K):
        rid = f"r{r}"
        w.served({"request_id": rid, "unit": f"u{r % 97}", "variant": "default",
                  "model_version": "m", "forced": False, "served_at": start + r * 1.2},
                 [{"item": f"i{r + j}", "position": j, "score": 0.5, "propensity": None}
                  for j in range(K)], feats.slice(r, K))
        clicks += [{"request_id": rid, "item": f"i{r + j}", "type": "click",
                    "ts": start + r * 1.2 + 3} for j in range(K) if rng.random() < p[r + j]]
    w.events(clicks)
    w.close()
    Joiner(log, window_seconds=60).step()
    assert sum(1 for _ in log.rglob("_SUCCESS")) >= 2  # 2 hours of traffic, both closed
    cfg = load_config(raw={**base, "stream": {
        "source": "directory", "format": "parquet", "window_rows": 2000,
        "idle_stop_seconds": 2.0, "directory": {"root": str(log), "poll_seconds": 0.1}}})
    out = run_stream(cfg, run_dir=tmp_path / "online", from_run=tmp_path / "base")
    assert out["rows"] == 6000 and out["windows"] == 3
    windows = [json.loads(x) for x in (tmp_path / "online" / "metrics.jsonl").read_text()
               .splitlines() if '"stream"' in x]
    assert windows and all(w["auc"] > 0.6 for w in windows)  # the clicks carry the signal
