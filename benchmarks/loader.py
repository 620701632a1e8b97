"""BatchLoader throughput alone: batches per second out of a processed store on disk.

Writes a Criteo-shaped split (13 dense float32, 26 sparse ids stored as int32, 1 label) of
``--rows`` rows as the store does, opens it memory-mapped like training does, and iterates
the BatchLoader over it for each shuffle mode (prefetch thread on, as in training), after
one warm-up epoch so the file is in the page cache. Prints samples/s. With ``--device cuda``
each batch is also pinned and copied to the GPU as training does (``non_blocking``), and the
clock stops once the last copy has landed: what the loader can feed a GPU.

Usage::

    python benchmarks/loader.py                   # 2,000,000 rows, batch 4096
    python benchmarks/loader.py --readme docs/explanations/performance.md
    python benchmarks/loader.py --device cuda --batch 65536 --rows 4000000 --out loader_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_split(root: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    np.save(root / "dense.npy", rng.standard_normal((rows, 13)).astype(np.float32))
    np.save(root / "sparse.npy", rng.integers(0, 50_000, (rows, 26), dtype=np.int32))
    np.save(root / "labels.npy", (rng.random((rows, 1)) < 0.25).astype(np.float32))


def main() -> None:
    from sampan.data.loader import BatchLoader
    from sampan.data.store import SplitArrays

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loader.json"))
    ap.add_argument("--readme", default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: pinned and copied there")
    args = ap.parse_args()
    import torch

    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"

    def drain(loader: BatchLoader) -> int:
        n = 0
        for b in loader:
            if on_gpu:
                b = b.to(dev, non_blocking=True)
            n += b.size
        if on_gpu:
            torch.cuda.synchronize()
        return n
    results = {}
    with tempfile.TemporaryDirectory() as d:
        write_split(Path(d), args.rows)
        data = SplitArrays.load(Path(d))
        for mode in ("rows", "blocks", "none"):
            loader = BatchLoader(data, args.batch, shuffle=mode, seed=0, prefetch=2,
                                 pin_memory=on_gpu)
            drain(loader)  # warm the page cache
            t0 = time.perf_counter()
            n = drain(loader)
            dt = time.perf_counter() - t0
            results[mode] = n / dt
            print(f"shuffle={mode:6} {n / dt:>12,.0f} samples/s", flush=True)
    report = {"benchmark": "loader", "rows": args.rows, "batch": args.batch,
              "cores": os.cpu_count(), "device": str(dev),
              "device_name": torch.cuda.get_device_name(dev) if on_gpu else None,
              "samples_per_s": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    text = (f"BatchLoader alone ({args.rows:,} Criteo-shaped rows memory-mapped, batch "
            f"{args.batch}, prefetch thread on, {report['cores']} cores"
            + (f", pinned and copied to the {report['device_name']}" if on_gpu else "") + "): "
            + ", ".join(f"shuffle `{m}` {v:,.0f} samples/s" for m, v in results.items()) + ".")
    print(text)
    if args.readme:
        from _readme import update_block

        update_block(Path(args.readme), "loader", text)


if __name__ == "__main__":
    main()
