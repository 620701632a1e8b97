"""Data preparation on Ray against the local engine, on the same Criteo-format rows.

Generates N headerless Criteo rows (label, I1-I13, C1-C26; the built-in synthetic
distribution) as one file and as K part files, then times ``build_store`` with the Criteo
preset (read, validate, split, fit, transform, write):

* ``local``, the one file and the K files;
* ``ray``, the K files, on a Ray of this machine's cores started by the script (its start is
  timed apart: a cluster is started once, not per preparation).

For the Ray run it records each phase (stage, fit, transform): its wall time, its tasks and
their own seconds (measured inside each task), and the bytes its tasks returned. What is
left of the wall time is the driver's own work (units, merging the fits, the commit). Ray's
overhead per task is the phase's wall time on every CPU less the tasks' own seconds, over the
tasks.

From these it prints an **estimate** for M machines of C cores: the driver's work, plus each
phase's task seconds and overhead spread over M x C CPUs, plus the bytes that cross the
network (the staged rows written and read twice, the output written, the fits returned;
all but a machine's own share) at ``--network-gbps``. It is arithmetic on this machine's
measurements, not a measurement of a cluster.

    python benchmarks/prepare_scale.py                      # N = 10,000,000, K = 16
    python benchmarks/prepare_scale.py --rows 2000000 --readme docs/explanations/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def split_file(path: Path, parts: int, folder: Path) -> Path:
    """``path`` cut into ``parts`` files of whole lines, in order."""
    if folder.exists() and len(list(folder.glob("*.tsv"))) == parts:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    size = path.stat().st_size
    with open(path, "rb") as f:
        for i in range(parts):
            chunk = f.read(size // parts if i < parts - 1 else size)
            chunk += f.readline()  # to the end of the line
            (folder / f"part-{i:03d}.tsv").write_bytes(chunk)
    return folder


def config(train: Path, engine: str):  # type: ignore[no-untyped-def]
    from sampan.config import load_config

    return load_config(raw={"preset": "criteo", "data": {"train": str(train), "engine": engine,
                                                         "format": "tsv", "header": False}})


def timed_phases() -> dict:
    """Wrap the Ray engine's task runner: per phase, wall seconds, tasks, the seconds
    measured inside each task, and the bytes of what the tasks returned."""
    import sampan.data.ray_engine as engine

    phases: dict = {}
    run = engine._run

    def traced(fn, calls):  # type: ignore[no-untyped-def]
        def inner(*args):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = fn(*args)
            return out, time.perf_counter() - t

        t0 = time.perf_counter()
        results = list(run(inner, calls))
        name = fn.__name__.strip("_").split("_")[0]  # stage, fit, transform
        phases[name] = {"wall": time.perf_counter() - t0, "tasks": len(calls),
                        "task_seconds": sum(s for _, s in results),
                        "result_bytes": sum(len(pickle.dumps(r)) for r, _ in results)}
        if name == "stage":  # the Arrow files the stage tasks wrote (removed after the build)
            phases[name]["staged_bytes"] = sum(Path(c[4]).stat().st_size for c in calls)
        return iter(r for r, _ in results)

    engine._run = traced
    return phases


def prepare(train: Path, engine: str, out: Path) -> tuple[float, int]:
    from sampan.data.store import build_store

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    store = build_store(config(train, engine), out, echo=lambda *_: None)
    return time.perf_counter() - t0, store.manifest["rejects"]["read"]


def _warm_worker() -> None:
    import sampan.data.ray_engine  # noqa: F401
    import sampan.data.store  # noqa: F401


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def estimate(r: dict, machines: int, cores: int, gbps: float, scale: float = 1.0) -> float:
    """Seconds on ``machines`` of ``cores``, from this machine's run (see the module doc),
    for ``scale`` times its rows (every cost taken as proportional to the rows)."""
    phases = r["phases"]
    spread = machines * cores
    work = sum(p["task_seconds"] + p["tasks"] * p["overhead_per_task"] for p in phases.values())
    moved = 3 * phases["stage"]["staged_bytes"] + r["output_bytes"] + sum(
        p["result_bytes"] for p in phases.values())
    remote = (machines - 1) / machines  # the share of the bytes another machine holds
    return scale * (r["driver_seconds"] + work / spread + remote * moved / (gbps * 1e9 / 8))


SHAPES = [(1, os.cpu_count() or 2), (1, 16), (4, 16), (16, 16)]  # machines x cores
TARGET = 200_000_000  # rows: a day of Criteo 1TB


def estimates(ray_run: dict, rows: int, gbps: float) -> list:
    """((machines, cores), seconds for the run's rows, seconds for TARGET rows) for each of
    SHAPES."""
    return [(mc, estimate(ray_run, *mc, gbps), estimate(ray_run, *mc, gbps, TARGET / rows))
            for mc in SHAPES]


def markdown(report: dict) -> str:
    m = report["machine"]
    command = f"python benchmarks/prepare_scale.py {report['args']}".strip()
    lines = [f"`{command}` on {m['cpu']}, "
             f"{m['cores']} cores, Ray {report['ray']}: {report['rows']:,} Criteo rows.", "",
             "| engine | input | seconds | rows/s |", "|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['engine']} | {r['input']} | {r['seconds']:.1f} | "
                     f"{r['rows'] / r['seconds']:,.0f} |")
    ray = next(r for r in report["runs"] if r["engine"] == "ray")
    lines += ["", f"Ray's start, its workers' imports included: {report['ray_start']:.1f} s "
              "(paid once by a running cluster, not counted above). The Ray run, phase by "
              "phase:", "",
              "| phase | tasks | wall s | task s | overhead / task | returned |",
              "|---|---|---|---|---|---|"]
    for name, p in ray["phases"].items():
        lines.append(f"| {name} | {p['tasks']} | {p['wall']:.1f} | {p['task_seconds']:.1f} | "
                     f"{1000 * p['overhead_per_task']:.0f} ms | "
                     f"{p['result_bytes'] / 1e6:.1f} MB |")
    lines.append(f"| driver | - | {ray['driver_seconds']:.1f} | - | - | - |")
    lines += ["", f"**Estimate** (arithmetic on the figures above, not measured on a cluster; "
              f"{report['gbps']:g} Gbit/s between machines; for {TARGET:,} rows every cost "
              "taken as proportional to the rows):", "",
              f"| machines x cores | {report['rows']:,} rows | {TARGET:,} rows |",
              "|---|---|---|"]
    for (machines, cores), now, big in report["estimates"]:
        lines.append(f"| {machines} x {cores} | {now:.0f} s | {big / 60:.0f} min |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--files", type=int, default=16, help="the part files Ray reads")
    ap.add_argument("--network-gbps", type=float, default=10.0, dest="gbps")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "sampan-bench"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         "prepare_scale.json"))
    ap.add_argument("--readme", default=None)
    ap.add_argument("--render", metavar="JSON", help="only print (and with --readme write) "
                    "the figures of an earlier run's JSON, its estimates computed again")
    a = ap.parse_args()
    if a.render:
        from _readme import update_block

        report = json.loads(Path(a.render).read_text())
        ray_run = next(r for r in report["runs"] if r["engine"] == "ray")
        report["estimates"] = estimates(ray_run, report["rows"], report["gbps"])
        print(markdown(report))
        if a.readme:
            update_block(Path(a.readme), "prepare_scale", markdown(report))
        return

    import ray
    from _readme import shown_command, update_block
    from accuracy import machine
    from preprocess import generate

    from sampan.data.ray_engine import connect

    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    one = cache / f"criteo_{a.rows}.tsv"
    if not one.exists():
        print(f"generating {a.rows:,} rows -> {one}", flush=True)
        generate(a.rows, one)
    parts = split_file(one, a.files, cache / f"criteo_{a.rows}_{a.files}files")
    work = cache / "prepare_scale"
    # the imports and first calls of a process, paid before any timing
    warm = split_file(parts / "part-000.tsv", 1, cache / "prepare_scale_warm")
    prepare(warm, "local", work / "warm")
    runs = []
    for engine, train, label in [("local", one, "1 file"),
                                 ("local", parts, f"{a.files} files"),
                                 ("ray", parts, f"{a.files} files")]:
        r: dict = {"engine": engine, "input": label}
        if engine == "ray":
            t0 = time.perf_counter()
            connect(None)
            cpus = int(ray.cluster_resources()["CPU"])
            # every worker imports Sampan once: a cluster pays that at its start
            ray.get([ray.remote(_warm_worker).remote() for _ in range(4 * cpus)])
            ray_start = time.perf_counter() - t0
            r["phases"] = timed_phases()
        r["seconds"], r["rows"] = prepare(train, engine, work / engine)
        if engine == "ray":
            for p in r["phases"].values():
                p["overhead_per_task"] = max(0.0, p["wall"] * cpus - p["task_seconds"]) / \
                    max(p["tasks"], 1)
            r["driver_seconds"] = r["seconds"] - sum(p["wall"] for p in r["phases"].values())
            r["output_bytes"] = folder_bytes(work / engine)
            ray.shutdown()
        print(f"{engine:5} {label:9} {r['seconds']:7.1f} s  {r['rows'] / r['seconds']:>10,.0f} "
              "rows/s", flush=True)
        runs.append(r)
    ray_run = runs[-1]
    report = {"benchmark": "prepare_scale", "rows": a.rows, "files": a.files,
              "args": shown_command(" ".join(sys.argv[1:])), "machine": machine(),
              "ray": ray.__version__, "ray_start": ray_start, "gbps": a.gbps, "runs": runs,
              "estimates": estimates(ray_run, a.rows, a.gbps)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    text = markdown(report)
    print(text)
    if a.readme:
        update_block(Path(a.readme), "prepare_scale", text)


if __name__ == "__main__":
    main()
