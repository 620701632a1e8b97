"""Kernel choice per layer shape: for the linear layers of DeepFM, DCNv2 and DIN at their
real shapes (the synthetic Criteo shape of ``train_throughput.py``, batch 4096), each of the
three GEMMs (forward, input gradient, weight gradient) timed on MKL and on oneDNN, and the
whole layer (forward + backward) timed as ``nn.Linear`` (MKL), as oneDNN for all three, and
with the libraries ``train.kernels: auto`` chooses, in interleaved rounds. The chosen kernels
should never be slower than ``nn.Linear`` beyond noise.

Usage::

    python benchmarks/kernels.py                  # the three models, 5 interleaved rounds
    python benchmarks/kernels.py --models deepfm --batch 16384 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.accuracy import machine  # noqa: E402
from benchmarks.train_throughput import (  # noqa: E402
    HIST_LEN,
    MLP,
    NUM_DENSE,
    TARGET,
    VOCAB,
    cardinalities,
    make_data,
)


def model_and_probe(name: str, batch: int):  # type: ignore[no-untyped-def]
    import torch

    from sampan.batch import Batch
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec
    from sampan.tasks import make_task

    schema = DataSchema(dense=[f"I{i}" for i in range(NUM_DENSE)],
                        sparse=[SparseFeatureSpec(f"C{f + 1}", c)
                                for f, c in enumerate(cardinalities(VOCAB))],
                        sequences=[SequenceFeatureSpec("hist", HIST_LEN, f"C{TARGET + 1}")]
                        if name == "din" else [])
    opts: dict = {"embedding_dim": 16, "mlp": MLP}
    if name == "dcn_v2":
        opts.update(cross_layers=3, structure="parallel")
    model = build_model(get_model_class(name).Config(**opts), schema)
    data = make_data(batch, VOCAB, din=name == "din")
    b = Batch(dense=torch.from_numpy(data["dense"]), sparse=torch.from_numpy(data["sparse"]),
              labels=torch.from_numpy(data["labels"]),
              sequences={"hist": torch.from_numpy(data["hist"])} if "hist" in data else None)
    task = make_task(model)
    return model, (lambda: task.loss(model, b))


def main() -> None:
    from sampan.layers.kernels import GEMMS, layer_shapes, measure, plan_kernels, time_layer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="deepfm,dcn_v2,din")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/kernels.json"))
    args = ap.parse_args()
    m = machine()
    print(f"{m['cpu']} ({', '.join(m['isa'])}), {m['threads']} threads, torch {m['torch']}")
    rows = []
    for name in args.models.split(","):
        model, probe = model_and_probe(name, args.batch)
        with tempfile.TemporaryDirectory() as cache:  # a fresh choice, not a cached one
            plan = plan_kernels(model, "auto", probe, cache=Path(cache) / "kernels.json")
        shapes = sorted(set(layer_shapes(model, probe).values()), key=lambda s: -s[1] * s[2])
        for s in shapes:
            chosen = plan.layers[next(n for n, x in plan.shapes.items() if x == s)]
            # independent of the choice's own timings: fresh, interleaved rounds
            gemm = measure(s, rounds=args.rounds)
            whole = {k: float("inf") for k in ("mkl", "onednn", chosen)}
            for _ in range(args.rounds):
                for k in whole:
                    whole[k] = min(whole[k], time_layer(k, s, repeats=3))
            gflops = 6 * s[0] * s[1] * s[2] / 1e9  # 3 GEMMs of 2 N K O flops
            r = {"model": name, "shape": "x".join(map(str, s)), "chosen": chosen,
                 "gemm_ms": {gm: {k: t * 1e3 for k, t in gemm[gm].items()} for gm in GEMMS},
                 "nn_linear_ms": whole["mkl"] * 1e3, "onednn_ms": whole["onednn"] * 1e3,
                 "chosen_ms": whole[chosen] * 1e3,
                 "chosen_vs_nn_linear": whole[chosen] / whole["mkl"],
                 "gflop_s": {k: gflops / whole[k] for k in whole}}
            rows.append(r)
            per = "  ".join(f"{gm} mkl {gemm[gm]['mkl'] * 1e3:6.2f} onednn "
                            f"{gemm[gm]['onednn'] * 1e3:6.2f}" for gm in GEMMS)
            print(f"{name:7} {r['shape']:>16}  {per}  ms", flush=True)
            print(f"{'':7} {'':>16}  layer: nn.Linear {r['nn_linear_ms']:7.2f} ms "
                  f"({r['gflop_s']['mkl']:4.0f} GFLOP/s), oneDNN {r['onednn_ms']:7.2f} ms, "
                  f"chosen {chosen} {r['chosen_ms']:7.2f} ms ({r['gflop_s'][chosen]:4.0f} "
                  f"GFLOP/s) = {r['chosen_vs_nn_linear']:.3f}x nn.Linear's time", flush=True)
    worst = max(rows, key=lambda r: r["chosen_vs_nn_linear"])
    print(f"worst chosen / nn.Linear: {worst['chosen_vs_nn_linear']:.3f} ({worst['model']} "
          f"{worst['shape']})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": m, "batch": args.batch, "rows": rows},
                                          indent=1))


if __name__ == "__main__":
    main()
