"""data.engine: ray on a real local Ray cluster (2 worker CPUs, started here and shut down
after): the processed data equals the local engine's byte for byte, rejects included, and a
worker killed mid-transform is retried to the same result."""

import filecmp
import json
import os
from pathlib import Path

import numpy as np
import pytest

from sampan.config import load_config
from sampan.data.sources import DataError
from sampan.data.store import build_store

ray = pytest.importorskip("ray")

from sampan.data.ray_engine import FAIL_ONCE  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # the workers inherit the environment: the fault hook arms only once its folder exists
    kill = tmp_path_factory.mktemp("kill") / "armed" / "marker"
    os.environ[FAIL_ONCE] = str(kill)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield kill
    ray.shutdown()
    os.environ.pop(FAIL_ONCE, None)


def write_logs(folder: Path, files: int = 3, rows: int = 1500, seed: int = 0) -> Path:
    """CSV files of clicks: a user, an item with a long tail, a price with missing values, an
    age cut into quantile buckets, a tag list, and a few broken rows in the second file."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    t = 0
    for f in range(files):
        lines = ["label,user,item,price,age,tags,ts"]
        for _ in range(rows):
            item = int(rng.zipf(1.5)) % 400
            price = "" if rng.random() < 0.1 else f"{rng.lognormal(2, 1):.3f}"
            tags = "|".join(f"t{int(x)}" for x in rng.integers(0, 30, rng.integers(0, 4)))
            t += int(rng.integers(1, 5))
            lines.append(f"{int(rng.random() < 0.3)},u{rng.integers(0, 300)},i{item},{price},"
                         f"{rng.integers(15, 70)},{tags},{t}")
        if f == 1:
            lines[10] = "x,u1,i1,1.0,30,t1,5"  # a label that is not a number
            lines[20] = "1,u2"  # too few fields
        (folder / f"part-{f}.csv").write_text("\n".join(lines) + "\n")
    return folder


def config(tmp_path: Path, logs: Path, engine: str, split: dict, **features) -> object:
    return load_config(raw={
        "name": "logs", "output_dir": str(tmp_path / "runs"),
        "data": {"train": str(logs), "engine": engine, "split": split,
                 "max_bad_fraction": 0.05},
        "features": {"label": "label", "group": "user",
                     "categorical": ["user", {"name": "item", "min_count": 2},
                                     {"name": "age_q", "column": "age",
                                      "bucketize": "quantile", "buckets": 5}],
                     "numeric": [{"name": "price", "buckets": 4}],
                     "lists": [{"name": "tags", "kind": "bag", "delimiter": "|",
                                "max_len": 3}], **features},
        "model": {"name": "deepfm"}})


def same_tree(a: Path, b: Path) -> list[str]:
    """Files that differ or exist on one side only."""
    out = []
    for p in sorted(a.rglob("*")):
        q = b / p.relative_to(a)
        if p.is_file() and not (q.is_file() and filecmp.cmp(p, q, shallow=False)):
            out.append(str(p.relative_to(a)))
    out += [str(q.relative_to(b)) for q in b.rglob("*") if not (a / q.relative_to(b)).exists()]
    return out


def test_an_address_without_a_cluster_is_a_clear_error(tmp_path):
    # first in the file: address auto would find the cluster the other tests start
    import subprocess
    import sys

    import yaml

    logs = write_logs(tmp_path / "logs", files=1, rows=10)
    raw = config(tmp_path, logs, "local", {"method": "random"}).model_dump(mode="json")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, "-m", "sampan.cli", "data", "prepare",
                        str(tmp_path / "c.yaml"), "--engine", "ray", "--address", "auto",
                        "--out", str(tmp_path / "data")], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 2, p.stderr
    assert "data.ray_address 'auto': no Ray cluster answers there" in p.stderr
    assert "ray start --head" in p.stderr and not (tmp_path / "data" / "train").exists()
    # a stale RAY_ADDRESS (Ray retried it for minutes): refused at once, named
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    p = subprocess.run([sys.executable, "-m", "sampan.cli", "data", "prepare",
                        str(tmp_path / "c.yaml"), "--engine", "ray", "--out",
                        str(tmp_path / "data")], capture_output=True, text=True, timeout=60,
                       env={**env, "RAY_ADDRESS": dead})
    assert p.returncode == 2, p.stderr
    flat = " ".join(p.stderr.split())
    assert f"the environment's RAY_ADDRESS '{dead}': no Ray cluster answers there" in flat
    assert "unset RAY_ADDRESS" in flat


def test_workers_that_cannot_import_sampan_are_a_clear_error(tmp_path):
    # a cluster whose Python lacks Sampan: its workers run with a sitecustomize that
    # refuses to import it (Ray's own error lists sys.path and a traceback)
    import subprocess
    import sys

    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'sampan':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n")
    logs = write_logs(tmp_path / "logs", files=1, rows=10)
    raw = config(tmp_path, logs, "ray", {"method": "random"}).model_dump(mode="json")
    script = f"""
import ray
from sampan.config import load_config
from sampan.data.store import build_store
from sampan.errors import ConfigError
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
         runtime_env={{"env_vars": {{"PYTHONPATH": {str(block)!r}}}}})
try:
    build_store(load_config(raw={raw!r}), {str(tmp_path / "data")!r})
except ConfigError as e:
    print("ConfigError:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=240, env=env)
    out = " ".join(p.stdout.split())
    assert "ConfigError: a Ray worker on " in out, p.stdout + p.stderr
    assert "cannot import 'sampan" in out and "pip install 'sampan[ray]'" in out, out


@pytest.mark.parametrize("split", [
    {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1},
    {"method": "time", "column": "ts", "train": 0.8, "valid": 0.1, "test": 0.1},
    {"method": "leave_one_out", "column": "user", "order": "ts"},
], ids=["random", "time", "leave_one_out"])
def test_ray_store_equals_the_local_one_byte_for_byte(cluster, tmp_path, split):
    logs = write_logs(tmp_path / "logs")
    local = build_store(config(tmp_path, logs, "local", split), tmp_path / "local",
                        echo=lambda *a: None)
    build_store(config(tmp_path, logs, "ray", split), tmp_path / "ray", echo=lambda *a: None)
    assert same_tree(tmp_path / "local", tmp_path / "ray") == []
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["rejects"]["reasons"] and manifest["rejects"]["rejected"] == 2
    assert len(local.split("train")) > 3000  # the files' rows, not one of them


def test_fit_rows_and_a_valid_file_of_its_own(cluster, tmp_path):
    logs = write_logs(tmp_path / "logs", files=4)
    valid = tmp_path / "valid"
    valid.mkdir()
    (logs / "part-3.csv").rename(valid / "part-3.csv")

    def cfg(engine):
        c = config(tmp_path, logs, engine, {"method": "random", "train": 0.9, "valid": 0.0,
                                                 "test": 0.1},
                   fit_rows=2000)
        return c.model_copy(update={"data": c.data.model_copy(update={"valid": str(valid)})})

    build_store(cfg("local"), tmp_path / "local", echo=lambda *a: None)
    build_store(cfg("ray"), tmp_path / "ray", echo=lambda *a: None)
    assert same_tree(tmp_path / "local", tmp_path / "ray") == []
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["fitted_on"]["rows"] == 2000
    assert manifest["splits"]["valid"] == {"rows": 1500, "from": "own files"}


def test_a_worker_killed_mid_transform_is_retried(cluster, tmp_path):
    logs = write_logs(tmp_path / "logs")
    split = {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}
    build_store(config(tmp_path, logs, "local", split), tmp_path / "local",
                echo=lambda *a: None)
    cluster.parent.mkdir()  # arms the hook: the first transform task kills its worker
    build_store(config(tmp_path, logs, "ray", split), tmp_path / "ray", echo=lambda *a: None)
    assert cluster.exists()  # a worker did die
    assert same_tree(tmp_path / "local", tmp_path / "ray") == []



def test_a_wholly_broken_file_after_good_ones_is_quarantined_as_locally(cluster, tmp_path):
    # the local engine's one log has kept rows from the files before, so 1,000 rejected
    # rows in a row do not stop it; each Ray task's log must not either
    logs = write_logs(tmp_path / "logs", files=2)
    (logs / "part-9.csv").write_text("label,user,item,price,age,tags,ts\n"
                                     + "oops,u1,i1,1.0,30,t1,5\n" * 1100
                                     + "1,u1,i1\n" * 1100)  # too few fields
    split = {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}

    def cfg(engine):
        c = config(tmp_path, logs, engine, split)
        return c.model_copy(update={"data": c.data.model_copy(update={
            "max_bad_fraction": 0.6})})

    build_store(cfg("local"), tmp_path / "local", echo=lambda *a: None)
    build_store(cfg("ray"), tmp_path / "ray", echo=lambda *a: None)
    assert same_tree(tmp_path / "local", tmp_path / "ray") == []
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["rejects"]["rejected"] == 2202


def test_files_named_by_uri_are_read_through_their_pyarrow_filesystem(cluster, tmp_path):
    # file:// goes through pyarrow.fs as s3:// and hdfs:// do (no object store here)
    logs = write_logs(tmp_path / "logs")
    split = {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}
    build_store(config(tmp_path, logs, "local", split), tmp_path / "local",
                echo=lambda *a: None)
    uri = f"file://{logs}/part-*.csv"
    build_store(config(tmp_path, uri, "ray", split), tmp_path / "ray", echo=lambda *a: None)
    for part in ("train", "valid", "test", "pipeline"):
        assert same_tree(tmp_path / "local" / part, tmp_path / "ray" / part) == []
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["sources"]["train"] == [f"file://{logs}/part-{i}.csv" for i in range(3)]
    rejects = [json.loads(x) for x in (tmp_path / "ray" / "rejects.jsonl").read_text()
               .splitlines()]
    assert {(r["file"], r["line"]) for r in rejects} == {
        (f"file://{logs}/part-1.csv", 11), (f"file://{logs}/part-1.csv", 21)}




def test_relative_paths_are_read_where_the_workers_run_elsewhere(cluster, tmp_path,
                                                                 monkeypatch):
    # the cluster's workers started in another directory (as `ray start` ones do)
    write_logs(tmp_path / "logs")
    split = {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}
    monkeypatch.chdir(tmp_path)
    for engine in ("local", "ray"):
        build_store(config(tmp_path, Path("logs"), engine, split), Path(engine),
                    echo=lambda *a: None)
    assert same_tree(tmp_path / "local", tmp_path / "ray") == []


def test_a_first_file_wholly_rejected_stops_both_engines_alike(cluster, tmp_path):
    logs = write_logs(tmp_path / "logs", files=2)
    (logs / "part-0.csv").write_text("label,user,item,price,age,tags,ts\n"
                                     + "oops,u1,i1,1.0,30,t1,5\n" * 1500)
    split = {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}
    errors = {}
    for engine in ("local", "ray"):
        with pytest.raises(DataError) as e:
            build_store(config(tmp_path, logs, engine, split), tmp_path / engine,
                        echo=lambda *a: None)
        errors[engine] = str(e.value).replace(str(tmp_path / engine), "ROOT")
    assert errors["local"] == errors["ray"] and "were all rejected" in errors["ray"]
    assert same_tree(tmp_path / "local", tmp_path / "ray") == []  # the rejects file, kept
