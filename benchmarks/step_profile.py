"""Where one training step's time goes: Sampan's Trainer step under ``torch.profiler``.

The step of ``benchmarks/train_throughput.py`` (same model, data and config), run through
the Trainer's own ``_train_step`` on its loader's batches: warm-up steps, then ``--steps``
timed without the profiler (wall time per step, device synced at the end), then the same
number under the profiler. Prints the operators by device time and by host time, the host
syncs per step (``aten::_local_scalar_dense``, ``cudaStreamSynchronize``, ...), the kernel
launches per step, and the device-busy share of the step: a step whose kernels take much
less than its wall time is bound by the host (Python, launches, syncs), not the device.

Usage::

    python benchmarks/step_profile.py --device cuda --model deepfm --batch 65536
    python benchmarks/step_profile.py --model deepfm --batch 4096        # on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYNC_OPS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaEventSynchronize", "cudaMemcpy")


def main() -> None:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.train_throughput import (
        PRECISIONS,
        VOCAB,
        make_data,
        sampan_trainer,
        set_precision,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="deepfm")
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--precision", default="tf32", choices=PRECISIONS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rows", type=int, default=20, help="top operators shown")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.vocab, args.log_every, args.compile, args.kernels = VOCAB, 10**9, "none", "auto"
    set_precision(args.precision)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    n = args.warmup + 2 * args.steps + 1
    data = make_data(n * args.batch, VOCAB, din=args.model == "din")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as run:
        a = argparse.Namespace(**vars(args))
        a.steps = n
        trainer = sampan_trainer(a, data, run)
        trainer.model.train()
        batches = iter(trainer.loader)

        def step() -> None:
            trainer._train_step(next(batches).to(dev, non_blocking=True))

        for _ in range(args.warmup):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / args.steps
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(args.steps):
                step()
            sync()
    ka = prof.key_averages()
    print(f"{args.model} batch {args.batch} {args.precision} on {args.device}: "
          f"{wall * 1e3:.2f} ms a step, {args.batch / wall:,.0f} samples/s (no profiler)")
    if cuda:
        print(ka.table(sort_by="self_device_time_total", row_limit=args.rows,
                       max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    syncs = {e.key: e.count / args.steps for e in ka if e.key in SYNC_OPS}
    # the kernels' (and copies') own time on the device, each event once
    kernel_us = sum(e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == DeviceType.CUDA) if cuda else 0.0
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                    "cudaLaunchKernelExC")) / args.steps
    out = {"model": args.model, "batch": args.batch, "precision": args.precision,
           "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "ms_per_step": wall * 1e3, "samples_per_s": args.batch / wall,
           "syncs_per_step": syncs, "launches_per_step": launches,
           "device_ms_per_step": kernel_us / 1e3 / args.steps if cuda else None}
    if cuda:
        out["device_busy"] = out["device_ms_per_step"] / out["ms_per_step"]
        print(f"kernels {out['device_ms_per_step']:.2f} ms of the {wall * 1e3:.2f} ms step "
              f"({out['device_busy']:.0%}); {launches:.0f} launches and syncs {syncs} a step")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
