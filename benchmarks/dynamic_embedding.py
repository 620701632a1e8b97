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
  memory printed as it goes, which must stay flat.

Usage::

    python benchmarks/dynamic_embedding.py                  # the full sizes (a few minutes)
    python benchmarks/dynamic_embedding.py --quick          # 1 M live, 10 M streamed
    python benchmarks/dynamic_embedding.py --device cuda

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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.live, args.stream, args.rounds = 1_000_000, 10_000_000, 20
    m = machine()
    print(f"machine: {m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores, torch "
          f"{m['torch']} with {m['threads']} threads, device {args.device}")
    # memory first, in a process that holds nothing else yet
    print(f"memory: {args.stream:,} distinct ids through a capacity of "
          f"{args.stream_capacity:,} rows")
    mem = memory(args, args.device)
    print(f"  RSS {mem['rss_first_mb']:.0f} MB at the start, {mem['rss_max_mb']:.0f} MB at most, "
          f"{mem['rss_last_mb']:.0f} MB at the end; {mem['evicted']:,} rows evicted; "
          f"{mem['ids_per_s'] / 1e6:.2f} M ids/s with admission and eviction")
    tp = throughput(args, args.device)
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
    ev = evictions(args, args.device)
    for policy, r in ev.items():
        print(f"  evict {policy:<4} {r['rows_per_call']:,} rows of {args.live:,}: "
              f"{r['rows_per_s'] / 1e6:6.2f} M rows/s ({r['per_call_ms']:.0f} ms a call)")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": m, "device": args.device,
                                              "throughput": tp, "evictions": ev,
                                              "memory": mem}, indent=1))


if __name__ == "__main__":
    main()
