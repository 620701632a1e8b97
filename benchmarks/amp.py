"""Precision benchmark: ``train.amp: auto`` against fp32 (``train.amp: none``) on the
defaults benchmark's datasets and worlds, every model, the same seeds and the same test rows.

``auto`` trains in bf16 autocast on hardware that multiplies bf16 natively (a CPU with AMX or
AVX512-BF16, a GPU that supports it) and in fp32 elsewhere, so this benchmark only says
something on such hardware: it stops with a message on any other. Both runs of a pair take
every other option from the package defaults (the configs are
:func:`defaults.config_for`'s), but one: the warm start's LR fit has no time bound
(``train.first_order_seconds: null``). Its default bound is a third of the training's
estimated time, which bf16 shortens and which moves with the machine's load; where it binds
(the largest world) the two runs would start from different LRs, and the difference would be
the budget's, not the precision's (``--keep-budget`` keeps the default bound). For each row
it prints the test AUC of both, the paired bootstrap interval of ``auto - fp32`` (1,000
resamples of the test rows; with several seeds, each seed's pair is differenced and the
draws are pooled, as in ``benchmarks/defaults.py``), and the wall time of each run
(training, warm start and evaluation).

Verdicts: *higher* or *level* where the interval lies above 0 or holds it; *lower, within
0.001* where it lies below 0 but above -``MARGIN``: a paired interval of one seed's two
runs is very narrow (they start alike and part only by rounding), so a difference of 0.0001
can lie outside it; *lower* beyond both. One seed's two runs can also part far, by the
trajectory alone, on a model whose AUC moves by several thousandths with its seed, so a
row found *lower* at one seed is run again with seeds 1-3 (the first seed's figures are
kept under ``first_seed``), and the pooled interval, which holds the seeds' spread, decides.
``auto`` is the default for a model only where no row is *lower*.

Usage (from the repository root)::

    python benchmarks/amp.py                              # everything -> RESULTS.md section
    python benchmarks/amp.py --only criteo_10k world_small_mixed --models deepfm
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _readme import update_block  # noqa: E402
from accuracy import machine  # noqa: E402
from defaults import (  # noqa: E402
    RESAMPLES,
    WORLDS,
    Dataset,
    dataset_args,
    prepared,
    run_sampan,
    seeds_for,
)

PRECISIONS = {"fp32": "train.amp=none", "auto": "train.amp=auto"}
MARGIN = 0.001  # AUC: auto may not be lower than fp32 by this much (non-inferiority)
# the same LR start in both runs of a pair (see the module docstring)
SAME_START = ["train.first_order_seconds=null"]


def paired_runs(fp32: list[dict[str, Any]], auto: list[dict[str, Any]],
                labels: np.ndarray) -> dict[str, Any]:
    """``AUC(auto) - AUC(fp32)`` over seed pairs: each seed's two runs see the same
    bootstrap resamples of the test rows, and the seeds' differences are pooled."""
    import torch

    from sampan.metrics import auc, auc_bootstrap

    y = torch.from_numpy(labels)
    draws = []
    for a, b in zip(fp32, auto, strict=True):
        da, db = auc_bootstrap(a["logits"], y, RESAMPLES), auc_bootstrap(b["logits"], y, RESAMPLES)
        draws.append((db - da)[~(da.isnan() | db.isnan())])
    d = torch.cat(draws)
    auc_a = [auc(r["logits"], y) for r in fp32]
    auc_b = [auc(r["logits"], y) for r in auto]
    lo, hi = (float(q) for q in torch.quantile(d, torch.tensor([0.025, 0.975],
                                                                dtype=torch.float64)))
    return {"fp32": float(np.mean(auc_a)), "auto": float(np.mean(auc_b)),
            "fp32_runs": auc_a, "auto_runs": auc_b,
            "diff": float(np.mean(auc_b) - np.mean(auc_a)), "diff_ci95": [lo, hi],
            "verdict": verdict(lo, hi)}


def verdict(lo: float, hi: float) -> str:
    """The row's word: level (the interval holds 0), higher, lower within the margin, or
    lower (beyond it: auto does not hold)."""
    if lo > 0:
        return "higher"
    if hi >= 0:
        return "level"
    return f"lower, within {MARGIN}" if lo > -MARGIN else "**lower**"


def evaluate_dataset(ds: Dataset, run_root: Path, models: list[str] | None,
                     seeds: str, overrides: list[str]) -> dict[str, Any]:
    import pyarrow.parquet as pq

    rows = {s: pq.read_metadata(p).num_rows for s, p in ds.files.items()}
    labels = pq.read_table(ds.files["test"], columns=["label"]).column("label").to_numpy() \
        .astype(np.float32)
    print(f"== {ds.name}: {ds.about}", flush=True)
    out: dict[str, Any] = {"about": ds.about, "rows": rows, "models": {}}
    for model in ds.models:
        if models and model not in models:
            continue
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PRECISIONS}
        for seed in seeds_for(rows["train"], seeds):
            for p, override in PRECISIONS.items():  # interleaved: drift hits both alike
                r = run_sampan(ds, model, run_root / p, seed, [*overrides, override])
                if not np.array_equal(r["labels"], labels):
                    raise SystemExit(f"{ds.name}/{model}: the run's test rows differ from the "
                                     "file's; a paired comparison needs the same rows")
                runs[p].append(r)
        entry = paired_runs(runs["fp32"], runs["auto"], labels)
        if entry["verdict"] == "**lower**" and len(runs["fp32"]) == 1:
            print(f"   {model:<8} lower at one seed ({entry['diff']:+.4f}): seeds 1-3 decide",
                  flush=True)
            first = entry
            for seed in (2, 3):
                for p, override in PRECISIONS.items():
                    runs[p].append(run_sampan(ds, model, run_root / p, seed,
                                              [*overrides, override]))
            entry = paired_runs(runs["fp32"], runs["auto"], labels)
            entry["first_seed"] = {k: first[k] for k in ("fp32", "auto", "diff", "diff_ci95")}
        entry |= {"seeds": len(runs["fp32"]),
                  "best_step": {p: [r["best_step"] for r in rs] for p, rs in runs.items()},
                  "seconds": {p: round(float(np.mean([r["seconds"] for r in rs])), 1)
                              for p, rs in runs.items()},
                  "steps": {p: [r["steps"] for r in rs] for p, rs in runs.items()}}
        out["models"][model] = entry
        lo, hi = entry["diff_ci95"]
        print(f"   {model:<8} fp32 {entry['fp32']:.4f}  auto {entry['auto']:.4f}  "
              f"diff {entry['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}]"
              f"  {entry['verdict']}  "
              f"{entry['seconds']['fp32']:.1f} s / {entry['seconds']['auto']:.1f} s", flush=True)
    return out


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = ["### Training precision: `train.amp: auto` (bf16 here) against fp32\n",
             f"`{report['command']}` ({report['date']}; {m['cpu']}, {m['cores']} cores, "
             f"torch {m['torch']}; auto chose: {report['amp']}). Test AUC of each model with "
             "the package defaults in both precisions, the same seeds and test rows; the "
             "interval is the paired bootstrap of auto - fp32 (1,000 resamples; seeds "
             "pooled where there are several); evaluation in fp32 in both (the JSON keeps each "
             "run's wall seconds; speed is `benchmarks/train_throughput.py`'s to measure). "
             + ("Both runs fit their LR warm start without a time bound, so that they start "
                "from the same LR. " if report.get("same_start") else "")
             + "\n",
             "| dataset | model | seeds | fp32 AUC | auto AUC | auto - fp32 [95 %] | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, d in report["datasets"].items():
        for model, e in d["models"].items():
            lo, hi = e["diff_ci95"]
            lines.append(f"| {name} | {model} | {e['seeds']} | {e['fp32']:.4f} | "
                         f"{e['auto']:.4f} | {e['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                         f"{verdict(lo, hi)} |")
    worse = sorted({f"{m} ({n})" for n, d in report["datasets"].items()
                    for m, e in d["models"].items() if verdict(*e["diff_ci95"]) == "**lower**"})
    lines.append("\n" + ("auto was lower than fp32 on no row (lower beyond the interval "
                          f"and by {MARGIN} AUC or more)." if not worse else
                          "auto was lower on: " + ", ".join(worse) + "."))
    again = [f"{m} ({n}): {e['first_seed']['diff']:+.4f} [{e['first_seed']['diff_ci95'][0]:+.4f}, "
             f"{e['first_seed']['diff_ci95'][1]:+.4f}] at seed 1"
             for n, d in report["datasets"].items() for m, e in d["models"].items()
             if "first_seed" in e]
    if again:
        lines.append("Lower at one seed, so run with seeds 1-3 (the row shows those): "
                     + "; ".join(again) + ".")
    return "\n".join(lines)


def main() -> None:
    import torch

    from sampan.train.compute import bf16_hardware

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = dataset_args(ap, "runs per model and precision, seeds 1..N (auto: as the "
                         "defaults benchmark)", "a config override for both runs of every "
                         "pair, as `sampan train --set`")
    ap.add_argument("--keep-budget", action="store_true",
                    help="keep the warm start's default time bound (by default both runs fit "
                    "their LR start without one, so that they start alike)")
    ap.add_argument("--runs", default=str(ROOT / "runs/bench_amp"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/amp.json"))
    ap.add_argument("--out", default=str(ROOT / "RESULTS.md"))
    ap.add_argument("--merge", action="store_true", help="keep the other datasets of --json")
    ap.add_argument("--render", action="store_true", help="train nothing: rewrite the "
                    "RESULTS.md section from --json")
    args = ap.parse_args()
    if args.render:
        update_block(Path(args.out), "amp", markdown(json.loads(Path(args.json).read_text())),
                     after="<!-- /perf:defaults_fresh")
        return
    ok, why = bf16_hardware(torch.device("cpu"))
    if not ok:
        raise SystemExit(f"amp: auto trains in fp32 on this machine ({why}); this benchmark "
                         "needs a CPU with AMX or AVX512-BF16")
    run_root = Path(args.runs).resolve()
    if not args.keep_budget:
        args.overrides = SAME_START + args.overrides
    report: dict[str, Any] = {"command": " ".join(["python benchmarks/amp.py", *sys.argv[1:]]),
                              "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                              "amp": f"bf16, {why}", "same_start": not args.keep_budget,
                              "datasets": {}}
    if args.merge and Path(args.json).exists():
        report["datasets"] = json.loads(Path(args.json).read_text())["datasets"]
    todo = args.only or names

    def evaluate(name: str, ds: Dataset) -> None:
        report["datasets"][name] = evaluate_dataset(ds, run_root, args.models, args.seeds,
                                                    args.overrides)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        update_block(Path(args.out), "amp", markdown(report), after="<!-- /perf:defaults_fresh")

    for name, ds in prepared(todo, WORLDS, run_root):
        evaluate(name, ds)
    print(f"wrote {args.json} and the amp section of {args.out}")


if __name__ == "__main__":
    main()
