"""Data-parallel throughput: `sampan train` on the built-in data with 1 and N processes.

Reports training samples/s (the trainer's own measurement over the global batch, median of
its log records after the first) for each process count, and the ratio to one process. On a
2-core CPU machine two gloo processes share the cores one process already uses, so expect a
ratio near or below 1 there (the figure checks the overhead of the collectives); on a
multi-GPU machine use ``--device cuda --procs 1 2 4 8``.

Usage::

    python benchmarks/distributed.py                          # CPU, 1 and 2 processes
    python benchmarks/distributed.py --device cuda --procs 1 2 4 8 --rows 4000000
    python benchmarks/distributed.py --set model.batch_norm=true    # cost of synced batch norm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def stop_with_stacks(launcher: subprocess.Popen) -> None:
    """A run that hangs: SIGABRT to the training processes, so that each prints where it
    waits (faulthandler) into the log, then the launcher goes."""
    import signal
    import time

    for pid in children(launcher.pid):
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    time.sleep(3)
    launcher.kill()
    launcher.wait()


def run(procs: int, args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / f"p{procs}"
    cmd = [sys.executable, "-m", "sampan", "train", "--run-dir", str(run_dir),
           "--nproc-per-node", str(procs),
           "--set", f"data.synthetic.rows={args.rows}", "--set", "train.epochs=1",
           "--set", f"train.batch_size={args.batch_size}", "--set", "train.progress=false",
           "--set", "train.tensorboard=false", "--set", f"train.device={args.device}",
           "--set", "train.log_every_steps=20"]
    for kv in args.set:
        cmd += ["--set", kv]
    env = {**os.environ}
    if procs > 1:  # the cores shared out (torchrun would give each process one)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // procs))
    env["PYTHONFAULTHANDLER"] = "1"  # a process stopped by SIGABRT prints its stacks
    log = work / f"p{procs}.log"
    with open(log, "w") as f:
        launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            rc: int | None = launcher.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
            stop_with_stacks(launcher)
    if rc is None or rc:
        tail = "".join(log.read_text().splitlines(keepends=True)[-80:])
        why = f"timed out after {args.timeout} s" if rc is None else f"exit {rc}"
        raise RuntimeError(f"{procs} process(es): `sampan train` {why}; its output ends:\n"
                           f"{tail}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["samples_per_s"] for r in rows if r["split"] == "train"][1:]
    result = json.loads((run_dir / "results.json").read_text())
    out = {"procs": procs, "samples_per_s": statistics.median(speeds),
           "valid_auc": result["valid"]["auc"], "test_auc": result["test"]["auc"]}
    if args.bootstrap:  # the test AUC's 95 % interval, to compare process counts by
        from sampan.train.experiment import RunArtifacts

        m = RunArtifacts(run_dir).evaluate("test", bootstrap=args.bootstrap)
        out["test_auc_ci95"] = list(m["auc_ci95"])
    return out


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--batch-size", type=int, default=4096, help="the global batch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to every `sampan train`, e.g. model.batch_norm=true")
    ap.add_argument("--timeout", type=int, default=None, help="seconds each run may take")
    ap.add_argument("--bootstrap", type=int, default=0,
                    help="also the test AUC's 95 %% bootstrap interval, over this many resamples")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/distributed.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sampan-dist-"))
    results, failed = [], []
    for p in args.procs:
        try:
            r = run(p, args, work)
        except RuntimeError as e:  # the others are still measured and written
            print(e, flush=True)
            failed.append(p)
            continue
        r["ratio_to_1"] = r["samples_per_s"] / results[0]["samples_per_s"] if results else 1.0
        results.append(r)
        print(f"{p} process(es): {r['samples_per_s']:10,.0f} samples/s  "
              f"(x{r['ratio_to_1']:.2f})  valid AUC {r['valid_auc']:.4f}  "
              f"test AUC {r['test_auc']:.4f}"
              + (" [{:.4f}, {:.4f}]".format(*r["test_auc_ci95"]) if "test_auc_ci95" in r
                 else ""), flush=True)
    Path(args.json).write_text(json.dumps({
        "args": vars(args), "machine": {"cpu": platform.processor() or platform.machine(),
                                        "cores": os.cpu_count(), "gpu": gpu_name()},
        "results": results, "failed": failed}, indent=1))
    if failed:
        sys.exit(f"failed: {failed} process(es)")


if __name__ == "__main__":
    main()
