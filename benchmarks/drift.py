"""Dynamic tables against a vocabulary fixed at launch and against hashing, on the drifting
built-in data (``data.synthetic.drift``): the item 5 comparison of issue 16.

The rows are a stream whose popular ids move along (drift 1.0: by the end every field's
head is a whole vocabulary further on), or whose ids come and go (``--churn``: each
popularity rank's id is replaced by a new one that many times), or both. Split in order:
the first 60 % train, 10 % valid, the last 30 % test (the later periods). The same model
(DeepFM by default) with its 26 categorical fields as

* (a) ``vocab``: a vocabulary fitted on the first period (``features.fit_rows``: the first
  third of the train rows), as a vocabulary fixed at launch;
* (b) ``hashing``: every value hashed into as many rows as (c) has;
* (c) ``dynamic``: a dynamic table of that capacity (admitted at 2 sightings, LRU).

Each field's capacity is its vocabulary size in the generator (the ids live at one time).
Prints test AUC, the oracle's, and paired bootstrap intervals of (c) - (a) and (c) - (b);
records the machine.

Usage::

    python benchmarks/drift.py                       # 300,000 rows
    python benchmarks/drift.py --rows 100000 --model fm
    python benchmarks/drift.py --drift 0 --churn 1.0
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import machine  # noqa: E402
from sampan.config import load_config  # noqa: E402
from sampan.config.load import PRESETS  # noqa: E402
from sampan.data.synthetic import VOCAB_SIZES, stream_ids  # noqa: E402
from sampan.train.experiment import RunArtifacts, compare_runs, run_experiment  # noqa: E402


def features_of(variant: str, drift: float = 0.0, churn: float = 0.0) -> dict:
    """The Criteo preset's features with the 26 categorical fields as ``variant`` (vocab,
    hashing, dynamic or unbounded) for a stream of this drift and churn."""
    features = copy.deepcopy(PRESETS["criteo"]()["features"])
    cats = []
    for c in features["categorical"]:
        if isinstance(c, str) and c.startswith("C"):
            cap = VOCAB_SIZES[int(c[1:]) - 1]
            c = {"hashing": {"name": c, "vocab": False, "hash_buckets": cap},
                 "dynamic": {"name": c, "dynamic": {"capacity": cap, "admit": {"min_count": 2},
                                                    "evict": {"policy": "lru"}}},
                 # a row for every id the stream will ever hold, from its first sighting:
                 # what (c) would do with no memory limit and no admission threshold
                 # (+ 1: the key a missing value becomes)
                 "unbounded": {"name": c,
                               "dynamic": {"capacity": stream_ids(cap, drift, churn) + 1}},
                 "vocab": c}[variant]
        cats.append(c)
    features["categorical"] = cats
    return features


def config(args: argparse.Namespace, variant: str) -> dict:
    features = features_of(variant, args.drift, args.churn)
    train_rows = int(args.rows * 0.6)
    if variant == "vocab":
        features["fit_rows"] = train_rows // 3
    return {"name": f"drift_{variant}", "preset": "criteo",
            "output_dir": str(args.out),
            "data": {"format": "synthetic",
                     "synthetic": {"rows": args.rows, "drift": args.drift,
                                   "churn": args.churn},
                     "split": {"method": "sequential", "train": 0.6, "valid": 0.1,
                               "test": 0.3}},
            "features": features, "model": {"name": args.model},
            "train": {"progress": False, "tensorboard": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--drift", type=float, default=1.0)
    ap.add_argument("--churn", type=float, default=0.0,
                    help="ids come and go: each rank's id is replaced this many times")
    ap.add_argument("--model", default="deepfm")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_drift"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = machine()
    print(f"machine: {m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores, torch "
          f"{m['torch']}")
    results, runs = {}, {}
    for variant in ("vocab", "hashing", "dynamic"):
        run = args.out / variant
        r = run_experiment(load_config(raw=config(args, variant)), run_dir=run)
        results[variant], runs[variant] = r["test"], RunArtifacts(run)
    oracle = results["dynamic"]["oracle_auc"]
    print(f"\n{args.model}, {args.rows:,} rows, drift {args.drift}, churn {args.churn}; "
          f"test = the last 30 % (oracle AUC {oracle:.4f})")
    for variant, r in results.items():
        print(f"  ({'abc'[list(results).index(variant)]}) {variant:<8} test AUC "
              f"{r['auc']:.4f}  gap to the oracle {oracle - r['auc']:.4f}")
    out = {"machine": m, "args": {k: str(v) for k, v in vars(args).items()},
           "results": results, "comparisons": {}}
    for base in ("vocab", "hashing"):
        c = compare_runs(runs[base], runs["dynamic"])
        out["comparisons"][f"dynamic-{base}"] = c
        lo, hi = c["diff_ci95"]
        print(f"  dynamic - {base:<8} {c['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] (paired "
              f"bootstrap, {c['resamples']} resamples)")
    gap_a = oracle - results["vocab"]["auc"]
    closed = (results["dynamic"]["auc"] - results["vocab"]["auc"]) / gap_a if gap_a else 0
    print(f"  dynamic closes {closed:.0%} of (a)'s gap to the oracle")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
