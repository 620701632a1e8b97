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

The ranking models (``--ranked``: the two-tower on MovieLens-100K, SASRec and HSTU on
Amazon Beauty, their shipped configs) are compared on their headline metric (Recall@K,
NDCG@K) over the test users, bf16 (``train.amp=bf16``) against fp32, whatever ``auto``
chooses for them: their rows say whether bf16 may be their default. The interval is the
paired bootstrap over the users (each user's metric in both runs of a seed, as ``sampan
compare``), seeds pooled as above; the same verdicts, with the same margin of 0.001.

Usage (from the repository root)::

    python benchmarks/amp.py                              # everything -> RESULTS.md section
    python benchmarks/amp.py --only criteo_10k world_small_mixed --models deepfm
    python benchmarks/amp.py --only --ranked beauty_hstu --seeds 3 --merge
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _readme import update_block  # noqa: E402
from accuracy import machine  # noqa: E402
from defaults import (  # noqa: E402
    DATA,
    RESAMPLES,
    WORLDS,
    Dataset,
    dataset_args,
    prepared,
    run_sampan,
    seeds_for,
)

PRECISIONS = {"fp32": "train.amp=none", "auto": "train.amp=auto"}
# the ranking models: bf16 against fp32, whatever auto picks for them today
RANKED_PRECISIONS = {"fp32": "train.amp=none", "bf16": "train.amp=bf16"}
RANKED = {  # name: (config, overrides, what it is)
    "ml100k_two_tower": ("configs/movielens100k_two_tower.yaml", [],
                         "MovieLens-100K ratings >= 4, random 80/10/10; Recall@50 per user"),
    "beauty_sasrec": ("configs/amazon_beauty_sasrec.yaml", [],
                      "Amazon Beauty (S3-Rec), leave-one-out; NDCG@10 per user"),
    "beauty_hstu": ("configs/amazon_beauty_sasrec.yaml", ["model.name=hstu", "model.heads=2"],
                    "Amazon Beauty (S3-Rec), leave-one-out; NDCG@10 per user"),
}
BEAUTY = DATA / "amazon_s3rec/Beauty.txt.gz"
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


def decided(precisions: dict[str, str], seeds: list[int],
            run: Callable[[str, int, str], dict[str, Any]],
            pair: Callable[[dict[str, list[dict[str, Any]]]], dict[str, Any]],
            label: str) -> dict[str, Any]:
    """One row: ``run(precision, seed, override)`` for both precisions at each seed
    (interleaved: drift hits both alike), then ``pair`` of the runs. A row lower at its one
    seed is run again at seeds 2-3 and the pooled pair decides; the first seed's figures
    are kept under ``first_seed``."""
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in precisions}

    def train(seed: int) -> None:
        for p, override in precisions.items():
            runs[p].append(run(p, seed, override))

    for seed in seeds:
        train(seed)
    entry = pair(runs)
    a, b = precisions
    if entry["verdict"] == "**lower**" and len(seeds) == 1:
        print(f"   {label} lower at one seed ({entry['diff']:+.4f}): seeds 1-3 decide",
              flush=True)
        first = entry
        for seed in (2, 3):
            train(seed)
        entry = pair(runs)
        entry["first_seed"] = {k: first[k] for k in (a, b, "diff", "diff_ci95")}
    entry |= {"seeds": len(runs[a]),
              "best_step": {p: [r["best_step"] for r in rs] for p, rs in runs.items()},
              "seconds": {p: round(float(np.mean([r["seconds"] for r in rs])), 1)
                          for p, rs in runs.items()},
              "steps": {p: [r["steps"] for r in rs] for p, rs in runs.items()}}
    return entry


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

        def run(p: str, seed: int, override: str, model: str = model) -> dict[str, Any]:
            r = run_sampan(ds, model, run_root / p, seed, [*overrides, override])
            if not np.array_equal(r["labels"], labels):
                raise SystemExit(f"{ds.name}/{model}: the run's test rows differ from the "
                                 "file's; a paired comparison needs the same rows")
            return r

        entry = decided(PRECISIONS, seeds_for(rows["train"], seeds), run,
                        lambda runs: paired_runs(runs["fp32"], runs["auto"], labels),
                        f"{model:<8}")
        out["models"][model] = entry
        lo, hi = entry["diff_ci95"]
        print(f"   {model:<8} fp32 {entry['fp32']:.4f}  auto {entry['auto']:.4f}  "
              f"diff {entry['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}]"
              f"  {entry['verdict']}  "
              f"{entry['seconds']['fp32']:.1f} s / {entry['seconds']['auto']:.1f} s", flush=True)
    return out


def ranked_input(name: str) -> bool:
    """Make the row's input where the config expects it (Beauty's events from the S3-Rec
    file, as the config's comment says); False where ``../shared/data`` lacks it."""
    config = ROOT / RANKED[name][0]
    if "beauty" in name:
        events = ROOT / "runs/beauty_events.parquet"
        if not events.exists():
            if not BEAUTY.exists():
                return False
            from sampan.data.behaviour import BuildOptions, build_sequences

            events.parent.mkdir(parents=True, exist_ok=True)
            build_sequences(str(BEAUTY), events, BuildOptions(format="sequence_lines",
                                                              max_len=50))
        return True
    return (DATA / "movielens/ml-100k/u.data").exists() and config.exists()


def run_ranked(name: str, run_root: Path, seed: int, overrides: list[str]
               ) -> dict[str, Any]:
    """Train one ranking run and score its test users: ``(users, names, [Q, metrics])``
    as ``sampan compare`` pairs them, with the run's headline metric and its seconds."""
    import shutil

    from rich.console import Console

    from sampan.config import load_config
    from sampan.train.experiment import RunArtifacts, _query_metrics, run_experiment

    config, extra, _ = RANKED[name]
    cfg = load_config(ROOT / config, overrides=[*extra, f"seed={seed}", *overrides])
    run_dir = run_root / name / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    res = run_experiment(cfg, run_dir=run_dir, console=Console(quiet=True))
    art = RunArtifacts(run_dir)
    task = art.evaluator.task
    users, names, per_query = _query_metrics(art, "test", tuple(task.cutoffs))
    return {"users": users, "names": names, "per_query": per_query,
            "metric": task.default_metric, "steps": res["steps"],
            "best_step": res["best_step"], "seconds": time.perf_counter() - t0,
            "amp_auto": getattr(art.model, "amp_auto", "bf16")}


def paired_ranked(fp32: list[dict[str, Any]], bf16: list[dict[str, Any]]) -> dict[str, Any]:
    """bf16 - fp32 of the headline metric over seed pairs: each seed's two runs differenced
    user by user and resampled over the users, the seeds' draws pooled."""
    from sampan.tasks.next_item import _resampled_means

    draws, vals = [], {"fp32": [], "bf16": []}
    metric = fp32[0]["metric"]
    for a, b in zip(fp32, bf16, strict=True):
        if not np.array_equal(a["users"], b["users"]):
            raise SystemExit(f"{metric}: the two runs of a seed ranked different users")
        j = a["names"].index(metric)
        qa, qb = a["per_query"][:, j], b["per_query"][:, j]
        draws.append(_resampled_means((qb - qa)[:, None], RESAMPLES, 0)[:, 0])
        vals["fp32"].append(float(qa.mean()))
        vals["bf16"].append(float(qb.mean()))
    lo, hi = (float(q) for q in np.quantile(np.concatenate(draws), [0.025, 0.975]))
    diff = float(np.mean(vals["bf16"]) - np.mean(vals["fp32"]))
    return {"metric": metric, "fp32": float(np.mean(vals["fp32"])),
            "bf16": float(np.mean(vals["bf16"])), "fp32_runs": vals["fp32"],
            "bf16_runs": vals["bf16"], "diff": diff, "diff_ci95": [lo, hi],
            "verdict": verdict(lo, hi), "queries": int(len(fp32[0]["users"])),
            "auto_chooses": fp32[0]["amp_auto"]}


def evaluate_ranked(name: str, run_root: Path, seeds: str, overrides: list[str]
                    ) -> dict[str, Any]:
    """One ranking row: seed 1 (or 1..N with ``--seeds N``), seeds 2-3 added where seed 1
    finds bf16 lower, as for the AUC rows."""
    print(f"== {name}: {RANKED[name][2]}", flush=True)
    n = 1 if seeds == "auto" else int(seeds)
    entry = decided(RANKED_PRECISIONS, list(range(1, n + 1)),
                    lambda p, seed, override: run_ranked(name, run_root / p, seed,
                                                         [*overrides, override]),
                    lambda runs: paired_ranked(runs["fp32"], runs["bf16"]), "  ")
    entry |= {"about": RANKED[name][2]}
    lo, hi = entry["diff_ci95"]
    print(f"   {entry['metric']} fp32 {entry['fp32']:.4f}  bf16 {entry['bf16']:.4f}  "
          f"diff {entry['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}]  {entry['verdict']}  "
          f"{entry['seconds']['fp32']:.1f} s / {entry['seconds']['bf16']:.1f} s", flush=True)
    return entry


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
    ranked = report.get("ranked") or {}
    if ranked:
        lines += ["\nThe ranking models, bf16 (`train.amp=bf16`) against fp32, whatever "
                  "`auto` chooses for them (the last column): the test users' headline "
                  "metric, the interval the paired bootstrap over the users (each user's "
                  "metric in both runs of a seed; seeds pooled where there are several).\n",
                  "| data | model | seeds | metric | fp32 | bf16 | bf16 - fp32 [95 %] | "
                  "verdict | `auto` trains in |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, e in ranked.items():
            lo, hi = e["diff_ci95"]
            data, model = name.split("_", 1)
            lines.append(f"| {data} | {model} | {e['seeds']} | {e['metric']} | "
                         f"{e['fp32']:.4f} | {e['bf16']:.4f} | {e['diff']:+.4f} "
                         f"[{lo:+.4f}, {hi:+.4f}] | {e['verdict']} | "
                         f"{'fp32' if e['auto_chooses'] == 'none' else 'bf16'} |")
        how: dict[str, list[str]] = {}
        for name, e in ranked.items():
            m = e.get("machine") or report["machine"]
            how.setdefault(f"`{e.get('command', report['command'])}` ({e.get('date', '?')}; "
                           f"{m['cpu']}, {m['cores']} cores, torch {m['torch']})", []).append(
                name)
        lines.append("\n" + "; ".join(f"{', '.join(names)}: {h}" for h, names in how.items())
                     + ".")
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
    ap.add_argument("--ranked", nargs="*", default=None, choices=list(RANKED),
                    help="the ranking rows to run (default: all, when no --only is given)")
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
    # where and how: the AUC table's (kept from --json when this call adds no AUC row)
    # and each ranking row's own
    here = {"command": " ".join(["python benchmarks/amp.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d"), "machine": machine(), "amp": f"bf16, {why}"}
    report: dict[str, Any] = {**here, "same_start": not args.keep_budget, "datasets": {},
                              "ranked": {}}
    if args.merge and Path(args.json).exists():
        kept = json.loads(Path(args.json).read_text())
        report.update({k: kept[k] for k in (*here, "same_start") if k in kept})
        report["datasets"], report["ranked"] = kept["datasets"], kept.get("ranked", {})
    todo = names if args.only is None else args.only
    ranked = list(RANKED) if args.ranked is None and args.only is None else args.ranked or []

    def evaluate(name: str, ds: Dataset) -> None:
        report["datasets"][name] = evaluate_dataset(ds, run_root, args.models, args.seeds,
                                                    args.overrides)
        report.update(here, same_start=not args.keep_budget)
        save()

    def save() -> None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        update_block(Path(args.out), "amp", markdown(report), after="<!-- /perf:defaults_fresh")

    for name, ds in prepared(todo, WORLDS, run_root):
        evaluate(name, ds)
    os.chdir(ROOT)  # the shipped configs name their data from the repository root
    for name in ranked:
        if not ranked_input(name):
            print(f"skipping {name}: its data is not in ../shared/data")
            continue
        report["ranked"][name] = evaluate_ranked(name, run_root / "ranked", args.seeds,
                                                 args.overrides) | here
        save()
    print(f"wrote {args.json} and the amp section of {args.out}")


if __name__ == "__main__":
    main()
