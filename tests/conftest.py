"""Shared fixtures: tiny experiment configs and the location of the real datasets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import web

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the suite runs on two workers (pyproject's addopts), which share the machine's cores:
    # one thread each, and for the commands the tests start, so that no core is oversubscribed
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SAMPAN_SHARED_DATA", ROOT.parent / "shared" / "data"))

# pytest-xdist hands each worker a whole module at a time (--dist loadscope), in collection
# order (--no-loadscope-reorder: its default order, most tests first, put the modules of one
# or two minute-long tests last, and one worker then ran them alone for a minute and a half).
# The modules that take longest on 2 cores go first, longest first, so that the last ones
# handed out are short. Figures: seconds on one worker (a module's tests' durations, summed,
# in a full run on 2 cores).
LONGEST_FIRST = [
    "tests/integration/test_serving.py",  # 155
    "tests/integration/test_distributed.py",  # 100
    "tests/integration/test_stream.py",  # 95
    "tests/integration/test_fault_injection.py",  # 80
    "tests/integration/test_export.py",  # 70
    "tests/integration/test_doc_blocks.py",  # 60
    "tests/fuzz/test_schemathesis.py",  # 60
    "tests/integration/test_learning.py",  # 55
    "tests/realdata/test_datasets.py",  # 45
    "tests/integration/test_cli.py",  # 40
    "tests/unit/test_experiment.py",  # 35
    "tests/integration/test_tune.py",  # 30
    "tests/integration/test_plugins.py",  # 30
    "tests/realdata/test_taobao_serving.py",  # 28
    "tests/integration/test_report.py",  # 25
    "tests/integration/test_paddlerec.py",  # 23
    "tests/integration/test_dynamic_run.py",  # 23
    "tests/integration/test_next_item.py",  # 22
    "tests/integration/test_ray_engine.py",  # 17
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable


def tiny_config(tmp_path: Path, rows: int = 3000, **train) -> dict:
    """A raw config dict: DeepFM on a few thousand synthetic rows, quick on 2 cores.

    Without the first-order warm start (an LR fitted before the model): these configs test
    the mechanics of a run, and the warm start has its own tests (test_warm_start.py)."""
    return {
        "name": "tiny",
        "preset": "criteo",
        "output_dir": str(tmp_path / "runs"),
        "data": {"format": "synthetic", "synthetic": {"rows": rows},
                 "split": {"train": 0.8, "valid": 0.1, "test": 0.1}},
        "model": {"name": "deepfm", "embedding_dim": 4, "mlp": [16]},
        "train": {"epochs": 2, "batch_size": 256, "progress": False, "tensorboard": False,
                  "prefetch": 1, "first_order_warm_start": False, **train},
    }


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real datasets not present at {SHARED_DATA}")
    return SHARED_DATA


def din_live_bundle(root: Path) -> Path:
    """A DIN bundle on a behaviour log where each user keeps to a few categories (item
    ``i<n>`` has category ``c<n % 10>``), with user and item tables and live histories."""
    import random

    from rich.console import Console

    from sampan.config import load_config
    from sampan.data.behaviour import BuildOptions, build_sequences
    from sampan.export import export_run
    from sampan.train.experiment import run_experiment

    rng = random.Random(0)
    lines = []
    for t in range(6000):
        u = rng.randrange(80)
        c = (u + rng.choice([0, 0, 1])) % 10 if rng.random() < 0.8 else rng.randrange(10)
        i = c + 10 * rng.randrange(12)  # item i has category i % 10
        lines.append(f"u{u},i{i},c{i % 10},pv,{1000 + t}\n")
    (root / "log.csv").write_text("".join(lines))
    samples = root / "samples.parquet"
    build_sequences(str(root / "log.csv"), samples, BuildOptions(
        columns=["user_id", "item_id", "category_id", "behavior", "timestamp"], header=False,
        targets="positive", negatives=1, max_len=5))
    cfg = load_config(raw={
        "output_dir": str(root), "data": {"train": str(samples), "split": {
            "method": "time", "column": "timestamp", "train": 0.8, "valid": 0.1, "test": 0.1}},
        "features": {"label": "label", "group": "user_id",
                     "categorical": ["user_id", "item_id", "category_id"],
                     "lists": [{"name": "hist_item_id", "share": "item_id", "max_len": 5},
                               {"name": "hist_category_id", "share": "category_id",
                                "max_len": 5}]},
        "model": {"name": "din", "target": "item_id", "history": "hist_item_id",
                  "embedding_dim": 8, "mlp": [16]},
        "train": {"epochs": 1, "batch_size": 256, "progress": False, "tensorboard": False}})
    run = run_experiment(cfg, run_dir=root / "run", console=Console(quiet=True))["run_dir"]
    return export_run(run, root / "bundle")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A ``sampan serve`` process started for real: ``url``, ``grpc`` (host:port)."""

    def __init__(self, args: list[str], env: dict | None = None, grpc: bool = True):
        import subprocess
        import sys
        import threading
        import time

        import httpx

        port, gport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.grpc = f"127.0.0.1:{gport}"
        cmd = [sys.executable, "-m", "sampan.cli", "serve", *args, "--port", str(port)]
        cmd += ["--grpc-port", str(gport)] if grpc else []
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        # read as it comes: a server that logs more than a pipe holds must not block on it
        self._out: list[str] = []
        self._reader = threading.Thread(target=lambda: self._out.extend(self.proc.stdout),
                                        daemon=True)
        self._reader.start()
        for _ in range(600):
            try:
                if web.get(f"{self.url}/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                pytest.fail(f"server exited: {self.output()}")
            time.sleep(0.1)
        self.proc.kill()
        pytest.fail(f"server did not become ready: {self.output()}")

    def output(self) -> str:
        """What the server printed so far (all of it once it has exited)."""
        if self.proc.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self._out)

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        return self.output()


@pytest.fixture
def redis_url():
    """A real redis-server on a free port, for the test (skipped when not installed)."""
    import shutil
    import subprocess
    import time

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def kafka_broker():
    """A Kafka-protocol broker on localhost (librdkafka's mock cluster), alive while the
    returned producer is. It keeps about the last 5 MB of each partition: a test topic
    stays below that."""
    ck = pytest.importorskip("confluent_kafka", reason="confluent-kafka is not installed "
                             "(pip install 'sampan[stream]')")
    from sampan.data.kafka import LocalBroker

    with LocalBroker() as broker:
        yield ck, broker.brokers
