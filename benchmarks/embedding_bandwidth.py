"""Embedding lookup + row update bandwidth against the device's copy bandwidth.

One fused table (``EmbeddingCollection``, ``--rows`` x ``--dim`` fp32) and a batch of
``--batch`` x ``--fields`` Zipf ids: the forward gather, the backward (gradients summed per
unique row) and a lazy ``SparseAdam`` step, timed separately. Bytes are counted as the
rows each phase must read and write (gather: unique rows read + ``B*F`` rows written;
update: weight, two moments and the gradient of each unique row read and written), and
divided by the time; the device's copy bandwidth (``clone`` of a 1 GiB buffer, read +
write) is measured beside it, so the figures read as a fraction of what memory can do.

Usage::

    python benchmarks/embedding_bandwidth.py                         # CPU
    python benchmarks/embedding_bandwidth.py --device cuda --batch 16384 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, device: str, repeats: int) -> float:  # type: ignore[no-untyped-def]
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: str, mib: int, repeats: int) -> float:
    """Bytes per second of ``clone`` (each byte read once and written once)."""
    import torch

    x = torch.empty(mib << 18, dtype=torch.float32, device=device).fill_(1.0)
    return 2 * x.numel() * 4 / timed(lambda: x.clone(), device, repeats)


def main() -> None:
    import numpy as np
    import torch

    from benchmarks.accuracy import machine
    from sampan.embedding import EmbeddingCollection, SparseAdam
    from sampan.schema import TableSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--fields", type=int, default=26)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = args.device
    torch.manual_seed(0)
    coll = EmbeddingCollection([TableSpec("t", args.rows, args.dim, ("t",))]).to(dev)
    opt = SparseAdam([coll], lr=1e-3)
    rng = np.random.default_rng(0)
    ids_np = np.minimum(rng.zipf(1.2, (args.batch, args.fields)) - 1, args.rows - 1)
    ids = torch.from_numpy(ids_np.astype(np.int64)).to(dev)
    unique = int(np.unique(ids_np).size)
    row = args.dim * 4
    out = {}

    def forward():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return coll(ids)

    def train_step() -> None:
        coll(ids).sum().backward()
        opt.step()

    t_fwd = timed(forward, dev, args.repeats)
    t_step = timed(train_step, dev, args.repeats)
    gather_bytes = unique * row + args.batch * args.fields * row
    # weight, 2 moments, gradient: read and written; and each row's update count (4 bytes,
    # Adam's per-row bias correction)
    update_bytes = unique * row * 4 * 2 + unique * 4 * 2
    copy = copy_bandwidth(dev, args.copy_mib, max(args.repeats // 2, 3))
    out = {"machine": machine(), "device": dev,
           "device_name": torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu",
           "rows": args.rows, "dim": args.dim, "batch": args.batch, "fields": args.fields,
           "unique_rows": unique, "copy_gb_s": copy / 1e9,
           "gather_ms": t_fwd * 1e3, "gather_gb_s": gather_bytes / t_fwd / 1e9,
           "step_ms": t_step * 1e3,
           "step_gb_s": (2 * gather_bytes + update_bytes) / t_step / 1e9}
    out["gather_fraction_of_copy"] = out["gather_gb_s"] / out["copy_gb_s"]
    out["step_fraction_of_copy"] = out["step_gb_s"] / out["copy_gb_s"]
    print(f"{out['device_name']}: copy {out['copy_gb_s']:.1f} GB/s; gather of "
          f"{args.batch}x{args.fields} ids ({unique:,} unique) {out['gather_ms']:.3f} ms = "
          f"{out['gather_gb_s']:.1f} GB/s ({out['gather_fraction_of_copy']:.0%} of copy); "
          f"gather + backward + SparseAdam {out['step_ms']:.3f} ms = {out['step_gb_s']:.1f} "
          f"GB/s ({out['step_fraction_of_copy']:.0%} of copy)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
