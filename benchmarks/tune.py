"""``sampan tune`` on the built-in data: the study of ``configs/tune_deepfm.yaml`` and what
pruning saves.

1. ``study``: the config as shipped (30 TPE trials, median pruning) with ``--workers 2``:
   wall time, trials completed / pruned, the best valid AUC against the defaults', and the
   best trial's test AUC minus the defaults' with its paired bootstrap interval.
2. ``--pruning``: the same study drawn by the random sampler (one seed: both studies draw
   the same trials) with the median pruner and without any: wall time and trial-seconds of
   each, and the best valid AUC each found, so the time pruning saves is measured, not
   estimated, with what it cost in the result.

Every study is a fresh folder under ``--out``; the machine is recorded beside the figures.

Usage::

    python benchmarks/tune.py                         # the study (about 5 min on 2 cores)
    python benchmarks/tune.py --pruning --json benchmarks/results/tune.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import machine  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tune_deepfm.yaml"


def study(out: Path, workers: int, trials: int, sets: list[str]) -> dict:
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "sampan", "tune", str(CONFIG), "--out", str(out),
           "--workers", str(workers), "--trials", str(trials)]
    cmd += [x for s in sets for x in ("--set", s)]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    s = json.loads((out / "summary.json").read_text())
    cmp = s.get("best_vs_defaults") or {}
    return {"wall_seconds": round(wall, 1), "trials": s["trials"], "time": s["time"],
            "best_valid_auc": s["best"]["value"], "best_params": s["best"]["params"],
            "defaults_valid_auc": s["defaults"]["value"],
            "best_test_auc": s["best"]["test"]["auc"],
            "defaults_test_auc": s["defaults"]["test"]["auc"],
            "test_diff": cmp.get("diff"), "test_diff_ci95": cmp.get("diff_ci95")}


def show(name: str, r: dict) -> None:
    c = r["trials"]
    lo, hi = r["test_diff_ci95"] or (float("nan"), float("nan"))
    print(f"{name}: {r['wall_seconds']:.0f} s wall, {c['complete']} completed + "
          f"{c['pruned']} pruned trials ({r['time']['trial_seconds']:.0f} trial-seconds); "
          f"best valid AUC {r['best_valid_auc']:.4f} (defaults {r['defaults_valid_auc']:.4f}); "
          f"test AUC {r['best_test_auc']:.4f} vs {r['defaults_test_auc']:.4f}: "
          f"{r['test_diff']:+.4f} [{lo:+.4f}, {hi:+.4f}]", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench_tune"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--pruning", action="store_true", help="also the random-sampler studies "
                    "with and without pruning")
    ap.add_argument("--no-study", action="store_true", help="skip the TPE study")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = machine()
    print(f"machine: {m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores, torch "
          f"{m['torch']}", flush=True)
    results: dict = {}
    if not args.no_study:
        results["tpe_median"] = study(args.out / "tpe_median", args.workers, args.trials, [])
    if args.pruning:
        for pruner in ("median", "none"):
            results[f"random_{pruner}"] = study(
                args.out / f"random_{pruner}", args.workers, args.trials,
                ["tune.sampler=random", f"tune.pruner={pruner}"])
    print()
    for name, r in results.items():
        show(name, r)
    if "random_median" in results:
        a, b = results["random_median"], results["random_none"]
        print(f"pruning saved {b['wall_seconds'] - a['wall_seconds']:.0f} s of "
              f"{b['wall_seconds']:.0f} s wall ({1 - a['wall_seconds'] / b['wall_seconds']:.0%})"
              f" and {b['time']['trial_seconds'] - a['time']['trial_seconds']:.0f} "
              f"trial-seconds; best valid AUC {a['best_valid_auc']:.4f} pruned vs "
              f"{b['best_valid_auc']:.4f} unpruned")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m, "date": time.strftime(
            "%Y-%m-%d"), "args": {k: str(v) for k, v in vars(args).items()},
            "results": results}, indent=1))


if __name__ == "__main__":
    main()
