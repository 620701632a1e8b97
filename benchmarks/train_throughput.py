"""Training throughput: Sampan's Trainer vs plain PyTorch vs DeepCTR-Torch, interleaved.

Synthetic Criteo shape: 26 categorical fields with Criteo-like vocabulary sizes (~840 k rows
in all), Zipf-distributed ids, 13 numeric fields; embedding dim 16, MLP 400-400-400, Adam
lr 1e-3, batch 4096. Models: DeepFM, DCNv2 (3 cross layers, parallel) and DIN (history 50).

Contenders, each in its own process (so peak RSS is its own), run in interleaved rounds:

* ``sampan``  — ``sampan.train.trainer.Trainer.fit`` with its loader, metrics log and progress
  on; samples/s is what the Trainer itself logs, after warm-up steps. It trains in the
  run's precision (``--precisions``: fp32 unless told), as the other contenders do.
* ``sampan_auto`` — the same with Sampan's default precision, ``train.amp: auto``: bf16
  autocast on a CPU with AMX or AVX512-BF16, fp32 elsewhere (where it is the same as
  ``sampan``, so it is left out). Compared with the others in fp32, what a user gets by
  default against what a hand-written loop does by default.
* ``plain``   — the same model written as plain PyTorch: one concatenated
  ``nn.Embedding(sparse=True)`` + ``torch.optim.SparseAdam``, dense ``Adam``, a NumPy slicing
  loop.
* ``deepctr`` — DeepCTR-Torch 0.3.0 ``model.fit`` (when ``deepctr_torch`` is importable:
  ``pip install -e ".[bench]"``); samples/s = rows / wall time of ``fit``.

Usage::

    python benchmarks/train_throughput.py                     # all models, 3 rounds
    python benchmarks/train_throughput.py --models deepfm --rounds 1
    python benchmarks/train_throughput.py --memory --rows 10000000 --dim 64
    python benchmarks/train_throughput.py --device cuda --batch 16384

``--isa avx2`` holds every contender (and the roofline's GEMMs) to AVX2 on a CPU that has
more: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``, so an
AVX-512 Intel CPU runs PyTorch's CPU path as an AVX2-only one would (AMD CPUs: MKL already
runs its AVX2 code). The JSON and the page's block record the ISA that took effect: ATen's
capability and the ISA oneDNN reports, not only the CPU's flags.

Prints a table with each ratio and writes JSON (``--out``). ``--readme
docs/explanations/performance.md`` rewrites that page's tables from that JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

# Criteo Kaggle's 26 fields, the large ones cut down so the total is about 840 k rows.
VOCAB = [1460, 583, 180000, 130000, 305, 24, 12517, 633, 3, 93145, 5683, 160000, 3194, 27,
         14992, 95000, 10, 5652, 2173, 4, 70000, 18, 15, 40000, 105, 30000]
NUM_DENSE = 13
HIST_LEN = 50
TARGET = 2  # DIN: the candidate item is field C3, the history holds C3 ids
MLP = [400, 400, 400]
DIM = 16


# ------------------------------------------------------------------------------ data
def make_data(rows: int, vocab: list[int], seed: int = 0, din: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    sparse = np.empty((rows, len(vocab)), dtype=np.int64)
    for f, v in enumerate(vocab):
        p = np.arange(1, v + 1, dtype=np.float64) ** -1.1
        cdf = np.cumsum(p / p.sum())
        # ids 2.. (0 padding, 1 OOV), a fixed shuffle so frequent ids are spread out
        ranks = np.minimum(np.searchsorted(cdf, rng.random(rows)), v - 1)
        sparse[:, f] = 2 + (ranks * 7919 + f) % max(v - 2, 1) if v > 2 else ranks
    dense = rng.standard_normal((rows, NUM_DENSE)).astype(np.float32)
    w = rng.standard_normal(NUM_DENSE).astype(np.float32) * 0.3
    logits = dense @ w + (sparse[:, 0] % 7 == 0) * 0.8 - 1.2
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logits))).astype(np.float32)[:, None]
    out = {"dense": dense, "sparse": sparse, "labels": labels}
    if din:
        v = vocab[TARGET]
        hist = sparse[rng.integers(0, rows, (rows, HIST_LEN)), TARGET]
        lengths = rng.integers(1, HIST_LEN + 1, rows)
        hist[np.arange(HIST_LEN)[None, :] < (HIST_LEN - lengths)[:, None]] = 0  # left pad
        out["hist"] = np.minimum(hist, v - 1)
    return out


def cardinalities(vocab: list[int]) -> list[int]:
    return [max(v, 3) for v in vocab]


# ----------------------------------------------------------------------- contenders
def sampan_trainer(args: argparse.Namespace, data: dict, run: str) -> Any:
    """Sampan's Trainer for ``args.model`` on ``data``, writing into ``run``."""
    import torch

    from sampan.config import load_config
    from sampan.data.store import SplitArrays
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec
    from sampan.train.trainer import Trainer

    vocab = args.vocab
    schema = DataSchema(dense=[f"I{i}" for i in range(NUM_DENSE)],
                        sparse=[SparseFeatureSpec(f"C{f + 1}", c)
                                for f, c in enumerate(cardinalities(vocab))],
                        sequences=[SequenceFeatureSpec("hist", HIST_LEN, f"C{TARGET + 1}")]
                        if args.model == "din" else [])
    model_opts = {"embedding_dim": args.dim, "mlp": MLP}
    if args.model == "deepfm":  # Rendle's FM term, as DeepCTR-Torch's and the plain loop's
        model_opts.update(field_weights=False)
    if args.model == "dcn_v2":
        model_opts.update(cross_layers=3, structure="parallel")
    if args.model == "din":  # as DeepCTR-Torch's DIN: Dice in the attention, ReLU in the MLP
        model_opts.update(activation="relu", attention_activation="dice")
    cfg = load_config(raw={
        "preset": "criteo", "data": {"format": "synthetic"}, "seed": 0,
        "model": {"name": args.model, **model_opts},
        "train": {"batch_size": args.batch, "lr": 1e-3, "max_steps": args.warmup + args.steps,
                  "data_on_device": False if getattr(args, "host_data", False) else "auto",
                  "epochs": 1000, "log_every_steps": args.log_every, "tensorboard": False,
                  "device": args.device, "schedule": "constant",
                  "amp": "auto" if getattr(args, "auto_amp", False) else
                  "bf16" if args.precision == "bf16" else "none",
                  "compile": args.compile == "all", "kernels": args.kernels,
                  "early_stopping": {"enabled": False}},
    })
    torch.manual_seed(0)
    model = build_model(get_model_class(args.model).Config(**model_opts), schema)
    split = SplitArrays(dense=data["dense"], sparse=data["sparse"], labels=data["labels"],
                        sequences={"hist": data["hist"]} if args.model == "din" else None)
    return Trainer(model, cfg, run, split, None)


def run_sampan(args: argparse.Namespace, data: dict) -> dict:
    with tempfile.TemporaryDirectory() as run:
        trainer = sampan_trainer(args, data, run)
        trainer.fit()
        recs = [json.loads(x) for x in Path(run, "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["split"] == "train" and r["step"] > args.warmup]
    speeds = [r["samples_per_s"] for r in recs]
    # every interval has the same number of samples: the overall rate is the harmonic mean
    rate = statistics.harmonic_mean(speeds)
    measured = len(speeds) * args.log_every * args.batch / rate  # seconds of those intervals
    t1 = recs[-1]["time"]  # the log record's wall clock (time.time)
    return {"samples_per_s": rate, "intervals": len(speeds), "window": [t1 - measured, t1],
            "amp": trainer.tc.amp}


def run_sampan_auto(args: argparse.Namespace, data: dict) -> dict:
    """Sampan with its default precision (``train.amp: auto``)."""
    a = argparse.Namespace(**vars(args))
    a.auto_amp = True
    return run_sampan(a, data)


def run_sampan_host(args: argparse.Namespace, data: dict) -> dict:
    """Sampan with its batches gathered on the host and copied to the device each step
    (``train.data_on_device: false``), as when the split does not fit there."""
    a = argparse.Namespace(**vars(args))
    a.host_data = True
    return run_sampan(a, data)


def run_sampan_mkl(args: argparse.Namespace, data: dict) -> dict:
    """Sampan with every linear layer on ``nn.Linear``'s path (``train.kernels: mkl``):
    against ``sampan`` it shows what the measured kernel choice gains inside the model."""
    a = argparse.Namespace(**vars(args))
    a.kernels = "mkl"
    return run_sampan(a, data)


def run_plain(args: argparse.Namespace, data: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    dev = torch.device(args.device if args.device != "auto" else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    card = cardinalities(args.vocab)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(card)[:-1]]), device=dev)
    nf, d = len(card), args.dim
    lin = 1 if args.model == "deepfm" else 0

    def mlp(i: int) -> nn.Sequential:
        layers: list[nn.Module] = []
        for h in MLP:
            layers += [nn.Linear(i, h), nn.ReLU()]
            i = h
        return nn.Sequential(*layers)

    class PlainDice(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(h, affine=False)
            self.alpha = nn.Parameter(torch.zeros(h))

        def forward(self, x):  # type: ignore[no-untyped-def]
            p = torch.sigmoid(self.bn(x.reshape(-1, x.shape[-1]))).view_as(x)
            return p * x + (1 - p) * self.alpha * x

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(sum(card), d + lin, sparse=True)
            nn.init.normal_(self.emb.weight, 0, 0.01)
            x0 = nf * d + NUM_DENSE + (d if args.model == "din" else 0)
            self.mlp = mlp(x0)
            self.out = nn.Linear(MLP[-1] + (x0 if args.model == "dcn_v2" else 0), 1)
            if args.model == "deepfm":
                self.dense_lin = nn.Linear(NUM_DENSE, 1)
            if args.model == "dcn_v2":
                self.cross = nn.ModuleList(nn.Linear(x0, x0) for _ in range(3))
            if args.model == "din":
                self.att = nn.Sequential(nn.Linear(4 * d, 80), PlainDice(80), nn.Linear(80, 40),
                                         PlainDice(40), nn.Linear(40, 1))

        def forward(self, dense, sparse, hist=None):  # type: ignore[no-untyped-def]
            e = self.emb(sparse + offsets)
            if args.model == "deepfm":
                v = e[..., 1:]
                s = v.sum(1)
                fm = 0.5 * (s.square() - v.square().sum(1)).sum(1, keepdim=True)
                x = torch.cat([v.flatten(1), dense], 1)
                return e[..., 0].sum(1, keepdim=True) + self.dense_lin(dense) + fm + \
                    self.out(self.mlp(x))
            if args.model == "dcn_v2":
                x0 = torch.cat([e.flatten(1), dense], 1)
                x = x0
                for w in self.cross:
                    x = x0 * w(x) + x
                return self.out(torch.cat([x, self.mlp(x0)], 1))
            k = self.emb(hist + offsets[TARGET])
            q = e[:, TARGET].unsqueeze(1).expand_as(k)
            w = self.att(torch.cat([q, k, q - k, q * k], -1)).squeeze(-1) * (hist != 0)
            interest = torch.bmm(w.unsqueeze(1), k).squeeze(1)
            return self.out(self.mlp(torch.cat([e.flatten(1), interest, dense], 1)))

    model = Plain().to(dev)
    sparse_opt = torch.optim.SparseAdam([model.emb.weight], lr=1e-3)
    dense_opt = torch.optim.Adam([p for n, p in model.named_parameters() if n != "emb.weight"],
                                 lr=1e-3)
    n = len(data["labels"])
    perm = np.random.default_rng(0).permutation(n)
    steps = args.warmup + args.steps
    t0 = w0 = 0.0
    for step in range(steps):
        if step == args.warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0, w0 = time.perf_counter(), time.time()
        lo = (step * args.batch) % max(n - args.batch, 1)
        idx = np.sort(perm[lo:lo + args.batch])
        dense = torch.from_numpy(data["dense"][idx]).to(dev)
        sparse = torch.from_numpy(data["sparse"][idx]).to(dev)
        y = torch.from_numpy(data["labels"][idx]).to(dev)
        hist = torch.from_numpy(data["hist"][idx]).to(dev) if args.model == "din" else None
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse, hist), y)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
    loss.item()  # waits for the device
    return {"samples_per_s": args.steps * args.batch / (time.perf_counter() - t0),
            "window": [w0, time.time()]}


def run_deepctr(args: argparse.Namespace, data: dict) -> dict:
    import torch
    from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat
    from deepctr_torch.models import DIN, DCNMix, DeepFM  # noqa: F401

    torch.manual_seed(0)
    card = cardinalities(args.vocab)
    feats: list = [SparseFeat(f"C{f + 1}", c, embedding_dim=args.dim) for f, c in enumerate(card)]
    feats += [DenseFeat(f"I{i}", 1) for i in range(NUM_DENSE)]
    x = {f"C{f + 1}": data["sparse"][:, f] for f in range(len(card))}
    x.update({f"I{i}": data["dense"][:, i] for i in range(NUM_DENSE)})
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.model == "deepfm":
        model = DeepFM(feats, feats, dnn_hidden_units=tuple(MLP), task="binary", device=dev)
    elif args.model == "dcn_v2":
        from deepctr_torch.models import DCN

        model = DCN(feats, feats, cross_num=3, cross_parameterization="matrix",
                    dnn_hidden_units=tuple(MLP), task="binary", device=dev)
    else:
        target = f"C{TARGET + 1}"
        feats.append(VarLenSparseFeat(SparseFeat(f"hist_{target}", card[TARGET],
                                                 embedding_dim=args.dim,
                                                 embedding_name=target),
                                      maxlen=HIST_LEN, length_name="seq_length"))
        x[f"hist_{target}"] = data["hist"]
        x["seq_length"] = (data["hist"] != 0).sum(1)
        model = DIN(feats, [target], dnn_hidden_units=tuple(MLP), task="binary", device=dev)
    model.compile("adam", "binary_crossentropy")
    rows = (args.warmup + args.steps) * args.batch
    x = {k: v[:rows] for k, v in x.items()}
    y = data["labels"][:rows, 0]
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
    return {"samples_per_s": rows / (time.perf_counter() - t0)}


CONTENDERS = {"sampan": run_sampan, "sampan_auto": run_sampan_auto,
              "sampan_host": run_sampan_host, "sampan_mkl": run_sampan_mkl, "plain": run_plain,
              "deepctr": run_deepctr}


def worker(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    data = make_data(args.data_rows, args.vocab, din=args.model == "din")
    from benchmarks.accuracy import peak_rss_mb

    before = peak_rss_mb()
    result = CONTENDERS[args.worker](args, data)
    if args.worker in ("sampan", "sampan_auto"):
        result["compile"] = args.compile == "all"
    result.pop("window", None)
    result["peak_rss_mb"] = peak_rss_mb()
    result["rss_before_training_mb"] = before
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------ on a GPU, in-process
PRECISIONS = ("fp32", "tf32", "bf16")


def set_precision(precision: str) -> None:
    """``fp32``: full-precision matrix products; ``tf32``: TF32 tensor cores for fp32
    matrix products; ``bf16``: bf16 autocast (and TF32 for what stays fp32)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = precision != "fp32"
    torch.backends.cudnn.allow_tf32 = precision != "fp32"


class GpuLoad:
    """GPU utilisation (NVML's: the share of time a kernel was running) sampled every 20 ms
    in a thread while the context is open; :meth:`mean` averages the samples of a window
    (wall-clock ``time.time()`` seconds)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self.handle = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.nvml = pynvml
        except Exception:  # no NVML here (a CPU machine): no figure
            self.handle = None

    def __enter__(self) -> GpuLoad:
        import threading

        self.stop = threading.Event()
        if self.handle is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            u = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
            self.samples.append((time.time(), u))

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.handle is not None:
            self.thread.join()

    def mean(self, lo: float, hi: float) -> float | None:
        xs = [u for t, u in self.samples if lo <= t <= hi]
        return statistics.fmean(xs) if xs else None


def run_in_process(args: argparse.Namespace, models: list[str], contenders: list[str],
                   save: Any = None) -> list[dict]:
    """Every model x batch x precision x contender in this process, on one data set (a
    GPU's start is paid once; peak host RSS is then not each contender's own, so it is not
    reported: peak GPU memory is). ``save(rows)`` is called after each combination."""
    import copy
    import traceback

    import torch

    cuda = args.device.startswith("cuda")
    data = make_data(args.data_rows, args.vocab, din="din" in models)
    rows = []
    for batch in args.batches:
        for m in models:
            for prec in args.precisions:
                for c in contenders:
                    a = copy.copy(args)
                    a.batch, a.model, a.precision, a.worker = batch, m, prec, c
                    # the same samples at every batch size (a long enough window for
                    # NVML's utilisation at the small ones)
                    a.steps = max(args.steps_for[m] * max(args.batches) // batch,
                                  2 * args.log_every)
                    set_precision(prec)
                    if cuda:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    try:
                        with GpuLoad() as load:
                            r = CONTENDERS[c](a, data)
                    except Exception:  # one failing combination (say, out of memory) is
                        traceback.print_exc()  # reported; the others still run
                        print(f"{m} batch {batch} {prec} {c}: failed", flush=True)
                        continue
                    r["gpu_util"] = load.mean(*r.pop("window"))
                    if cuda:
                        r["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
                    rows.append({"model": m, "batch": batch, "precision": prec,
                                 "contender": c, **r})
                    if save is not None:
                        save(rows)
                    util = f"{r['gpu_util']:.0f}%" if r["gpu_util"] is not None else "-"
                    print(f"{m:7} batch {batch:6} {prec:5} {c:7} {r['samples_per_s']:>12,.0f} "
                          f"samples/s  GPU busy {util}", flush=True)
    return rows


def device_summary(rows: list[dict]) -> dict:
    """``{"deepfm/16384/bf16": {"sampan": {...}, "plain": {...}, "sampan_vs_plain": x}}``."""
    out: dict = {}
    for r in rows:
        key = f"{r['model']}/{r['batch']}/{r['precision']}"
        out.setdefault(key, {})[r["contender"]] = {
            k: v for k, v in r.items() if k not in ("model", "batch", "precision", "contender")}
    for row in out.values():
        if "sampan" in row and "plain" in row:
            row["sampan_vs_plain"] = row["sampan"]["samples_per_s"] / \
                row["plain"]["samples_per_s"]
    return out


def device_markdown(report: dict) -> str:
    mc, a = report["machine"], report["args"]
    lines = [f"{mc.get('date', '')}, {mc.get('cuda')} (driver {mc.get('cuda_driver', '?')}, "
             f"CUDA {mc.get('cuda_runtime', '?')}), torch {mc['torch']}: dim {a['dim']}, MLP "
             f"400-400-400; the same samples at every batch size: {a['steps']} measured "
             f"steps at the largest batch (DIN a third), proportionally more at smaller ones, "
             f"after {a['warmup']} warm-up steps. GPU busy is NVML's utilisation sampled over "
             "the measured steps (a rough figure where they last under a second).", "",
             "| model | batch | precision | Sampan samples/s | Sampan, batches from the host "
             "| plain PyTorch | Sampan / plain | GPU busy (Sampan / plain) | peak GPU memory "
             "(Sampan) |", "|---|---|---|---|---|---|---|---|---|"]
    for key, r in report["results"].items():
        m, b, p = key.split("/")

        def sps(c: str, row: dict = r) -> str:
            return f"{row[c]['samples_per_s']:,.0f}" if c in row else "-"

        def util(c: str, row: dict = r) -> str:
            u = row.get(c, {}).get("gpu_util")
            return f"{u:.0f}%" if u is not None else "-"

        ratio = f"{r['sampan_vs_plain']:.2f}x" if "sampan_vs_plain" in r else "-"
        mem = r.get("sampan", {}).get("peak_gpu_mb")
        lines.append(f"| {m} | {int(b):,} | {p} | {sps('sampan')} | {sps('sampan_host')} | "
                     f"{sps('plain')} | {ratio} "
                     f"| {util('sampan')} / {util('plain')} | "
                     + (f"{mem:,.0f} MB |" if mem is not None else "- |"))
    return "\n".join(lines)


# ------------------------------------------------------------------------- driver
def deepctr_available() -> bool:
    try:
        import deepctr_torch  # noqa: F401
    except ImportError:
        return False
    return True


def spawn(args: argparse.Namespace, contender: str, model: str) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", contender, "--model", model,
           "--batch", str(args.batch), "--steps", str(args.steps_for[model]),
           "--warmup", str(args.warmup), "--dim", str(args.dim), "--device", args.device,
           "--data-rows", str(args.data_rows), "--log-every", str(args.log_every),
           "--vocab", ",".join(map(str, args.vocab)), "--kernels", args.kernels,
           "--precision", args.precisions[0]]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.compile in ("all", model) or model in args.compile.split(","):
        cmd += ["--compile", "all"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"  {contender}/{model} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="deepfm,dcn_v2,din")
    ap.add_argument("--contenders", default="sampan,sampan_auto,plain,deepctr",
                    help="of sampan, sampan_auto (Sampan's default precision; left out where "
                    "that is fp32), sampan_host (GPU), sampan_mkl (train.kernels: mkl), "
                    "plain, deepctr")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--batches", default=None,
                    help="several batch sizes, a comma list (with --in-process)")
    ap.add_argument("--precisions", default="fp32",
                    help="comma list of fp32, tf32 (TF32 matrix products on a GPU) and bf16 "
                         "(bf16 autocast); with several, --in-process")
    ap.add_argument("--in-process", action="store_true",
                    help="run every combination in this process (on a GPU: its start and "
                         "the data are paid once; the default there)")
    ap.add_argument("--steps", type=int, default=30, help="measured steps (DIN: a third)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--dim", type=int, default=DIM)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--isa", default="native", choices=["native", "avx2"],
                    help="avx2: hold PyTorch's CPU libraries to AVX2 for every contender "
                    "(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", default="din",
                    help="models whose Sampan run sets train.compile (torch.compile of the "
                         "dense layers): a comma list, 'all' or 'none'. Default: din, the one "
                         "where it pays (Dice activations are memory-bound without fusion)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "mkl", "onednn"],
                    help="train.kernels of the Sampan runs")
    ap.add_argument("--data-rows", type=int, default=None)
    ap.add_argument("--memory", action="store_true",
                    help="memory check: Sampan vs plain with one big table (see --rows)")
    ap.add_argument("--rows", type=int, default=10_000_000, help="table rows for --memory")
    ap.add_argument("--out", default=None,
                    help="result JSON (default: benchmarks/results/train_throughput_CLASS.json,"
                         " CLASS the CPU measured: its ISA and generation, e.g. avx512_f25m17;"
                         " or _memory, _cuda)")
    ap.add_argument("--readme", default=None, help="rewrite this README's Performance section")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only render an earlier result JSON (to stdout, or into --readme)")
    # internal
    ap.add_argument("--worker", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS)
    ap.add_argument("--vocab", default=None)
    args = ap.parse_args()

    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        # the caps must be set before torch loads: this process again, with them (the
        # contenders' processes inherit them)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    if args.render:
        report = json.loads(Path(args.render).read_text())
        print(markdown(report))
        if args.readme:
            update_readme(Path(args.readme), report)
        return
    args.vocab = [int(v) for v in args.vocab.split(",")] if args.vocab else VOCAB
    if args.worker:
        args.data_rows = args.data_rows or (args.warmup + args.steps + 1) * args.batch
        worker(args)
        return
    if args.memory:
        # One dominant table so the total is --rows; the other fields stay small.
        args.vocab = [args.rows - sum(VOCAB[1:])] + VOCAB[1:]
        args.models, args.rounds = "deepfm", 1
        args.contenders = "sampan,plain"
        args.out = args.out or str(RESULTS / "train_throughput_memory.json")
    if args.out is None:  # one file per CPU class measured, as the README's blocks
        cls = "cuda" if args.device != "cpu" else machine()["cpu_class"]
        args.out = str(RESULTS / f"train_throughput_{cls}.json")
    models = args.models.split(",")
    contenders = [c for c in args.contenders.split(",")
                  if c != "deepctr" or deepctr_available()]
    if "deepctr" in args.contenders and "deepctr" not in contenders:
        print("deepctr_torch is not importable: skipping it (pip install -e '.[bench]')")
    if "sampan_auto" in contenders:
        from sampan.train.compute import bf16_hardware

        if args.precisions != "fp32" or args.in_process or args.batches \
                or args.device != "cpu":
            contenders.remove("sampan_auto")
            print("sampan_auto left out: --precisions sets every contender's precision")
        elif not (bf16 := bf16_hardware(__import__("torch").device("cpu")))[0]:
            contenders.remove("sampan_auto")
            print(f"sampan_auto left out: {bf16[1]}, so its amp: auto is fp32, as sampan's")
    args.steps_for = {m: max(args.steps // 3, 6) if m == "din" else args.steps for m in models}
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    args.precisions = args.precisions.split(",")
    if bad := [p for p in args.precisions if p not in PRECISIONS]:
        ap.error(f"--precisions: {bad} not among {list(PRECISIONS)}")
    args.data_rows = args.data_rows or (args.warmup + args.steps + 1) * max(args.batches)
    if args.in_process or args.device.startswith("cuda") or len(args.batches) > 1 \
            or len(args.precisions) > 1:
        contenders = [c for c in contenders if c != "deepctr"]
        report = {"benchmark": "train_throughput", "in_process": True,
                  "args": {k: v for k, v in vars(args).items()
                           if k not in ("worker", "model", "precision", "vocab")},
                  "machine": machine(), "results": {}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)

        def save(rows: list[dict]) -> None:  # after each combination: a cut run keeps them
            report["results"] = device_summary(rows)
            Path(args.out).write_text(json.dumps(report, indent=1))

        run_in_process(args, models, contenders, save)
        print(device_markdown(report))
        print(f"wrote {args.out}")
        return

    results: dict[str, dict[str, list[dict]]] = {m: {c: [] for c in contenders} for m in models}
    roofs: dict[str, dict[str, list[dict]]] = {m: {} for m in models}
    roof = args.device == "cpu" and not args.memory
    for rnd in range(args.rounds):
        for m in models:
            for c in contenders:  # interleaved: each round runs every contender once
                r = spawn(args, c, m)
                if r:
                    r["round"] = rnd
                    results[m][c].append(r)
                    print(f"round {rnd + 1} {m:7} {c:8} {r['samples_per_s']:>10,.0f} samples/s "
                          f"peak RSS {r['peak_rss_mb']:,.0f} MB", flush=True)
            if roof:  # the bound in the same round, so each Sampan run meets its own
                for key, rf in round_rooflines(args, m, results[m], rnd).items():
                    roofs[m].setdefault(key, []).append(rf)
    summary = summarise(results, roofs)
    for m in models:
        for key in ("roofline", "roofline_bf16"):
            if rf := summary[m].get(key):
                c = "sampan" if key == "roofline" else "sampan_auto"
                print(f"roofline {m:7} {rf['precision']:4} GEMMs {rf['gemm_gflop_s']:.0f} "
                      f"GFLOP/s -> {rf['gemm_bound']:,.0f} samples/s; embeddings at "
                      f"{rf['copy_gb_s']:.1f} GB/s -> {rf['embedding_bound']:,.0f}; bound "
                      f"{rf['bound']:,.0f}; {c} at {rf.get('sampan_of_bound', 0):.0%} of it "
                      f"({rf.get('sampan_of_gemm_bound', 0):.0%} of the GEMM bound; medians "
                      "over rounds)", flush=True)
    report = {"benchmark": "train_throughput", "args": {k: v for k, v in vars(args).items()
                                                        if k not in ("worker", "model")},
              "machine": machine(), "results": summary}
    if args.memory:
        table_bytes = args.rows * (args.dim + 1) * 4
        report["memory"] = {"table_rows": args.rows, "dim": args.dim,
                            "weights_mb": table_bytes / 2**20,
                            "weights_plus_adam_state_mb": 3 * table_bytes / 2**20}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(markdown(report))
    print(f"wrote {args.out}")
    if args.readme:
        update_readme(Path(args.readme), report)


def round_rooflines(args: argparse.Namespace, model: str, runs: dict[str, list[dict]],
                    rnd: int) -> dict[str, dict]:
    """This round's roofline of ``model`` for each Sampan contender that ran in it, against
    the precision it trained in, with that run's fraction of it."""
    from benchmarks.embedding_bandwidth import copy_bandwidth

    copy = copy_bandwidth("cpu", 512, 5) / 1e9
    out = {}
    for key, c, prec in (("roofline", "sampan", args.precisions[0]),
                         ("roofline_bf16", "sampan_auto", "bf16")):
        got = next((r for r in runs.get(c, []) if r["round"] == rnd), None)
        if got is None or (key == "roofline_bf16" and got.get("amp") != "bf16"):
            continue
        rf = roofline(model, args.batch, args.dim, copy, prec)
        rf["sampan_of_gemm_bound"] = got["samples_per_s"] / rf["gemm_bound"]
        rf["sampan_of_bound"] = got["samples_per_s"] / rf["bound"]
        out[key] = rf
    return out


def paired(a: list[dict], b: list[dict]) -> list[float]:
    """``a``'s samples/s over ``b``'s, round by round (rounds where both ran)."""
    rb = {r.get("round", i): r["samples_per_s"] for i, r in enumerate(b)}
    return [r["samples_per_s"] / rb[k] for i, r in enumerate(a)
            if (k := r.get("round", i)) in rb]


def summarise(results: dict, roofs: dict | None = None) -> dict:
    """Each contender's median samples/s; each Sampan contender's ratio to the others as the
    median of its round-by-round ratios (the contenders of a round ran next to each other,
    so a machine's slow phase slows both sides of a ratio), with their range; and the
    roofline as the median of its per-round measures, its fractions paired the same way."""
    out: dict = {}
    for m, by in results.items():
        row = {}
        for c, rs in by.items():
            if rs:
                row[c] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                          "peak_rss_mb": max(r["peak_rss_mb"] for r in rs), "runs": len(rs)}
                if "compile" in rs[0]:
                    row[c]["compile"] = rs[0]["compile"]
        for s in ("sampan", "sampan_auto"):
            for c in ("plain", "deepctr"):
                if ratios := paired(by.get(s, []), by.get(c, [])):
                    row[f"{s}_vs_{c}"] = statistics.median(ratios)
                    row[f"{s}_vs_{c}_range"] = [min(ratios), max(ratios)]
        if rs := by.get("sampan_auto"):
            row["sampan_auto"]["amp"] = rs[0].get("amp")
        for key, rfs in (roofs or {}).get(m, {}).items():
            row[key] = {k: statistics.median(rf[k] for rf in rfs) if k != "precision"
                        else rfs[0][k] for k in rfs[0]}
            row[key]["rounds"] = len(rfs)
            if "sampan_of_bound" in rfs[0]:
                row[key]["sampan_of_bound_range"] = [min(rf["sampan_of_bound"] for rf in rfs),
                                                     max(rf["sampan_of_bound"] for rf in rfs)]
        out[m] = row
    return out


AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def onednn_isa() -> str | None:
    """The ISA oneDNN reports for its first primitive in a fresh process with this
    environment (``ONEDNN_VERBOSE``), e.g. ``Intel AVX2``."""
    probe = ("import torch; torch.nn.functional.conv2d(torch.randn(2, 16, 32, 32), "
             "torch.randn(16, 16, 3, 3))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env={**os.environ, "ONEDNN_VERBOSE": "1"}, timeout=120)
    for line in (r.stdout + r.stderr).splitlines():
        if ",isa:" in line:
            return line.split(",isa:", 1)[1].strip()
    return None


def cpu_class(m: dict) -> str:
    """The README block (and results file) of a CPU: its widest vector ISA and its
    generation (family / model), since one ISA spans generations of very different speed
    (AVX-512 on a Zen 4 EPYC ran DeepFM's GEMMs at 161 GFLOP/s, on a Zen 5 at 415)."""
    isa = "avx512" if "avx512f" in m["isa"] and not m.get("isa_capped") else "avx2"
    if m.get("isa_capped"):  # AVX2 emulated on a wider CPU: a block of its own
        isa = "avx2emu"
    return f"{isa}_f{m['cpu_family']}m{m['cpu_model']}" if m.get("cpu_family") else isa


def machine() -> dict:
    import torch

    from benchmarks.accuracy import machine as cpu_machine
    from sampan.layers.kernels import effective_isa

    m = cpu_machine()
    capped = all(os.environ.get(k) == v for k, v in AVX2_ENV.items())
    m.update(isa_capped=capped and "avx512f" in m["isa"], effective_isa=effective_isa(),
             onednn_isa=onednn_isa())
    out = {**m, "date": time.strftime("%Y-%m-%d"), "cpu_class": cpu_class(m),
           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if out["cuda"]:
        out["cuda_runtime"] = torch.version.cuda
        try:
            import pynvml

            pynvml.nvmlInit()
            out["cuda_driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:
            out["cuda_driver"] = None
    return out


# Bytes one embedding row moves per sample and training step, each row assumed distinct
# (an upper bound on traffic): gather (read the row, write the output), backward (read the
# output gradient, add it into the row's gradient) and lazy Adam (read the gradient; read
# and write the weight and both moments).
ROW_PASSES = 2 + 2 + 7


def bf16_layer_seconds(shape: tuple[int, int, int], repeats: int = 5) -> float:
    """A linear layer's three GEMMs at ``shape`` (rows, in, out) in bf16, as autocast runs
    them (``torch.mm`` on bf16 operands: oneDNN, on AMX where the CPU has it): forward,
    input gradient and weight gradient, each the best of ``repeats``."""
    import torch

    n, k, o = shape
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(a, b, generator=gen).bfloat16() for a, b in ((n, k), (o, k)))
    g = torch.randn(n, o, generator=gen).bfloat16()
    total = 0.0
    for fn in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x):
        best = float("inf")
        for _ in range(repeats + 1):  # one warm-up call
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


def roofline(model: str, batch: int, dim: int, copy_gb_s: float,
             precision: str = "fp32") -> dict:
    """What this CPU could do at best for ``model``: the MLP / cross / attention GEMMs at
    their real shapes timed alone (fp32: each GEMM on its faster library; bf16: as
    autocast runs them), and the embedding traffic at the measured copy bandwidth (the
    tables stay fp32 either way); the bound is their combined time."""
    from benchmarks.kernels import model_and_probe
    from sampan.layers.kernels import fastest, layer_shapes, layer_time, measure

    net, probe = model_and_probe(model, batch)
    shapes = list(layer_shapes(net, probe).values())
    gemm_s = 0.0
    for s in shapes:  # each GEMM on its faster library
        if precision == "bf16":
            gemm_s += bf16_layer_seconds(s)
            continue
        t = measure(s)
        gemm_s += layer_time(t, fastest(t))
    flops = sum(6 * n * k * o for n, k, o in shapes)  # forward + both gradients
    rows = len(VOCAB) + (HIST_LEN if model == "din" else 0)
    emb_bytes = rows * (dim + 1) * 4 * ROW_PASSES  # per sample
    gemm_bound = batch / gemm_s
    emb_bound = copy_gb_s * 1e9 / emb_bytes
    return {"precision": precision,
            "gemm_gflop_s": flops / gemm_s / 1e9, "gemm_flop_per_sample": flops / batch,
            "gemm_bound": gemm_bound, "embedding_bytes_per_sample": emb_bytes,
            "copy_gb_s": copy_gb_s, "embedding_bound": emb_bound,
            "bound": 1 / (1 / gemm_bound + 1 / emb_bound)}


def markdown(report: dict) -> str:
    a = report["args"]
    if "memory" in report:
        mem, r = report["memory"], report["results"]["deepfm"]
        return (f"Memory check (`--memory --rows {mem['table_rows']} --dim {mem['dim']}`): "
                f"one table of {mem['table_rows']:,} rows x {mem['dim']} (+1 first-order "
                f"column) holds {mem['weights_mb']:,.0f} MB of weights, "
                f"{mem['weights_plus_adam_state_mb']:,.0f} MB with Adam's two moments. Peak RSS "
                f"while training: Sampan {r['sampan']['peak_rss_mb']:,.0f} MB, plain PyTorch "
                + (f"{r['plain']['peak_rss_mb']:,.0f} MB" if "plain" in r else "-")
                + "; no dense gradient or full-size temporary is ever materialised (one would "
                f"add {mem['weights_mb']:,.0f} MB). Throughput at that size: "
                f"{r['sampan']['samples_per_s']:,.0f} samples/s.")
    mc = report["machine"]
    cpu = mc.get("cuda") if a["device"] != "cpu" and mc.get("cuda") else \
        f"{mc['cpu']} ({', '.join(mc.get('isa', [])) or 'no AVX2'}" + (
            f"; in effect: {mc['effective_isa']}; oneDNN runs {mc.get('onednn_isa') or '?'}"
            if mc.get("effective_isa") else "") + ")"
    lines = [f"{mc.get('date', '')}, {cpu}, {mc['cores']} cores: batch {a['batch']}, dim "
             f"{a['dim']}, MLP 400-400-400, device {a['device']}, torch {mc['torch']}; median "
             f"of {a['rounds']} interleaved rounds"
             + (", each ratio the median of the rounds' own (their range)" if any(
                 k.endswith("_range") for r in report["results"].values() for k in r) else "")
             + f" (`python benchmarks/train_throughput.py "
             f"--rounds {a['rounds']}"
             + (f" --isa {a['isa']}" if a.get("isa", "native") != "native" else "")
             + "`).", "",
             "| model | Sampan samples/s | plain PyTorch | DeepCTR-Torch | Sampan / plain | "
             "Sampan / DeepCTR | Sampan peak RSS |", "|---|---|---|---|---|---|---|"]
    auto = {m: r for m, r in report["results"].items() if "sampan_auto" in r}
    def sps(r: dict, c: str) -> str:
        return f"{r[c]['samples_per_s']:,.0f}" if c in r else "-"

    def pct(rf: dict, k: str) -> str:  # "-" where the Sampan run failed
        if k not in rf:
            return "-"
        lo_hi = rf.get(f"{k}_range")
        return f"{rf[k]:.0%}" + (f" ({lo_hi[0]:.0%}-{lo_hi[1]:.0%})" if lo_hi else "")

    def ratio(r: dict, c: str, s: str = "sampan") -> str:  # with the rounds' range
        if f"{s}_vs_{c}" not in r:
            return "-"
        lo_hi = r.get(f"{s}_vs_{c}_range")
        spread = f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi and lo_hi[0] != lo_hi[1] else ""
        return f"{r[f'{s}_vs_{c}']:.2f}x{spread}"

    for m, r in report["results"].items():
        rss = f"{r['sampan']['peak_rss_mb']:,.0f} MB" if "sampan" in r else "-"
        name = f"{m} (compile)" if r.get("sampan", {}).get("compile") else m
        lines.append(f"| {name} | {sps(r, 'sampan')} | {sps(r, 'plain')} | {sps(r, 'deepctr')} | "
                     f"{ratio(r, 'plain')} | {ratio(r, 'deepctr')} | {rss} |")
    if auto:
        lines += ["", "Sampan's default precision (`train.amp: auto`, here "
                  f"{next(iter(auto.values()))['sampan_auto'].get('amp')}) against the others "
                  "in fp32, as each runs by default:", "",
                  "| model | Sampan, amp auto | Sampan fp32 | plain PyTorch fp32 | auto / plain | "
                  "auto / DeepCTR |", "|---|---|---|---|---|---|"]
        for m, r in auto.items():
            lines.append(f"| {m} | {sps(r, 'sampan_auto')} | {sps(r, 'sampan')} | "
                         f"{sps(r, 'plain')} | {ratio(r, 'plain', 'sampan_auto')} | "
                         f"{ratio(r, 'deepctr', 'sampan_auto')} |")
    roof = {f"{m} ({rf.get('precision', 'fp32')})": rf for m, r in report["results"].items()
            for k in ("roofline", "roofline_bf16") if (rf := r.get(k))}
    if roof:
        lines += ["", "Roofline on this CPU: the model's GEMMs timed alone at their shapes "
                  "(fp32: each GEMM on its faster library; bf16: as autocast runs them), and its "
                  f"embedding traffic (every row distinct: {ROW_PASSES} row passes a step) at "
                  "the measured copy bandwidth; each against the Sampan run in that precision"
                  + ("; measured in every round, the medians, and Sampan's fraction as the "
                     "median of the rounds' own (their range)."
                     if any("rounds" in rf for rf in roof.values()) else "."),
                  "",
                  "| model | GEMM GFLOP/s | GEMM bound | embedding bound | bound (both) | "
                  "Sampan / GEMM bound | Sampan / bound |", "|---|---|---|---|---|---|---|"]
        for m, rf in roof.items():
            lines.append(f"| {m} | {rf['gemm_gflop_s']:.0f} | {rf['gemm_bound']:,.0f} | "
                         f"{rf['embedding_bound']:,.0f} (copy {rf['copy_gb_s']:.1f} GB/s) | "
                         f"{rf['bound']:,.0f} | {pct(rf, 'sampan_of_gemm_bound')} | "
                         f"{pct(rf, 'sampan_of_bound')} |")
    return "\n".join(lines)


def update_readme(path: Path, report: dict) -> None:
    """Rewrite this report's block of the README's Performance section."""
    from _readme import update_block

    key = "train_throughput_memory" if "memory" in report else \
        f"train_throughput_{report['machine'].get('cpu_class') or cpu_class(report['machine'])}"
    # one block per CPU measured; a new CPU's goes after the other CPUs' blocks
    update_block(path, key, markdown(report), after="<!-- /perf:train_throughput_avx")


if __name__ == "__main__":
    main()
