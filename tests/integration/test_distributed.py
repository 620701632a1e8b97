"""Data-parallel training on CPU with gloo and 2 processes: the replicated sparse update and
the dense gradient average equal one process on the whole batch; gathered evaluation equals
single-process evaluation; 2-process training follows 1-process training step by step; a
killed 2-process run resumes to the same end."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import yaml

from tests.conftest import tiny_config

SAMPAN = [sys.executable, "-m", "sampan"]
ENV = {**os.environ, "COLUMNS": "120"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ in-process, spawned ranks
def _rank_main(rank, fn, args):
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    # The group is destroyed and the results are on disk: leave without the interpreter's
    # teardown, during which gloo's threads have (rarely, on a loaded 2-core machine) aborted
    # a rank with "terminate called without an active exception".
    os._exit(0)


@contextlib.contextmanager
def process_group(rank, port):
    """This spawned process as rank ``rank`` of 2 (gloo, one thread), for the block."""
    from sampan import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    distributed.init_from_env("cpu")
    try:
        yield
    finally:
        distributed.shutdown()


def spawn_ranks(fn, *args):
    """Run ``fn(rank, *args)`` in 2 spawned processes; a rank's exception fails the test."""
    mp.spawn(_rank_main, args=(fn, args), nprocs=2, join=True)


def tiny_model():
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec

    schema = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 12),
                                             SparseFeatureSpec("b", 30)],
                        sequences=[SequenceFeatureSpec("hist_b", 4, "b")])
    torch.manual_seed(0)
    # batch norm three ways: Dice in the MLP and the attention, the input norm, the MLP's
    return build_model(get_model_class("din").Config(
        embedding_dim=4, mlp=[8], attention_mlp=[4], activation="dice",
        attention_activation="dice", input_norm=True, batch_norm=True), schema)


def data(n=101):
    from sampan.data.store import SplitArrays

    g = np.random.default_rng(0)
    hist = g.integers(0, 30, (n, 4))
    hist[:, :2][g.random((n, 2)) < 0.5] = 0
    return SplitArrays(dense=g.standard_normal((n, 1)).astype(np.float32),
                       sparse=np.stack([g.integers(0, 12, n), g.integers(0, 30, n)], 1),
                       labels=(g.random((n, 1)) < 0.4).astype(np.float32),
                       group=g.integers(0, 12, n), sequences={"hist_b": hist})


def grads_and_eval(model, batch, weight, out):
    """One step's gradients (dense and merged sparse) and a full evaluation."""
    from sampan import distributed
    from sampan.config import load_config
    from sampan.embedding import EmbeddingCollection
    from sampan.tasks import training_loss
    from sampan.train.trainer import Trainer

    model.train()
    (training_loss(model, batch) * weight).backward()
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # batch-norm statistics
    dense = [p for p in model.parameters() if p.requires_grad]
    distributed.average_gradients(dense)
    coll = next(m for m in model.modules() if isinstance(m, EmbeddingCollection))
    rows, g = coll.pop_lookups()
    cfg = load_config(None, overrides=["train.progress=false", "train.eval_batch_size=16"])
    trainer = Trainer(model, cfg, out.parent, data(), None, log_metrics=False)
    metrics = trainer.evaluate(data())
    return {"dense": {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.requires_grad}, "rows": rows, "sparse": g, "metrics": metrics,
            "bounds": getattr(coll, "bounds", None), "buffers": buffers}


def worker(rank, port, out, placement="replicated"):
    from sampan import distributed
    from sampan.data.loader import BatchLoader

    with process_group(rank, port):
        loader = BatchLoader(data(), batch_size=33, shuffle="rows", seed=3, prefetch=0,
                             rank=rank, world=2)
        batch = next(iter(loader))
        weight = batch.size / loader.global_rows(0)
        model = tiny_model()
        # applied from outside, as a run does: tables replicated or row-sharded, batch norm
        # over the global batch
        strategy = distributed.DataParallel(distributed.context(),
                                            lambda nbytes: placement == "row_sharded")
        model = strategy.parallelize(model)
        assert strategy.synced_batch_norms == 4
        result = grads_and_eval(model, batch, weight, out / f"r{rank}.pt")
        # the rows this rank's forward saw, to compare with the whole table's
        with torch.no_grad():
            result["forward"] = model.eval()(batch)
        torch.save(result, out / f"r{rank}.pt")


@pytest.mark.parametrize("placement", ["replicated", "row_sharded"])
def test_two_ranks_equal_one_process(tmp_path, placement):
    from sampan.data.loader import BatchLoader

    spawn_ranks(worker, free_port(), tmp_path, placement)
    ranks = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(2)]
    batch = next(iter(BatchLoader(data(), batch_size=33, shuffle="rows", seed=3, prefetch=0)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same summation order in every kernel
    try:
        single = tiny_model()
        one = grads_and_eval(single, batch, 1.0, tmp_path / "single.pt")
    finally:
        torch.set_num_threads(threads)
    for r, got in enumerate(ranks):
        # every rank holds the global gradient: dense averaged, sparse rows merged; batch
        # norm normalised with, and kept, the global batch's statistics
        for name, g in one["dense"].items():
            torch.testing.assert_close(got["dense"][name], g, atol=1e-6, rtol=1e-4)
        for name, b in one["buffers"].items():
            torch.testing.assert_close(got["buffers"][name], b, atol=1e-6, rtol=1e-5)
        rows, sparse = one["rows"], one["sparse"]
        if placement == "row_sharded":  # each owner gets its rows' gradients, local indices
            lo, hi = got["bounds"][r], got["bounds"][r + 1]
            mine = (rows >= lo) & (rows < hi)
            rows, sparse = rows[mine] - lo, sparse[mine]
        assert torch.equal(got["rows"], rows)
        torch.testing.assert_close(got["sparse"], sparse, atol=1e-6, rtol=1e-4)
        # the forward of the rank's own rows equals the whole table's
        local = next(iter(BatchLoader(data(), batch_size=33, shuffle="rows", seed=3,
                                      prefetch=0, rank=r, world=2)))
        with torch.no_grad():
            torch.testing.assert_close(got["forward"], single.eval()(local),
                                       atol=1e-6, rtol=1e-5)
        # gathered evaluation: metrics of all 101 rows, not an average of two halves
        for k in ("auc", "logloss", "gauc", "rows"):
            assert got["metrics"][k] == pytest.approx(one["metrics"][k], abs=1e-9), k


def two_tower_model():
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SparseFeatureSpec

    schema = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("user_id", 20),
                                             SparseFeatureSpec("item_id", 9)])
    torch.manual_seed(0)
    return build_model(get_model_class("two_tower").Config(
        embedding_dim=4, tower_mlp=[8], item_features=["item_id"], k=5), schema)


def two_tower_step(batch, weight):
    """Loss and gradients of one step; items repeat, so accidental hits are masked."""
    from sampan import distributed
    from sampan.embedding import EmbeddingCollection
    from sampan.tasks import make_task

    g = np.random.default_rng(1)
    n = 60
    train = data(n)
    train.sparse = np.stack([g.integers(2, 20, n), g.integers(2, 9, n)], 1)
    train.labels = np.ones((n, 1), np.float32)
    model = distributed.strategy_for().parallelize(two_tower_model())
    task = make_task(model, train)
    loss = task.loss(model, batch)
    (loss * weight).backward()
    dense = [p for p in model.parameters() if p.requires_grad]
    distributed.average_gradients(dense)
    coll = next(m for m in model.modules() if isinstance(m, EmbeddingCollection))
    rows, sparse = coll.pop_lookups()
    return {"loss": loss.detach() * weight, "rows": rows, "sparse": sparse,
            "dense": {k: p.grad.clone() for k, p in model.named_parameters()
                      if p.requires_grad}}


def tt_batch(rank=0, world=1):
    from sampan.data.loader import BatchLoader

    g = np.random.default_rng(2)
    d = data(40)
    d.sparse = np.stack([g.integers(2, 20, 40), g.integers(2, 9, 40)], 1)
    loader = BatchLoader(d, batch_size=31, shuffle="rows", seed=3, prefetch=0, rank=rank,
                         world=world)
    return next(iter(loader)), loader


def tt_worker(rank, port, out):
    with process_group(rank, port):
        batch, loader = tt_batch(rank, 2)
        result = two_tower_step(batch, batch.size / loader.global_rows(0))
        torch.save(result, out / f"tt{rank}.pt")


def test_two_tower_negatives_come_from_the_global_batch(tmp_path):
    """Two ranks of 16 + 15 rows train exactly like one process on the 31: every rank's
    softmax runs over all 31 items, and the gradients reach the items' own ranks."""
    spawn_ranks(tt_worker, free_port(), tmp_path)
    ranks = [torch.load(tmp_path / f"tt{r}.pt", weights_only=False) for r in range(2)]
    batch, _ = tt_batch()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = two_tower_step(batch, 1.0)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(ranks[0]["loss"] + ranks[1]["loss"], one["loss"])
    for got in ranks:
        for name, g in one["dense"].items():
            torch.testing.assert_close(got["dense"][name], g, atol=1e-6, rtol=1e-4)
        assert torch.equal(got["rows"], one["rows"])
        torch.testing.assert_close(got["sparse"], one["sparse"], atol=1e-6, rtol=1e-4)


# -------------------------------------------------------------------- the CLI, torchrun
def run_cli(*args, timeout=300):
    r = subprocess.run([*SAMPAN, *args], capture_output=True, text=True, timeout=timeout,
                       env=ENV)
    assert r.returncode == 0, f"sampan {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r


def write_cfg(tmp_path, **train):
    cfg = tiny_config(tmp_path, rows=8000, batch_size=256, log_every_steps=5, **train)
    cfg["train"]["early_stopping"] = {"patience": 10}
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def losses(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]


# both placements are checked against one process in-process (test_two_ranks_equal_one_process);
# a row-sharded CLI run with the warm start, its checkpoint parts and its export are in
# test_killed_two_process_run_resumes; these full CLI comparisons run under `pytest -m heavy`
@pytest.mark.heavy
@pytest.mark.parametrize("placements", [("sharded",), ("two", "sharded")])
def test_two_processes_follow_one(tmp_path, placements):
    # with the first-order warm start: the LR before the model is data-parallel too, and a
    # row-sharded table takes its rows of it
    # (by SGD in both: one process's default, the exact LR, has no data-parallel form)
    cfg = write_cfg(tmp_path, epochs=2, first_order_warm_start=True, first_order_solver="sgd")
    run_cli("train", str(cfg), "--run-dir", str(tmp_path / "one"))
    if "two" in placements:
        r = run_cli("train", str(cfg), "--nproc-per-node", "2", "--run-dir",
                    str(tmp_path / "two"))
        assert "distributed: 2 processes, global batch 256 (128 per process)" in r.stdout
        assert "replicated (sparse gradients all-gathered)" in r.stdout
    r = run_cli("train", str(cfg), "--nproc-per-node", "2", "--run-dir",
                str(tmp_path / "sharded"), "--set", "train.embedding_placement=row_sharded")
    assert "distributed: 2 processes, global batch 256 (128 per process)" in r.stdout
    assert "row-sharded: ranks 0-1" in r.stdout
    a = json.loads((tmp_path / "one" / "results.json").read_text())
    for run in placements:
        one, two = losses(tmp_path / "one"), losses(tmp_path / run)
        assert [s for s, _ in one] == [s for s, _ in two] and len(one) >= 8
        for (_, x), (_, y) in zip(one, two, strict=True):
            assert y == pytest.approx(x, rel=1e-3), run
        b = json.loads((tmp_path / run / "results.json").read_text())
        assert b["world_size"] == 2 and b["steps"] == a["steps"]
        for split in ("valid", "test"):
            assert b[split]["rows"] == a[split]["rows"]
            assert b[split]["auc"] == pytest.approx(a[split]["auc"], abs=2e-3), (run, split)
    # the sharded run's checkpoints are written in parts, each process its own rows (and
    # their optimizer state); put together they are the table
    from sampan.train import checkpoint as ckpt

    ck = tmp_path / "sharded" / "checkpoints"
    for name in ("last.pt", "best.pt"):
        top = torch.load(ck / name, weights_only=True)
        assert top["parts"]["world"] == 2
        parts = [torch.load(ck / f, weights_only=True)["rows"] for f in top["parts"]["files"]]
        key = next(k for k in parts[0] if k.startswith("model/"))
        whole = ckpt.load(ck / name)["model"][key[len("model/"):]]
        assert not torch.is_tensor(top["model"][key[len("model/"):]])
        assert [len(p[key]) for p in parts] == [len(whole) // 2, len(whole) - len(whole) // 2]
        assert torch.equal(torch.cat([p[key] for p in parts]), whole)
        if name == "last.pt":
            assert any(k.startswith("sparse_opt/") for k in parts[1])
    assert len(list(ck.glob("*.part*-of-*.pt"))) == 4  # earlier checkpoints' parts removed
    # the 2-process run exports and scores like a single-process one
    from sampan.export import export_run
    from sampan.serving import Predictor

    for run in placements:  # the sharded checkpoint holds the gathered table
        bundle = export_run(tmp_path / run, tmp_path / f"bundle-{run}")
        assert Predictor(bundle).bundle.manifest["parity"]["max_abs_diff"] < 1e-5


def ranks_of(run) -> list[int]:
    """Processes still running a `sampan train` of this run directory."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if str(run).encode() in cmd and b"sampan" in cmd:
                pids.append(int(d))
    return pids


@pytest.mark.parametrize("placement,resume_procs", [
    pytest.param("replicated", 2, marks=pytest.mark.heavy), ("row_sharded", 2),
    pytest.param("row_sharded", 1, marks=pytest.mark.heavy)])
def test_killed_two_process_run_resumes(tmp_path, placement, resume_procs):
    """Killed after a checkpoint, the run resumes to the same end; a row-sharded checkpoint
    (in per-process parts) also resumes in one process, to the same steps and AUC within
    the 1-vs-2-process tolerance. With the first-order warm start (data-parallel too: by
    SGD, as the exact LR has no data-parallel form), and the resumed run exports."""
    cfg = write_cfg(tmp_path, epochs=3, checkpoint_every_steps=10,
                    embedding_placement=placement, first_order_warm_start=True,
                    first_order_solver="sgd")
    if resume_procs == 2:  # each rank resumes its own dropout stream
        d = yaml.safe_load(cfg.read_text())
        d["model"].update(dropout=0.5, embedding_init_std=0.3)  # masks that move the loss
        cfg.write_text(yaml.safe_dump(d))
    r = run_cli("train", str(cfg), "--nproc-per-node", "2", "--run-dir",
                str(tmp_path / "straight"))
    assert "first-order warm start: an LR on the same rows (SGD" in " ".join(r.stdout.split())
    want = json.loads((tmp_path / "straight" / "results.json").read_text())
    run = tmp_path / "interrupted"
    proc = subprocess.Popen([*SAMPAN, "train", str(cfg), "--nproc-per-node", "2",
                             "--run-dir", str(run)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV, start_new_session=True)
    last = run / "checkpoints" / "last.pt"
    deadline = time.time() + 240
    while not last.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher; the ranks (own sessions) follow it
    proc.wait()
    deadline = time.time() + 10
    while ranks_of(run) and time.time() < deadline:
        time.sleep(0.05)
    assert not ranks_of(run), "ranks outlived their killed launcher"
    assert last.exists() and not (run / "results.json").exists()
    step = torch.load(last, weights_only=True)["state"]["step"]
    assert 0 < step < want["steps"]
    run_cli("train", "--resume", str(run), "--nproc-per-node", str(resume_procs))
    # no orphaned parts: those on disk are the ones last.pt and best.pt name
    named = [f for name in ("last.pt", "best.pt") for f in torch.load(
        run / "checkpoints" / name, weights_only=True).get("parts", {}).get("files", [])]
    assert sorted(p.name for p in (run / "checkpoints").glob("*.part*")) == sorted(named)
    got = json.loads((run / "results.json").read_text())
    assert (got["steps"], got["best_step"]) == (want["steps"], want["best_step"])
    if resume_procs == 2:  # the steps after the resume are the straight run's
        straight, resumed = dict(losses(tmp_path / "straight")), dict(losses(run))
        assert sorted(straight) == sorted(resumed) and max(straight) > step
        for s in straight:
            assert resumed[s] == pytest.approx(straight[s], rel=1e-5), s
    for split in ("valid", "test"):
        for k in ("auc", "logloss"):
            assert got[split][k] == pytest.approx(
                want[split][k], abs=1e-6 if resume_procs == 2 else 2e-3), (split, k)
    # the row-sharded checkpoint holds the gathered table: it exports and scores as PyTorch
    from sampan.export import export_run
    from sampan.serving import Predictor

    bundle = export_run(run, tmp_path / "bundle")
    assert Predictor(bundle).bundle.manifest["parity"]["max_abs_diff"] < 1e-5


# ------------------------------------------------------------------ dynamic tables
def dynamic_steps(batches, weight_of, placement="replicated"):
    """Three SparseAdam steps of a collection with dynamic tables of 6 and 4 rows sharing a
    key map (full from the second step, evicting after) on ``batches``; the table (this
    process's rows of it, from row ``lo``) and the map afterwards."""
    from sampan import distributed
    from sampan.config import TrainConfig
    from sampan.embedding import EmbeddingCollection, SparseAdam
    from sampan.schema import DynamicSpec, TableSpec

    torch.manual_seed(0)
    coll = EmbeddingCollection([TableSpec("a", 5, 4, ("a",)), TableSpec(
        "k", 7, 4, ("k",), dynamic=DynamicSpec(6, policy="lru", evict_fraction=0.0)),
        TableSpec("k2", 5, 4, ("k2",), dynamic=DynamicSpec(4, policy="lru",
                                                          evict_fraction=0.0))], 0.3)
    coll = distributed.strategy_for(TrainConfig(embedding_placement=placement)
                                    ).parallelize(coll)
    opt = SparseAdam([coll], lr=0.1)
    for ids in batches:
        ((coll(ids).sum(-1) - 1.0).square().sum() * weight_of(ids)).backward()
        opt.step()
    index = coll.dynamic["k+k2"]
    return {"weight": coll.weight.detach().clone(), "keys": index.row_key.clone(),
            "stamps": index.row_stamp.clone(), "lo": getattr(coll, "lo", 0)}


def dynamic_batches():
    g = torch.Generator().manual_seed(5)
    return [torch.stack([torch.randint(0, 5, (10,), generator=g),
                         torch.randint(1, 12, (10,), generator=g) * 1_000_003,
                         torch.randint(1, 8, (10,), generator=g) * 1_000_003], 1)
            for _ in range(3)]


def dynamic_worker(rank, port, out):
    placement = (out / "placement").read_text()
    with process_group(rank, port):
        mine = [b[rank * 5: (rank + 1) * 5] for b in dynamic_batches()]
        torch.save(dynamic_steps(mine, lambda ids: 1.0 / 10, placement), out / f"dyn{rank}.pt")


@pytest.mark.parametrize("placement", ["replicated", "row_sharded"])
def test_two_ranks_train_a_dynamic_table_like_one_process(tmp_path, placement):
    """Each rank admits the keys of the whole global batch, in rank order, so the maps stay
    equal; row gradients merge (replicated) or go to the rows' owners (row-sharded); evicted
    rows are drawn again alike: both ranks end where one process on the global batch ends
    (row-sharded: their rows put together are its table)."""
    (tmp_path / "placement").write_text(placement)
    spawn_ranks(dynamic_worker, free_port(), tmp_path)
    one = dynamic_steps(dynamic_batches(), lambda ids: 1.0 / 10)
    got = [torch.load(tmp_path / f"dyn{r}.pt", weights_only=True) for r in range(2)]
    for g in got:
        assert torch.equal(g["keys"], one["keys"]) and torch.equal(g["stamps"], one["stamps"])
    if placement == "row_sharded":
        assert got[0]["lo"] == 0 and got[1]["lo"] == len(got[0]["weight"]) > 0
        weight = torch.cat([g["weight"] for g in got])
    else:
        weight = got[1]["weight"]
        torch.testing.assert_close(got[0]["weight"], weight, atol=0, rtol=0)
    torch.testing.assert_close(weight, one["weight"], atol=1e-6, rtol=1e-5)


def test_machines_without_a_shared_run_folder_stop_with_a_clear_error(tmp_path):
    """Two launchers (`--nnodes 2`), each in a folder of its own as on two machines that
    share no storage: the second cannot read the data the first wrote. It says why, and
    both stop at once (a failing rank used to wait at the group's exit barrier while the
    other waited in a broadcast: both hung)."""
    cfg = tiny_config(tmp_path, rows=2000)
    cfg.pop("output_dir", None)  # runs/ under each launcher's own folder
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    procs = []
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        procs.append(subprocess.Popen(
            [*SAMPAN, "train", str(tmp_path / "exp.yaml"), "--nnodes", "2",
             "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"],
            cwd=tmp_path / node, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs), outs
    flat = " ".join(" ".join(outs).split())
    assert "rank 1: " in flat and "does not exist on this machine: rank 0 wrote the run's " \
        "data there. With several machines, the run folder must be on storage every " \
        "machine sees at the same path" in flat, flat
