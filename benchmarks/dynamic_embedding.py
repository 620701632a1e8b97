"""The dynamic table's key -> row map (``sampan.embedding.dynamic.KeyIndex``): throughput,
eviction rate and memory, with a Python ``dict`` as the baseline in the same run.

Three parts, in this order:

* **throughput**: a map of ``--live`` keys (10 M), then batches of ``--batch`` ids (100 k):
  Zipf-popular live keys plus ``--new-share`` never-seen ones. ``admit`` (the training
  lookup: counts, admits, inserts, evicts when full) and ``find`` (the read-only lookup of
  evaluation and serving) in ids per second; the same batches through a ``dict`` (``get``
  / ``setdefault`` per id, as code without a vectorised map would do) on a sample;
* **eviction**: rows freed per second by ``evict`` at that size, for each policy;
* **memory** (run first, before the other parts allocate): ``--stream`` (100 M) distinct
  new ids, each in two successive batches, mixed with a Zipf-popular head, through a
  capacity of ``--stream-capacity`` (1 M) rows with admission at two sightings; resident
  memory printed as it goes, which must stay flat;
* **fields**: DeepFM training steps on the built-in Criteo-shaped data at
  ``--fields-batch`` (128) rows, its 26 categorical fields as dynamic tables (one key map
  for all of them, each table as many rows as the field has values) against the same
  fields with fitted vocabularies: the median step of ``--fields-steps`` (300) steps,
  the two interleaved ``--fields-rounds`` (3) times (only with ``--parts fields``).

Usage::

    python benchmarks/dynamic_embedding.py                  # the full sizes (a few minutes)
    python benchmarks/dynamic_embedding.py --quick          # 1 M live, 10 M streamed
    python benchmarks/dynamic_embedding.py --device cuda
    python benchmarks/dynamic_embedding.py --parts fields   # dynamic fields vs vocabularies

Prints the machine (CPU model, ISA flags, threads) first; writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy import machine  # noqa: E402
from sampan.embedding.dynamic import KeyIndex, mix64  # noqa: E402


def rss_mb() -> float:
    """Resident memory now (not the peak), MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def batches(g: np.random.Generator, live: torch.Tensor, n: int, size: int,
            new_share: float, fresh_from: int) -> list[torch.Tensor]:
    """``n`` batches: Zipf(1.1)-popular keys of ``live`` and a share of never-seen keys."""
    out = []
    n_new = int(size * new_share)
    for i in range(n):
        ranks = np.minimum(g.zipf(1.1, size - n_new) - 1, len(live) - 1)
        fresh = torch.arange(fresh_from + i * n_new, fresh_from + (i + 1) * n_new)
        out.append(torch.cat([live[torch.from_numpy(ranks)], mix64(fresh)]))
    return out


def timed(fn, items) -> float:  # type: ignore[no-untyped-def]
    """Seconds for ``fn`` over every item (after the device is idle)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for x in items:
        fn(x)
    sync()
    return time.perf_counter() - t0


def throughput(args: argparse.Namespace, dev: str) -> dict:
    g = np.random.default_rng(0)
    live_keys = mix64(torch.arange(args.live, dtype=torch.int64))  # arbitrary 64-bit keys
    idx = KeyIndex(int(args.live * 1.02), policy="lfu", device=dev)
    step = 0
    t0 = time.perf_counter()
    for b in live_keys.to(dev).split(args.batch):
        idx.admit(b, step)
        step += 1
    fill_s = time.perf_counter() - t0
    work = [b.to(dev) for b in batches(g, live_keys, args.rounds, args.batch, args.new_share,
                                       10**12)]

    def admit(b: torch.Tensor) -> None:
        nonlocal step
        idx.admit(b, step)
        step += 1

    ids = args.rounds * args.batch
    known = [b.to(dev) for b in batches(g, live_keys, args.rounds, args.batch, 0.0, 0)]
    known_s = timed(admit, known)  # every key has its row: lookup and counting only
    admit_s = timed(admit, work)  # fills the headroom, then evicts
    find_s = timed(idx.find, work)
    # the baseline: a dict, one Python call per id, on a sample of the same batches
    table = {int(k): i + 1 for i, k in enumerate(live_keys[: min(args.live, 2_000_000)])}
    sample = [b.cpu().tolist() for b in work[: max(1, args.rounds // 10)]]
    nxt = len(table) + 1

    def dict_admit(b: list[int]) -> None:
        nonlocal nxt
        for k in b:
            if table.setdefault(k, nxt) == nxt:
                nxt += 1

    dict_ids = sum(len(b) for b in sample)
    dict_s = timed(dict_admit, sample)
    dict_find_s = timed(lambda b: [table.get(k, 0) for k in b], sample)
    return {"live_keys": args.live, "batch": args.batch, "new_share": args.new_share,
            "fill_ids_per_s": args.live / fill_s,
            "admit_ids_per_s": ids / admit_s, "find_ids_per_s": ids / find_s,
            "admit_known_ids_per_s": ids / known_s,
            "dict_admit_ids_per_s": dict_ids / dict_s,
            "dict_find_ids_per_s": dict_ids / dict_find_s,
            "live_after": len(idx), "capacity": idx.capacity}


def evictions(args: argparse.Namespace, dev: str) -> dict:
    out = {}
    keys = mix64(torch.arange(args.live, dtype=torch.int64)).to(dev)
    for policy in ("lru", "lfu", "ttl"):
        idx = KeyIndex(args.live, policy=policy, ttl_steps=10, device=dev)
        for s, b in enumerate(keys.split(args.batch)):
            idx.admit(b, s)
        n = args.batch
        reps = 5
        t = timed(lambda _, idx=idx, n=n: idx.evict(n, step=10**9), range(reps))
        out[policy] = {"rows_per_s": n * reps / t, "per_call_ms": 1000 * t / reps,
                       "rows_per_call": n}
    return out


def memory(args: argparse.Namespace, dev: str) -> dict:
    """Batches of a Zipf-popular head and new ids, each new id in two successive batches
    (admitted at its second sighting), until ``--stream`` distinct new ids have passed."""
    g = np.random.default_rng(1)
    idx = KeyIndex(args.stream_capacity, policy="lfu", min_count=2, device=dev)
    head = mix64(torch.arange(-args.stream_capacity, 0))
    n_new = (args.batch * 3) // 8
    steps = args.stream // n_new
    trace, t0 = [], time.perf_counter()
    every = max(1, steps // 10)
    freed = 0
    for s in range(steps + 1):
        ranks = torch.from_numpy(np.minimum(g.zipf(1.1, args.batch - 2 * n_new) - 1,
                                            len(head) - 1))
        fresh = mix64(torch.arange(max(0, s - 1) * n_new, min(s + 1, steps) * n_new))
        freed += len(idx.admit(torch.cat([head[ranks], fresh]).to(dev), s)[1])
        if s % every == 0 or s == steps:
            trace.append({"distinct_ids": min(s + 1, steps) * n_new,
                          "rss_mb": round(rss_mb(), 1), "live": len(idx), "evicted": freed,
                          "seconds": round(time.perf_counter() - t0, 1)})
            print(f"  {trace[-1]['distinct_ids']:>12,} distinct new ids: RSS "
                  f"{trace[-1]['rss_mb']:>7.1f} MB, live rows {trace[-1]['live']:,}, "
                  f"evicted {freed:,}, {trace[-1]['seconds']} s", flush=True)
    seconds = time.perf_counter() - t0
    return {"capacity": args.stream_capacity, "distinct_ids": steps * n_new,
            "ids_per_s": (steps + 1) * args.batch / seconds, "evicted": freed,
            "rss_first_mb": trace[0]["rss_mb"], "rss_last_mb": trace[-1]["rss_mb"],
            "rss_max_mb": max(t["rss_mb"] for t in trace), "trace": trace}


def fields(args: argparse.Namespace, dev: str) -> dict:
    """Median DeepFM step with the built-in data's 26 categorical fields as vocabularies
    and as dynamic tables (interleaved rounds)."""
    import tempfile

    from rich.console import Console

    from sampan.config import load_config
    from sampan.data.store import build_store
    from sampan.data.synthetic import VOCAB_SIZES
    from sampan.models import build_model
    from sampan.train.trainer import Trainer

    trainers = {}
    tmp = Path(tempfile.mkdtemp(prefix="sampan_fields_"))
    for kind in ("vocab", "dynamic"):
        cats: list = [f"C{i + 1}" for i in range(len(VOCAB_SIZES))]
        if kind == "dynamic":
            cats = [{"name": c, "dynamic": {"capacity": v}}
                    for c, v in zip(cats, VOCAB_SIZES, strict=True)]
        raw = {"name": f"fields-{kind}", "seed": 1,
               "data": {"format": "synthetic", "synthetic": {"rows": args.fields_rows}},
               "features": {"label": "label", "categorical": cats,
                            "numeric": [f"I{i}" for i in range(1, 14)]},
               "model": {"name": "deepfm"},
               "train": {"batch_size": args.fields_batch, "device": dev,
                         "progress": False, "tensorboard": False}}
        cfg = load_config(raw=raw)
        store = build_store(cfg, tmp / kind / "data")
        torch.manual_seed(1)
        model = build_model(cfg.model, store.schema)
        trainers[kind] = Trainer(model, cfg, tmp / kind, store.split("train"), None,
                                 console=Console(quiet=True), log_metrics=False)
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for r in range(args.fields_rounds):
        for kind, tr in trainers.items():
            times[kind].append(tr.step_seconds(args.fields_steps))
            print(f"  round {r + 1} {kind:<8} {1000 * times[kind][-1]:6.2f} ms a step "
                  f"({args.fields_batch / times[kind][-1]:,.0f} rows/s)", flush=True)
    best = {k: min(v) for k, v in times.items()}
    return {"batch": args.fields_batch, "fields": len(VOCAB_SIZES), "steps": args.fields_steps,
            "step_ms": {k: [round(1000 * t, 3) for t in v] for k, v in times.items()},
            "rows_per_s": {k: args.fields_batch / t for k, t in best.items()},
            "dynamic_over_vocab": best["dynamic"] / best["vocab"],
            "amp": trainers["vocab"].tc.amp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--new-share", type=float, default=0.05)
    ap.add_argument("--stream", type=int, default=100_000_000)
    ap.add_argument("--stream-capacity", type=int, default=1_000_000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="1 M live keys, 10 M streamed")
    ap.add_argument("--fields-batch", type=int, default=128)
    ap.add_argument("--fields-steps", type=int, default=300)
    ap.add_argument("--fields-rounds", type=int, default=3)
    ap.add_argument("--fields-rows", type=int, default=100_000)
    ap.add_argument("--parts", default="memory,throughput,evictions",
                    help="a comma list of memory, throughput, evictions, fields (training "
                    "steps; not run unless named)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    result: dict = {}
    if args.quick:
        args.live, args.stream, args.rounds = 1_000_000, 10_000_000, 20
    m = machine()
    print(f"machine: {m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores, torch "
          f"{m['torch']} with {m['threads']} threads, device {args.device}")
    # memory first, in a process that holds nothing else yet
    if "memory" in parts:
        print(f"memory: {args.stream:,} distinct ids through a capacity of "
              f"{args.stream_capacity:,} rows")
        mem = result["memory"] = memory(args, args.device)
        print(f"  RSS {mem['rss_first_mb']:.0f} MB at the start, {mem['rss_max_mb']:.0f} MB at "
              f"most, {mem['rss_last_mb']:.0f} MB at the end; {mem['evicted']:,} rows evicted; "
              f"{mem['ids_per_s'] / 1e6:.2f} M ids/s with admission and eviction")
    if "throughput" in parts:
        tp = result["throughput"] = throughput(args, args.device)
        print(f"map of {tp['live_keys']:,} live keys, batches of {tp['batch']:,} ids "
              f"({tp['new_share']:.0%} never seen):")
        print(f"  fill (inserts only)        {tp['fill_ids_per_s'] / 1e6:8.2f} M ids/s")
        print(f"  admit, every key known     {tp['admit_known_ids_per_s'] / 1e6:8.2f} M ids/s")
        print(f"  admit (lookup + insert)    {tp['admit_ids_per_s'] / 1e6:8.2f} M ids/s   "
              f"dict baseline {tp['dict_admit_ids_per_s'] / 1e6:6.2f} M ids/s "
              f"(x{tp['admit_ids_per_s'] / tp['dict_admit_ids_per_s']:.1f})")
        print(f"  find (read-only lookup)    {tp['find_ids_per_s'] / 1e6:8.2f} M ids/s   "
              f"dict baseline {tp['dict_find_ids_per_s'] / 1e6:6.2f} M ids/s "
              f"(x{tp['find_ids_per_s'] / tp['dict_find_ids_per_s']:.1f})")
    if "evictions" in parts:
        ev = result["evictions"] = evictions(args, args.device)
        for policy, r in ev.items():
            print(f"  evict {policy:<4} {r['rows_per_call']:,} rows of {args.live:,}: "
                  f"{r['rows_per_s'] / 1e6:6.2f} M rows/s ({r['per_call_ms']:.0f} ms a call)")
    if "fields" in parts:
        print(f"fields: DeepFM steps at batch {args.fields_batch}, 26 categorical fields as "
              "vocabularies and as dynamic tables")
        f = result["fields"] = fields(args, args.device)
        print(f"  best of {args.fields_rounds} rounds: vocabularies "
              f"{f['rows_per_s']['vocab']:,.0f} rows/s, dynamic tables "
              f"{f['rows_per_s']['dynamic']:,.0f} rows/s: dynamic steps take "
              f"{f['dynamic_over_vocab']:.2f}x the time (amp {f['amp']})")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": m, "device": args.device, **result},
                                             indent=1))


if __name__ == "__main__":
    main()
