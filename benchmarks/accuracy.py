"""Accuracy table: named (config, models) suites on real data, 3 seeds each -> RESULTS.md.

Each suite is one config under ``configs/``; every model of the suite runs on exactly the
data, split and training settings of that config, with the config's model options that the
model understands (embedding size, MLP, dropout, history, ...) and its own defaults for the
rest. Seeds change model initialisation and shuffling, not the split. Reported: mean ± std of
the test metrics over the seeds, training time, the best epoch, hardware and versions.

Small test sets cannot separate models whose AUCs differ by less than their sampling error,
so every AUC also gets the half-width of its 95 % bootstrap interval over the test rows, and
each model is compared with the suite's baseline by a paired bootstrap (the same resampled
rows score both models; the draws of all seeds are pooled). The test predictions behind
these stay in each run directory (``test_predictions.npy``).

Usage (from the repository root, with ``../shared/data`` present)::

    python benchmarks/accuracy.py                      # every suite, seeds 1 2 3 -> RESULTS.md
    python benchmarks/accuracy.py --suites criteo_10k --seeds 1 --out /tmp/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Suite:
    config: str
    models: list[str]
    metrics: list[str]
    about: str
    prepare: str | None = None  # name of a function below that builds the input
    extra: dict[str, dict] = field(default_factory=dict)  # per-model options
    train_extra: dict[str, dict] = field(default_factory=dict)  # per-model train settings
    baseline: str | None = None  # the model every other one is compared with (paired)


SUITES = {
    "criteo_10k": Suite(
        "configs/criteo_deepfm.yaml",
        ["lr", "fm", "deepfm", "wide_deep", "dcn_v2", "xdeepfm", "autoint", "fibinet"],
        ["auc", "logloss"],
        "Criteo Kaggle 10k-line sample: first 75 % train, 5 % valid, last 20 % test.",
        # LR's weights start at zero and are all it has: at the config's lr it is still
        # improving when the epochs run out (test AUC 0.730 at lr 0.001, 0.743 at 0.005)
        train_extra={"lr": {"lr": 0.005}}, baseline="lr"),
    "movielens_ctr": Suite(
        "configs/movielens100k_deepfm.yaml", ["lr", "fm", "deepfm", "dcn_v2", "autoint"],
        ["auc", "logloss", "gauc"],
        "MovieLens-100k, rating >= 4 as click, user and item side features, time split "
        "80/10/10.", train_extra={"lr": {"lr": 0.005}}, baseline="lr"),
    "amazon_beauty_sequences": Suite(
        "configs/amazon_beauty_din.yaml", ["deepfm", "din", "dien", "bst"],
        ["auc", "logloss", "gauc"],
        "Amazon Beauty (S3-Rec): every event with its last 20 items as history plus one "
        "sampled negative (397k samples), random split 80/10/10.",
        prepare="beauty_samples", baseline="deepfm"),
    "movielens_retrieval": Suite(
        "configs/movielens100k_two_tower.yaml", ["two_tower"],
        ["recall@50", "ndcg@50", "pop_recall@50", "pop_ndcg@50"],
        "MovieLens-100k positives (rating >= 4), random split 80/10/10; per user, all "
        "training movies ranked, movies rated in training excluded; pop_* = popularity."),
    "movielens_multitask": Suite(
        "configs/movielens100k_multitask.yaml", ["mmoe", "ple", "esmm"],
        ["auc_0", "auc_1", "logloss_0", "logloss_1"],
        "MovieLens-100k with two labels from the rating: liked (>= 4, task 0) and loved "
        "(= 5, task 1); time split 80/10/10."),
}


def beauty_samples(run_root: Path) -> str:
    from sampan.data.behaviour import BuildOptions, build_sequences

    out = run_root / "beauty_samples.parquet"
    if not out.exists():
        build_sequences(str(ROOT.parent / "shared/data/amazon_s3rec/Beauty.txt.gz"), out,
                        BuildOptions(format="sequence_lines", category=None, action=None,
                                     max_len=20, negatives=1))
    return str(out)


def model_section(base: dict, name: str, extra: dict) -> dict:
    """The config's model options that model ``name`` accepts, plus ``extra``."""
    from sampan.models import get_model_class

    fields = get_model_class(name).Config.model_fields
    return {**{k: v for k, v in base.items() if k in fields and k != "name"},
            "name": name, **extra}


def run_one(suite: Suite, model: str, seed: int, run_root: Path) -> dict:
    from rich.console import Console

    from sampan.config import dump_config, load_config
    from sampan.train.experiment import run_experiment

    os.chdir(ROOT)  # configs name data relative to the repository root
    base = load_config(ROOT / suite.config)
    raw = json.loads(json.dumps(base.model_dump(mode="json")))
    raw["model"] = model_section(raw["model"], model, suite.extra.get(model, {}))
    raw.update(seed=seed, output_dir=str(run_root))
    raw["train"].update(progress=False, tensorboard=False, **suite.train_extra.get(model, {}))
    if suite.prepare:
        raw["data"]["train"] = globals()[suite.prepare](run_root)
    cfg = load_config(raw=raw)
    run_dir = run_root / f"{cfg.name}-{model}-seed{seed}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    res = run_experiment(cfg, run_dir=run_dir, console=Console(quiet=True))
    if auc_metrics(suite):
        save_test_predictions(run_dir)
    # one validation per epoch: steps per epoch = steps / evaluations
    steps_per_epoch = max(1, math.ceil(res["steps"] / max(1, len(_history(run_dir)))))
    return {"test": res["test"], "valid": res.get("valid", {}),
            "train_seconds": res["train_seconds"], "wall_seconds": time.perf_counter() - t0,
            "best_step": res["best_step"], "steps": res["steps"],
            "best_epoch": res["best_step"] / steps_per_epoch, "config": dump_config(cfg),
            "run_dir": str(run_dir), "seed": seed}


def auc_metrics(suite: Suite) -> list[str]:
    """The suite's AUC metrics: ``auc`` (column 0) or ``auc_k`` (task ``k``)."""
    return [k for k in suite.metrics if k == "auc" or k.startswith("auc_")]


def save_test_predictions(run_dir: Path) -> None:
    """Best-model probabilities ``[N, T]`` and labels of the test split, as .npy."""
    import numpy as np

    from sampan.train.experiment import RunArtifacts
    from sampan.train.trainer import probabilities

    art = RunArtifacts(run_dir)
    test = art.store.split("test")
    np.save(run_dir / "test_predictions.npy",
            probabilities(art.evaluator.predict_logits(test)).astype(np.float32))
    np.save(run_dir / "test_labels.npy", np.asarray(test.labels, dtype=np.float32))


RESAMPLES = 1000


def intervals(suite: Suite, runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per model and AUC metric: the mean half-width of the 95 % bootstrap interval over
    the test rows, and the paired difference with the baseline (mean and 95 % interval of
    the pooled per-seed bootstrap differences). Models whose predictions are gone are left
    out."""
    import numpy as np
    import torch

    from sampan.metrics import auc_bootstrap

    boots: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for model, rs in runs.items():
        for r in rs:
            d = Path(r.get("run_dir", ""))
            if not (d / "test_predictions.npy").exists():
                continue
            p, y = np.load(d / "test_predictions.npy"), np.load(d / "test_labels.npy")
            for k in auc_metrics(suite):
                col = 0 if k == "auc" else int(k.split("_")[1])
                # the same resamples for every model and seed: the rows are the same
                b = auc_bootstrap(torch.from_numpy(p[:, col]), torch.from_numpy(y[:, col]),
                                  RESAMPLES, seed=0).numpy()
                boots.setdefault(model, {}).setdefault(k, {})[r["seed"]] = b
    out: dict[str, dict] = {}
    for model, per_metric in boots.items():
        for k, by_seed in per_metric.items():
            half = [float(np.nanpercentile(b, 97.5) - np.nanpercentile(b, 2.5)) / 2
                    for b in by_seed.values()]
            entry = {"ci95_half_width": float(np.mean(half))}
            base = boots.get(suite.baseline or "", {}).get(k, {})
            seeds = sorted(set(by_seed) & set(base))
            if suite.baseline and model != suite.baseline and seeds:
                diff = np.concatenate([by_seed[sd] - base[sd] for sd in seeds])
                diff = diff[~np.isnan(diff)]
                entry.update(vs=suite.baseline, diff_mean=float(diff.mean()),
                             diff_ci95=[float(np.percentile(diff, 2.5)),
                                        float(np.percentile(diff, 97.5))],
                             p_better=float((diff > 0).mean()))
            out.setdefault(model, {})[k] = entry
    return out


def _history(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "valid"]


def machine() -> dict:
    import torch

    import sampan
    from sampan.layers.kernels import cpu_info

    info = cpu_info()
    return {"cpu": info["name"], "cpu_family": info["family"], "cpu_model": info["model"],
            "isa": info["isa"], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "sampan": getattr(sampan, "__version__", "?"),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def peak_rss_mb() -> float:
    """This process's own peak RSS: Linux's VmHWM, of this program's memory only (getrusage's
    maxrss also keeps the high-water mark of the parent that forked it, carried across exec,
    so a worker spawned by a driver that had grown would report the driver's peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux


def fmt(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# Sampan accuracy results", "",
             "Generated by `" + report["command"] + "` on " + report["date"] + " — do not "
             "edit by hand. Mean ± standard deviation over seeds "
             f"{', '.join(map(str, report['seeds']))} (the seed sets model initialisation and "
             "shuffling; the split is fixed by the config).", "",
             f"Hardware: {m['cpu']}, {m['cores']} cores ({m['threads']} torch threads)"
             + (f", GPU {m['cuda']}" if m["cuda"] else ", no GPU") + f". Python {m['python']}, "
             f"PyTorch {m['torch']}, Sampan {m['sampan']}.", ""]
    for name, s in report["suites"].items():
        suite = SUITES[name]
        lines += [f"## {name}", "", suite.about, "",
                  f"Config: `{suite.config}`; each model keeps the options of that config it "
                  "understands and its own defaults for the rest."
                  + "".join(f" {m}: {', '.join(f'train.{k}={v}' for k, v in t.items())}."
                            for m, t in suite.train_extra.items()), ""]
        iv = report.get("intervals", {}).get(name, {})
        aucs = [k for k in auc_metrics(suite) if iv]
        if aucs:
            lines += [f"± = half the width of the 95 % bootstrap interval of the test AUC over "
                      f"the test rows ({RESAMPLES} resamples, averaged over the seeds)."
                      + (f" Δ = paired bootstrap difference with {suite.baseline}: mean "
                         "[2.5 %, 97.5 %], the seeds' draws pooled; an interval that holds 0 "
                         "means this test set cannot tell the two models apart."
                         if suite.baseline else ""), ""]
        head = ["model"]
        for k in suite.metrics:
            head.append(f"test {k}")
            if k in aucs:
                head.append("± (rows)")
                if suite.baseline:
                    head.append(f"Δ {k} vs {suite.baseline}")
        head += ["train s", "best epoch"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for model, runs in s.items():
            cells = [model]
            for k in suite.metrics:
                cells.append(fmt([r["test"].get(k, math.nan) for r in runs]))
                if k in aucs:
                    e = iv.get(model, {}).get(k, {})
                    cells.append(f"{e['ci95_half_width']:.4f}" if e else "-")
                    if suite.baseline:
                        cells.append(f"{e['diff_mean']:+.4f} [{e['diff_ci95'][0]:+.4f}, "
                                     f"{e['diff_ci95'][1]:+.4f}]" if "diff_mean" in e else "-")
            cells += [f"{statistics.mean(r['train_seconds'] for r in runs):.1f}",
                      f"{statistics.mean(r['best_epoch'] for r in runs):.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def kept_sections(path: Path) -> str:
    """The blocks other benchmarks write into the same file (``perf:defaults`` and
    ``perf:defaults_fresh``, by benchmarks/defaults.py through ``_readme.update_block``),
    carried over when this table is regenerated: every ``<!-- perf:NAME -->`` ...
    ``<!-- /perf:NAME -->`` block, in file order."""
    old = path.read_text() if path.exists() else ""
    blocks = [m.group(0) for m in re.finditer(
        r"<!-- perf:([\w.-]+) -->.*?<!-- /perf:\1 -->", old, flags=re.S)]
    return "".join("\n" + b + "\n" for b in blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suites", nargs="*", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--models", nargs="*", default=None, help="only these models")
    ap.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3])
    ap.add_argument("--out", default=str(ROOT / "RESULTS.md"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/accuracy.json"))
    ap.add_argument("--runs", default=str(ROOT / "runs/bench_accuracy"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the other suites / models of the existing --json report")
    args = ap.parse_args()
    if not (ROOT.parent / "shared/data").exists():
        sys.exit("../shared/data is not present: the accuracy suites use the real datasets")
    run_root = Path(args.runs).resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(["python benchmarks/accuracy.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "seeds": args.seeds, "machine": machine(),
              "suites": {}}
    if args.merge and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        report["suites"] = old["suites"]
        report["intervals"] = old.get("intervals", {})  # the suites not run again keep theirs
        report["command"] = old["command"] + "; then " + report["command"]
    for name in args.suites:
        suite = SUITES[name]
        report["suites"].setdefault(name, {})
        for model in suite.models:
            if args.models and model not in args.models:
                continue
            runs = []
            for seed in args.seeds:
                r = run_one(suite, model, seed, run_root)
                shown = " ".join(f"{k} {r['test'].get(k, math.nan):.4f}" for k in suite.metrics)
                print(f"{name:<24} {model:<10} seed {seed}: {shown}  "
                      f"({r['train_seconds']:.1f} s train)", flush=True)
                runs.append(r)
            report["suites"][name][model] = runs
        if auc_metrics(suite):
            found = intervals(suite, report["suites"][name])
            report.setdefault("intervals", {}).setdefault(name, {}).update(found)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    Path(args.out).write_text(markdown(report) + "\n" + kept_sections(Path(args.out)))
    print(f"wrote {args.out} and {args.json}")


if __name__ == "__main__":
    main()
