"""Online training from a stream (issue 17): time-partitioned directories and a real
Kafka-protocol broker (librdkafka's mock cluster, inside the confluent-kafka wheel).

The exactly-once tests kill the trainer with SIGKILL at random moments, restart it with
``--resume`` until the stream is done, and then check that (a) the checkpointed windows
cover every record once, in order, with no gap and no overlap, and (b) the final weights
equal those of a run that was never interrupted."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
import torch
import yaml

from sampan.config import ConfigError, SyntheticConfig, load_config
from sampan.data.synthetic import iter_synthetic
from sampan.errors import DataError
from sampan.train.online import TRACE_ENV, run_stream
from tests import web

ROWS, PART_ROWS, WINDOW = 16_000, 2_000, 400


def drift_table(rows: int, seed: int = 7) -> pa.Table:
    return pa.concat_tables(list(iter_synthetic(SyntheticConfig(rows=rows, drift=1.0,
                                                                seed=seed))))


def write_partitions(root: Path, table: pa.Table, per: int = PART_ROWS) -> None:
    """root/20261201/HH/part-0.csv + _SUCCESS, one hour per ``per`` rows."""
    for k in range(0, table.num_rows, per):
        d = root / "20261201" / f"{k // per:02d}"
        d.mkdir(parents=True)
        pacsv.write_csv(table.slice(k, per), d / "part-0.csv")
        (d / "_SUCCESS").touch()


def stream_config(tmp_path: Path, stream: dict, **train) -> Path:
    raw = {
        "name": "stream", "preset": "criteo", "output_dir": str(tmp_path / "runs"),
        "data": {"format": "csv", "header": True, "columns": None, "delimiter": ",",
                 "oracle_column": "oracle_p"},
        "model": {"name": "deepfm", "embedding_dim": 4, "mlp": [16]},
        "train": {"batch_size": 128, "lr": 0.002, "warmup_steps": 5, "threads": 1,
                  "kernels": "mkl", "tensorboard": False, "prefetch": 0, **train},
        "stream": {"window_rows": WINDOW, "idle_stop_seconds": 2.0, **stream},
    }
    path = tmp_path / "stream.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def sampan(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sampan", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def run_to_end(config: Path, run: Path, env: dict, kills: int, seed: int) -> int:
    """Start the stream, SIGKILL it ``kills`` times at random moments while it trains
    (each restart is a ``--resume``), then let it finish; returns how many kills landed."""
    rng = random.Random(seed)
    landed = 0
    metrics = run / "metrics.jsonl"
    for _ in range(kills + 5):
        args = ["stream", "--resume", str(run)] if (run / "config.yaml").exists() else [
            "stream", str(config), "--run-dir", str(run)]
        before = metrics.read_text().count("\n") if metrics.exists() else 0
        p = sampan(*args, env=env)
        if landed < kills:
            # once this start has trained a window: a random moment of the training, the
            # checkpoint writes included
            while p.poll() is None and (
                    not metrics.exists() or metrics.read_text().count("\n") <= before):
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.6))
            if p.poll() is None:
                p.kill()
                p.communicate()
                landed += 1
                continue
        out = p.communicate(timeout=240)[0].decode()
        assert p.returncode == 0, out
        if (run / "results.json").exists():
            return landed
    raise AssertionError("the stream never finished")


def run_here(config: Path, run: Path, trace: Path, monkeypatch) -> None:
    """The uninterrupted reference, in this process (the same code and settings as the
    `sampan stream` subprocesses: one thread, fixed kernels); the thread count is put
    back after."""
    threads = torch.get_num_threads()
    monkeypatch.setenv(TRACE_ENV, str(trace))
    try:
        run_stream(load_config(config), run_dir=run)
    finally:
        torch.set_num_threads(threads)
        monkeypatch.delenv(TRACE_ENV)


def check_trace(trace: Path, total_rows: int) -> list[dict]:
    """Every checkpointed window once, each starting where the one before ended."""
    recs = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["window"] for r in recs] == list(range(1, len(recs) + 1))
    for a, b in zip(recs, recs[1:], strict=False):
        assert b["from"] == a["to"]
    assert recs[0]["from"] is None
    assert recs[-1]["rows"] == total_rows
    return recs


def same_weights(a: Path, b: Path) -> None:
    wa = torch.load(a / "checkpoints" / "last.pt", weights_only=False)
    wb = torch.load(b / "checkpoints" / "last.pt", weights_only=False)
    assert wa["stream"]["position"] == wb["stream"]["position"]
    assert wa["model"].keys() == wb["model"].keys()
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k


def test_directory_stream_exactly_once_across_kills(tmp_path: Path, monkeypatch) -> None:
    write_partitions(tmp_path / "parts", drift_table(ROWS))
    config = stream_config(tmp_path, {"source": "directory", "max_windows": ROWS // WINDOW,
                                      "directory": {"root": str(tmp_path / "parts"),
                                                    "poll_seconds": 0.1}})
    ref = tmp_path / "ref"
    run_here(config, ref, tmp_path / "ref.jsonl", monkeypatch)
    recs = check_trace(tmp_path / "ref.jsonl", ROWS)
    assert len(recs) == ROWS // WINDOW
    # windows straddle partitions: 400-row windows over 2,000-row partitions
    assert recs[0]["to"] == {"partition": "20261201/00", "rows": 400, "done": False}

    env = {**os.environ, TRACE_ENV: str(tmp_path / "killed.jsonl")}
    killed = tmp_path / "killed"
    landed = run_to_end(config, killed, env, kills=2, seed=1)
    assert landed == 2
    got = check_trace(tmp_path / "killed.jsonl", ROWS)
    assert [r["to"] for r in got] == [r["to"] for r in recs]
    same_weights(ref, killed)
    # progressive validation: one record per window, scored from the second on
    metrics = [json.loads(line) for line in (killed / "metrics.jsonl").read_text()
               .splitlines()]
    stream = [m for m in metrics if m.get("split") == "stream"]
    assert [m["window"] for m in stream] == list(range(1, len(recs) + 1))
    assert "auc" not in stream[0] and all("auc" in m and "auc_avg" in m for m in stream[1:])


def test_progressive_validation_beats_a_model_frozen_after_the_first_window(
        tmp_path: Path) -> None:
    """On the drifting stream, the model that goes on learning scores the later windows
    better (before seeing each) than the same model frozen after window 1."""
    table = drift_table(ROWS, seed=11)
    write_partitions(tmp_path / "parts", table)
    stream = {"source": "directory", "directory": {"root": str(tmp_path / "parts"),
                                                    "poll_seconds": 0.1},
              "window_rows": PART_ROWS}
    config = stream_config(tmp_path, stream)
    cfg = load_config(config)
    online = run_stream(cfg, run_dir=tmp_path / "online")
    frozen_cfg = load_config(config, overrides=["stream.max_windows=1"])
    run_stream(frozen_cfg, run_dir=tmp_path / "frozen")
    from sampan.train.experiment import RunArtifacts

    frozen = RunArtifacts(tmp_path / "frozen")
    metrics = [json.loads(line) for line in (tmp_path / "online" / "metrics.jsonl")
               .read_text().splitlines() if '"stream"' in line]
    later = range(ROWS // PART_ROWS // 2, ROWS // PART_ROWS)  # the second half
    on = [m["auc"] for m in metrics if m["window"] - 1 in later]
    files = [str(tmp_path / "parts" / "20261201" / f"{k:02d}" / "part-0.csv") for k in later]
    off = [frozen.evaluate([f])["auc"] for f in files]
    assert online["windows"] == ROWS // PART_ROWS
    gain = sum(on) / len(on) - sum(off) / len(off)
    assert gain > 0.01, (on, off)


def test_on_a_stream_whose_ids_come_and_go_dynamic_tables_beat_a_vocabulary_of_window_1(
        tmp_path: Path) -> None:
    """Churn (each rank's id replaced by new ones): the same online model scores the later
    windows better with dynamic tables, which take the new ids in, than with the vocabulary
    fitted on the first window, to which they are all one OOV row."""
    from benchmarks.drift import features_of

    table = pa.concat_tables(list(iter_synthetic(SyntheticConfig(rows=ROWS, churn=2.0,
                                                                seed=13))))
    write_partitions(tmp_path / "parts", table)
    stream = {"source": "directory", "directory": {"root": str(tmp_path / "parts"),
                                                    "poll_seconds": 0.1},
              "window_rows": PART_ROWS}
    # batches of 500: 26 dynamic tables cost a map lookup each per step
    raw = yaml.safe_load(stream_config(tmp_path, stream, batch_size=500).read_text())
    later = range(ROWS // PART_ROWS // 2 + 1, ROWS // PART_ROWS + 1)
    auc = {}
    for variant in ("vocab", "dynamic"):  # capacity: each field's ids live at one time
        raw["features"] = features_of(variant, churn=2.0)
        run_stream(load_config(raw=raw), run_dir=tmp_path / variant)
        m = [json.loads(line) for line in (tmp_path / variant / "metrics.jsonl")
             .read_text().splitlines() if '"stream"' in line]
        auc[variant] = sum(r["auc"] for r in m if r["window"] in later) / len(later)
    assert auc["dynamic"] > auc["vocab"] + 0.03, auc


def test_stream_from_a_batch_run(tmp_path: Path) -> None:
    """--from: the batch run's pipeline and weights; its first window is scored by them."""
    from sampan.train.experiment import RunArtifacts, run_experiment
    from tests.conftest import tiny_config

    raw = tiny_config(tmp_path, rows=4000)
    run_experiment(load_config(raw=raw), run_dir=tmp_path / "base")
    table = drift_table(3 * PART_ROWS, seed=3)
    write_partitions(tmp_path / "parts", table)
    base = yaml.safe_load((tmp_path / "base" / "config.yaml").read_text())
    stream = yaml.safe_load(stream_config(tmp_path, {
        "source": "directory", "window_rows": PART_ROWS, "time_column": "t",
        # a URI, as for hdfs:// or s3:// (which pyarrow opens the same way)
        "directory": {"root": (tmp_path / "parts").as_uri(), "poll_seconds": 0.1}})
        .read_text())
    base.update(stream=stream["stream"], data=stream["data"])
    out = run_stream(load_config(raw=base), run_dir=tmp_path / "online",
                     from_run=tmp_path / "base")
    assert out["windows"] == 3 and out["rows"] == 3 * PART_ROWS
    first = [json.loads(line) for line in (tmp_path / "online" / "metrics.jsonl")
             .read_text().splitlines() if '"stream"' in line][0]
    # the online run reads the CSV partitions; give its model the batch run's weights
    art = RunArtifacts(tmp_path / "online")
    art.model.load_state_dict(RunArtifacts(tmp_path / "base").model.state_dict())
    want = art.evaluate([str(tmp_path / "parts" / "20261201" / "00" / "part-0.csv")])
    assert abs(first["auc"] - want["auc"]) < 1e-9  # scored by the batch run's weights
    # the lag is training time minus event time (here t, 0 to 1: about time.time())
    part = table.slice(0, PART_ROWS).column("t").to_numpy()
    assert abs(first["lag_s"] - (first["time"] - part.mean())) < 5.0
    assert first["lag_max_s"] >= first["lag_s"]
    assert (tmp_path / "online" / "data" / "pipeline" / "pipeline.json").read_bytes() == (
        tmp_path / "base" / "data" / "pipeline" / "pipeline.json").read_bytes()


def test_stream_config_errors(tmp_path: Path) -> None:
    def load(stream: dict, **data) -> object:
        raw = yaml.safe_load(stream_config(tmp_path, stream).read_text())
        raw["data"].update(data)
        return load_config(raw=raw)

    with pytest.raises(ConfigError, match="give stream.kafka"):
        load({"source": "kafka"})
    with pytest.raises(ConfigError, match="done_file or quiet_seconds"):
        load({"source": "directory", "directory": {"root": ".", "done_file": None}})
    with pytest.raises(ConfigError, match="window_rowz.*window_rows"):
        load({"source": "directory", "directory": {"root": "."}, "window_rowz": 5})
    cfg = load({"source": "kafka", "format": "csv",
                "kafka": {"brokers": "127.0.0.1:1", "topic": "t"}})
    with pytest.raises(ConfigError, match="data.columns must list"):
        run_stream(cfg, run_dir=tmp_path / "r1")
    cfg = load({"source": "directory", "directory": {"root": str(tmp_path / "nowhere")}})
    with pytest.raises(DataError, match="is not a directory"):
        run_stream(cfg, run_dir=tmp_path / "r2")
    # a start that trained no window leaves no run in the way of the next start
    write_partitions(tmp_path / "nowhere", drift_table(2 * WINDOW, seed=2))
    assert run_stream(cfg, run_dir=tmp_path / "r2")["windows"] == 2
    # a resume may change where the stream is read, and keeps it; not what is trained
    with pytest.raises(ConfigError, match=r"--set model.embedding_dim: a resumed stream "
                       r"keeps its saved config; it may change only stream.kafka.brokers"):
        run_stream(None, run_dir=tmp_path / "r2", resume=True,
                   overrides=["model.embedding_dim=8"])
    run_stream(None, run_dir=tmp_path / "r2", resume=True,
               overrides=["stream.idle_stop_seconds=0.5"])
    assert load_config(tmp_path / "r2" / "config.yaml").stream.idle_stop_seconds == 0.5


def test_brokers_that_are_down_are_one_clear_error(tmp_path: Path, monkeypatch, capfd):
    pytest.importorskip("confluent_kafka")
    from sampan.data.stream import KafkaSource

    monkeypatch.setattr(KafkaSource, "DOWN_SECONDS", 1.0)
    raw = yaml.safe_load(stream_config(tmp_path, {
        "source": "kafka", "kafka": {"brokers": "127.0.0.1:1", "topic": "t"}}).read_text())
    raw["data"].update(format="jsonl")
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"cannot reach the Kafka brokers 127.0.0.1:1 "
                       r"\(stream.kafka.brokers\) for topic 't' after \d+ s: .*is the broker "
                       "running there"):
        run_stream(load_config(raw=raw), run_dir=tmp_path / "r")
    assert time.monotonic() - t0 < 20
    err = capfd.readouterr().err  # librdkafka's own log (a line an attempt) stays quiet
    assert err.count("Connection refused") <= 1, err


# ------------------------------------------------------------------------------- Kafka
def produce(ck, brokers: str, topic: str, table: pa.Table, bad_at: dict[int, bytes]) -> int:
    p = ck.Producer({"bootstrap.servers": brokers, "linger.ms": 5})
    n = 0
    for i, rec in enumerate(table.to_pylist()):
        if i in bad_at:
            p.produce(topic, value=bad_at[i], partition=0)
            n += 1
        p.produce(topic, value=json.dumps(rec).encode(), partition=0)
        n += 1
        if i % 5000 == 0:
            p.poll(0)
    assert p.flush(30) == 0
    return n


def test_kafka_stream_exactly_once_across_kills(tmp_path: Path, kafka_broker,
                                               monkeypatch) -> None:
    ck, brokers = kafka_broker
    rows = 6_000  # ~4.2 MB of JSON
    bad = {100: b'{"label": 1, "I1": ', 2000: b'{"I1": 3}', 4000: b"not json"}
    messages = produce(ck, brokers, "clicks", drift_table(rows), bad)
    stream = {"source": "kafka", "format": "jsonl", "max_windows": rows // 200,
              "window_rows": 200,
              "kafka": {"brokers": brokers, "topic": "clicks", "group": "ref"}}
    ref = tmp_path / "ref"
    run_here(stream_config(tmp_path, stream), ref, tmp_path / "ref.jsonl", monkeypatch)
    recs = check_trace(tmp_path / "ref.jsonl", rows)
    assert recs[-1]["to"]["offsets"]["0"] == messages  # past the rejected messages too

    stream["kafka"]["group"] = "killed"
    env = {**os.environ, TRACE_ENV: str(tmp_path / "killed.jsonl")}
    killed = tmp_path / "killed"
    assert run_to_end(stream_config(tmp_path, stream), killed, env, kills=2, seed=2) == 2
    got = check_trace(tmp_path / "killed.jsonl", rows)
    assert [r["to"] for r in got] == [r["to"] for r in recs]
    same_weights(ref, killed)

    # the group's offsets are committed after each checkpoint
    c = ck.Consumer({"bootstrap.servers": brokers, "group.id": "killed", "log_level": 0})
    committed = c.committed([ck.TopicPartition("clicks", 0)], timeout=10)
    c.close()
    assert committed[0].offset == messages
    # the bad messages are quarantined, named by partition and offset
    rejects = [json.loads(line) for line in (ref / "rejects.jsonl").read_text().splitlines()]
    assert {r["file"] for r in rejects} == {"kafka:clicks/0"}
    assert sorted(r["line"] for r in rejects) == [100, 2001, 4002]
    assert sorted(r["reason"] for r in rejects) == ["bad_json", "bad_json", "missing_value"]


# ------------------------------------------------------------------ pushing to serving
def test_published_versions_reach_a_server_under_load(tmp_path: Path) -> None:
    """The stream publishes a version per window; `sampan serve --watch` swaps each in
    while 4 HTTP clients keep scoring: no request fails, the served version moves on, and
    a rollback goes back one version."""
    import threading
    import time

    import httpx

    from sampan.export.publish import read_versions

    parts, models = tmp_path / "parts", tmp_path / "models"
    table = drift_table(4 * PART_ROWS, seed=5)
    write_partitions(parts, table.slice(0, 2 * PART_ROWS))
    config = stream_config(tmp_path, {
        "source": "directory", "directory": {"root": str(parts), "poll_seconds": 0.1},
        "window_rows": PART_ROWS, "idle_stop_seconds": 60.0,
        "publish": {"dir": str(models), "every_windows": 1, "every_seconds": None,
                    "keep": 3}})
    streamer = sampan("stream", str(config), "--run-dir", str(tmp_path / "run"))
    server = None
    try:
        deadline = time.monotonic() + 120
        while read_versions(models)["latest"] < 1:
            assert time.monotonic() < deadline and streamer.poll() is None, \
                streamer.communicate()[0].decode()
            time.sleep(0.2)
        port = free_port()
        token = "t0ken"
        server = sampan("serve", "--watch", str(models), "--port", str(port), "--set",
                        "watch_seconds=0.2", env={**os.environ, "SAMPAN_ADMIN_TOKEN": token})
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if web.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.2)
        records = [{k: v for k, v in r.items() if k[0] in "IC"}
                   for r in table.slice(0, 8).to_pylist()]
        stop, failures, done = threading.Event(), [], []

        def client() -> None:
            with httpx.Client() as c:
                while not stop.is_set():
                    r = c.post(f"{url}/v1/predict", json={"records": records}, timeout=30)
                    (done if r.status_code == 200 else failures).append(r.status_code)

        clients = [threading.Thread(target=client) for _ in range(4)]
        for t in clients:
            t.start()
        seen = set()
        for k in range(2, 4):  # new partitions arrive while the server is under load
            d = parts / "20261201" / f"{k:02d}"
            d.mkdir(parents=True)
            pacsv.write_csv(table.slice(k * PART_ROWS, PART_ROWS), d / "part-0.csv")
            (d / "_SUCCESS").touch()
            want = k + 1
            while True:
                pub = web.get(f"{url}/readyz").json().get("published", {})
                seen.add(pub.get("version"))
                if pub.get("version", 0) >= want:
                    break
                assert time.monotonic() < deadline and streamer.poll() is None, \
                    streamer.communicate()[0].decode()
                time.sleep(0.1)
        auth = {"Authorization": f"Bearer {token}"}
        r = web.post(f"{url}/v1/admin/rollback", headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["version"] < 4
        time.sleep(1.0)  # the watcher holds the rolled-back version
        back = web.get(f"{url}/readyz").json()["published"]["version"]
        stop.set()
        for t in clients:
            t.join()
        assert not failures and len(done) > 20, (failures[:5], len(done))
        assert back == r.json()["version"]
        assert len(seen - {None}) >= 2  # the clients saw the versions move on
        streamer.terminate()  # SIGTERM: a clean stop with a checkpoint
        out = streamer.communicate(timeout=120)[0].decode()
        assert streamer.returncode == 0, out
        # a version whose files do not match its manifest is refused; the current serves on
        v = read_versions(models)
        last = v["versions"][-1]
        shutil.copytree(models / last["path"], models / "v000099")
        with open(models / "v000099" / "pipeline" / "pipeline.json", "a") as f:
            f.write(" ")
        v["versions"].append({**last, "version": 99, "parent": last["version"],
                              "path": "v000099"})
        v["latest"] = 99
        (models / "versions.json").write_text(json.dumps(v))
        time.sleep(1.5)
        pub = web.get(f"{url}/readyz").json()["published"]
        assert pub["refused"] == [99] and pub["version"] == back
        assert "does not match its sha256" in " ".join(pub["errors"])
        assert web.post(f"{url}/v1/predict", json={"records": records}).status_code == 200
        v["versions"].pop()
        v["latest"] = last["version"]
        shutil.rmtree(models / "v000099")
        (models / "versions.json").write_text(json.dumps(v))
    finally:
        if streamer.poll() is None:
            streamer.terminate()
        out = streamer.communicate(timeout=120)[0].decode()
        logged = ""
        if server is not None:
            server.terminate()
            logged = server.communicate(timeout=30)[0].decode()
    assert streamer.returncode == 0, out
    # the server's log says each swap, the rollback and the refusal
    assert "watch: now serving version 3" in logged and "watch: rolled back from version" \
        in logged and "watch: refused version 99" in logged, logged
    v = read_versions(models)
    assert [e["version"] for e in v["versions"]] == list(range(v["latest"] - 2, v["latest"] + 1))
    for a, b in zip(v["versions"], v["versions"][1:], strict=False):
        assert b["parent"] == a["version"] and b["rows"] > a["rows"]
    assert v["versions"][-1]["position"]["partition"] == "20261201/03"
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == [
        e["path"] for e in v["versions"]]



def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_late_partition_is_skipped_and_said(tmp_path: Path) -> None:
    """Partitions are read once, in order: one that appears after a later one was read is
    skipped, and the source lists it (the run prints it and logs it in metrics.jsonl)."""
    from sampan.config import StreamConfig
    from sampan.data.pipeline import FeaturePipeline
    from sampan.data.rejects import RejectLog
    from sampan.data.stream import DirectorySource

    table = drift_table(300, seed=1)
    root = tmp_path / "parts"
    for name, k in (("2026120100", 0), ("2026120102", 1)):
        (root / name).mkdir(parents=True)
        pacsv.write_csv(table.slice(k * 100, 100), root / name / "part.csv")
        (root / name / "_SUCCESS").touch()
    cfg = load_config(stream_config(tmp_path, {"source": "directory",
                                               "directory": {"root": str(root)}}))
    s = StreamConfig.model_validate(cfg.stream.model_dump())
    roles = FeaturePipeline(cfg.features).roles(with_labels=True, with_extra=False)
    src = DirectorySource(s, cfg.data.model_copy(update={"format": "auto"}), roles,
                          RejectLog(None))
    got = []
    while (c := src.poll(0.2)) is not None:
        got.append((c.lane, c.table.num_rows, c.done))
    assert got == [("2026120100", 100, False), ("2026120100", 0, True),
                   ("2026120102", 100, False), ("2026120102", 0, True)]
    (root / "2026120101").mkdir()  # arrives late
    pacsv.write_csv(table.slice(200, 100), root / "2026120101" / "part.csv")
    (root / "2026120101" / "_SUCCESS").touch()
    assert src.poll(0.2) is None and src.late == ["2026120101"]
    assert src.poll(0.2) is None and src.late == ["2026120101"]  # said once


def test_produce_reads_a_delimiter_of_several_characters(tmp_path: Path):
    """MovieLens-1M's '::' files replay as the trainer reads them: typed, with or without a
    header line, across blocks."""
    from sampan.data.kafka import _records

    (tmp_path / "r.dat").write_text("user::item::rating\n1::1193::5\n2::661::3\n\n3::914::4\n")
    got = [r for b in _records(tmp_path / "r.dat", "csv", None, True, "::") for r in b]
    assert got == [{"user": 1, "item": 1193, "rating": 5}, {"user": 2, "item": 661, "rating": 3},
                   {"user": 3, "item": 914, "rating": 4}]
    got = [r for b in _records(tmp_path / "r.dat", "csv", ["u", "i", "y"], True, "::")
           for r in b]
    assert got[0] == {"u": 1, "i": 1193, "y": 5} and len(got) == 3


def test_kafka_broker_and_produce_commands_replay_a_file_keyed_and_typed(tmp_path: Path):
    """`sampan kafka broker` serves until SIGTERM; `sampan kafka produce` sends every record
    of a headerless TSV as one JSON object, keyed by the column asked for."""
    ck = pytest.importorskip("confluent_kafka")
    (tmp_path / "r.tsv").write_text("".join(f"u{i % 7}\ti{i}\t{i % 5}\n" for i in range(300)))
    addr = tmp_path / "broker.txt"
    broker = sampan("kafka", "broker", "--address-file", str(addr))
    try:
        deadline = time.time() + 30
        while not addr.exists() and time.time() < deadline:
            time.sleep(0.1)
        brokers = addr.read_text().strip()
        r = subprocess.run([sys.executable, "-m", "sampan", "kafka", "produce",
                            str(tmp_path / "r.tsv"), "--no-header", "--columns",
                            "user_id,item_id,rating", "--key", "user_id", "--stamp", "ts",
                            "--brokers", brokers, "--topic", "ratings"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "sent 300 records" in r.stdout
        c = ck.Consumer({"bootstrap.servers": brokers, "group.id": "t",
                         "auto.offset.reset": "earliest", "log_level": 0})
        c.subscribe(["ratings"])
        got: list = []
        deadline = time.time() + 60
        while len(got) < 300 and time.time() < deadline:
            got += [m for m in c.consume(300, timeout=1) if m.error() is None]
        c.close()
        recs = sorted((json.loads(m.value()) for m in got), key=lambda x: x["item_id"])
        assert len(recs) == 300
        assert {(m.key().decode(), json.loads(m.value())["user_id"]) for m in got} == \
            {(f"u{i}", f"u{i}") for i in range(7)}
        assert all(isinstance(x["rating"], int) and x["ts"] > 1e9 for x in recs)
        # one user's records sit in one partition, in file order
        by_user: dict = {}
        for m in sorted(got, key=lambda m: (m.partition(), m.offset())):
            by_user.setdefault(m.key(), []).append((m.partition(),
                                                    int(json.loads(m.value())["item_id"][1:])))
        assert all(len({p for p, _ in v}) == 1 for v in by_user.values())
        assert all([i for _, i in v] == sorted(i for _, i in v) for v in by_user.values())
        (tmp_path / "e.jsonl").write_text("".join(f'{{"u": {i}}}\n' for i in range(9)))
        j = subprocess.run([sys.executable, "-m", "sampan", "kafka", "produce",
                            str(tmp_path / "e.jsonl"), "--limit", "5", "--brokers", brokers,
                            "--topic", "j"], capture_output=True, text=True, timeout=60)
        assert j.returncode == 0 and "sent 5 records" in j.stdout, j.stderr
        bad = subprocess.run([sys.executable, "-m", "sampan", "kafka", "produce",
                              str(tmp_path / "r.tsv"), "--no-header", "--brokers", brokers,
                              "--topic", "x"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "needs --columns" in bad.stderr
    finally:
        broker.terminate()
        assert broker.wait(timeout=20) == 0
    assert not addr.exists()  # gone with its broker: a script never reads a stale one


def test_a_last_window_of_one_row_is_published_without_an_auc(tmp_path: Path) -> None:
    """801 rows in windows of 400: the last window holds one row. It has no AUC (one
    class), which stays out of the log and the averages (no nan), and the final version is
    published from it; a final push that fails ends the run with an error naming it."""
    from sampan.errors import ExportError, RunError
    from sampan.export.publish import Publisher, read_versions

    parts, models = tmp_path / "parts", tmp_path / "models"
    write_partitions(parts, drift_table(801, seed=3), per=801)
    config = load_config(stream_config(tmp_path, {
        "source": "directory", "directory": {"root": str(parts), "poll_seconds": 0.1},
        "idle_stop_seconds": 1.0,
        "publish": {"dir": str(models), "every_windows": 10, "every_seconds": None}}))
    out = run_stream(config, run_dir=tmp_path / "run", publisher=Publisher)
    assert (out["windows"], out["rows"]) == (3, 801)
    latest = read_versions(models)["versions"][-1]
    assert (latest["windows"], latest["rows"]) == (3, 801)
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
           .splitlines() if "window" in x]
    assert "NaN" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    assert [("auc" in r) for r in log] == [False, True, False] and log[-1]["rows"] == 1
    assert log[-1]["auc_avg"] == log[1]["auc"]
    assert out["progressive"]["auc"] == log[1]["auc"]

    def failing(cfg, run, console):  # a push that fails (a full disk, a bad graph)
        def push(info):
            raise ExportError("cannot write the bundle")
        return push

    with pytest.raises(RunError, match=r"final version \(window 3\) was not published: "
                       r"cannot write the bundle; .*sampan stream --resume"):
        run_stream(config, run_dir=tmp_path / "run2", publisher=failing)


def test_a_resumed_stream_neither_counts_nor_writes_again_what_it_read_before(
        tmp_path: Path) -> None:
    """A directory stream stopped after its first window resumes inside the partition: the
    rows the checkpoint holds are not counted as read again, and the bad rows the first
    process rejected (it read the whole partition ahead) are not written twice."""
    parts = tmp_path / "parts"
    write_partitions(parts, drift_table(1000, seed=4), per=1000)
    f = next(parts.rglob("part-0.csv"))
    lines = f.read_text().splitlines()
    lines[11], lines[901] = "x" + lines[11], "y" + lines[901]  # two bad labels
    f.write_text("\n".join(lines) + "\n")
    config = load_config(stream_config(tmp_path, {
        "source": "directory", "directory": {"root": str(parts), "poll_seconds": 0.1},
        "idle_stop_seconds": 1.0, "max_windows": 1}))
    first = run_stream(config, run_dir=tmp_path / "run")
    assert (first["rows"], first["rejects"]["rejected"]) == (400, 2)
    again = run_stream(None, run_dir=tmp_path / "run", resume=True,
                       overrides=["stream.max_windows=null"])
    assert again["rows"] == 998
    assert (again["rejects"]["read"], again["rejects"]["kept"],
            again["rejects"]["rejected"]) == (598, 598, 0)
    recs = [json.loads(x) for x in (tmp_path / "run" / "rejects.jsonl").read_text()
            .splitlines()]
    assert sorted(r["line"] for r in recs) == [12, 902]


def test_a_resumed_stream_publishes_on_its_own_cadence(tmp_path: Path) -> None:
    """Versions every 3 windows: a run stopped after window 2 (its first window and its
    end published) resumes and publishes at window 5, then at its end. It used to publish
    at its first checkpoint again (window 3), as a run that never had a version."""
    from sampan.export.publish import Publisher, read_versions

    parts, models = tmp_path / "parts", tmp_path / "models"
    write_partitions(parts, drift_table(WINDOW * 7 + 1, seed=5), per=WINDOW * 7 + 1)
    config = load_config(stream_config(tmp_path, {
        "source": "directory", "directory": {"root": str(parts), "poll_seconds": 0.1},
        "idle_stop_seconds": 1.0, "max_windows": 2,
        "publish": {"dir": str(models), "every_windows": 3, "every_seconds": None}}))
    run_stream(config, run_dir=tmp_path / "run", publisher=Publisher)
    assert [v["windows"] for v in read_versions(models)["versions"]] == [1, 2]
    out = run_stream(None, run_dir=tmp_path / "run", resume=True, publisher=Publisher,
                     overrides=["stream.max_windows=null"])
    assert out["windows"] == 8
    versions = read_versions(models)["versions"]
    assert [v["windows"] for v in versions] == [1, 2, 5, 8]
    assert {v["run"] for v in versions} == {str((tmp_path / "run").resolve())}
    # another run publishing to the same folder starts its own count: its first window
    config = load_config(stream_config(tmp_path, {
        "source": "directory", "directory": {"root": str(parts), "poll_seconds": 0.1},
        "idle_stop_seconds": 1.0, "max_windows": 1,
        "publish": {"dir": str(models), "every_windows": 3, "every_seconds": None}}))
    run_stream(config, run_dir=tmp_path / "other", publisher=Publisher)
    assert [v["windows"] for v in read_versions(models)["versions"]][-1:] == [1]


def test_files_beside_the_partitions_are_not_a_partition(tmp_path: Path) -> None:
    """A feedback log holds experiment.json at its root, beside its hour folders: it was
    read as a partition of its own that sorts first and never completes, and the stream
    waited on it for ever."""
    parts = tmp_path / "parts"
    write_partitions(parts, drift_table(900, seed=6), per=450)
    (parts / "experiment.json").write_text("{}")
    config = load_config(stream_config(tmp_path, {
        "source": "directory", "directory": {"root": str(parts), "poll_seconds": 0.1},
        "idle_stop_seconds": 1.0}))
    out = run_stream(config, run_dir=tmp_path / "run")
    assert out["rows"] == 900 and out["stopped"] == "the stream went quiet"
