"""The README's GPU block, from the JSON of one ``gpu_check.sh`` run.

Reads the files that ``bash benchmarks/gpu_check.sh`` writes into ``$OUT`` (committed under
``benchmarks/results/gpu/``): the throughput table (Sampan's Trainer, the same with batches
from the host, plain PyTorch), the step profile, the embedding and loader bandwidths, the
data-parallel runs and the GPU tests' summary from the run's log. A figure whose file is
absent is said to be not measured.

Usage::

    python benchmarks/gpu_report.py benchmarks/results/gpu               # print the block
    python benchmarks/gpu_report.py benchmarks/results/gpu --readme docs/explanations/performance.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def load(d: Path, name: str) -> dict | None:
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def tests_line(d: Path) -> str:
    log = d / "gpu_check.log"
    if not log.exists():
        return "`pytest -m gpu`: not run."
    text = log.read_text()
    part = text[text.find("== gpu_tests"):text.find("== gpu_tests:")]
    m = re.findall(r"^=*\s*((?:\d+ (?:passed|failed|skipped|error)[^\n=]*))", part, re.M)
    return f"`pytest -m gpu` (tests/integration/test_gpu.py): {m[-1].strip()}." if m else \
        "`pytest -m gpu`: no summary in the log."


def deepfm_bound(tt: dict, emb: dict | None) -> str:
    """DeepFM's best samples/s at the largest batch, and the share it is of the bound that the
    device's copy bandwidth sets on its embedding traffic."""
    from train_throughput import ROW_PASSES, VOCAB

    rows = [(k, r) for k, r in tt["results"].items() if k.startswith("deepfm/") and "sampan" in r]
    if not rows:
        return ""
    big = max(int(k.split("/")[1]) for k, _ in rows)
    key, best = max(((k, r) for k, r in rows if int(k.split("/")[1]) == big),
                    key=lambda kr: kr[1]["sampan"]["samples_per_s"])
    s = best["sampan"]["samples_per_s"]
    text = (f"DeepFM at batch {big:,} ({key.split('/')[2]}): **{s / 1e6:.1f} M samples/s**, "
            f"{best.get('sampan_vs_plain', float('nan')):.1f}x plain PyTorch on the same GPU")
    if emb:
        per_sample = len(VOCAB) * (tt["args"]["dim"] + 1) * 4 * ROW_PASSES
        bound = emb["copy_gb_s"] * 1e9 / per_sample
        text += (f"; its embedding traffic ({per_sample:,} bytes a sample, every row counted "
                 f"{ROW_PASSES} times: gather, gradient, lazy Adam) at the measured copy "
                 f"bandwidth ({emb['copy_gb_s']:,.0f} GB/s) would allow {bound / 1e6:,.0f} M "
                 f"samples/s: Sampan runs at {s / bound:.1%} of that bound")
    return text + "."


def render(d: Path) -> str:
    from train_throughput import device_markdown

    tt = load(d, "train_throughput_gpu.json")
    emb = load(d, "embedding_bandwidth.json")
    prof = load(d, "step_profile.json")
    before = load(d, "step_profile_host_batches.json")
    loader = load(d, "loader_gpu.json")
    dist = load(d, "distributed_gpu.json")
    lines = ["Measured on a GPU with `bash benchmarks/gpu_check.sh` (block written by `python "
             "benchmarks/gpu_report.py benchmarks/results/gpu --readme "
             "docs/explanations/performance.md` from the "
             "JSON it leaves, committed in `benchmarks/results/gpu/`).", ""]
    lines.append("- " + tests_line(d))
    if tt:
        lines.append("- " + deepfm_bound(tt, emb))
        lines += ["", device_markdown(tt), ""]
    else:
        lines.append("- Training throughput: not measured.")
    if prof:
        p = prof
        lines.append(f"- One DeepFM step at batch {p['batch']:,} ({p['precision']}, "
                     f"`benchmarks/step_profile.py`): {p['ms_per_step']:.2f} ms, of which "
                     f"the GPU's kernels take {p['device_ms_per_step']:.2f} ms "
                     f"({p['device_busy']:.0%}); {p['launches_per_step']:.0f} kernel launches "
                     f"and {p['syncs_per_step'].get('aten::_local_scalar_dense', 0):.0f} host "
                     "sync a step (the embedding dedup's unique count)"
                     + (f". With the batches gathered on the host it was "
                        f"{before['ms_per_step']:.2f} ms, the kernels "
                        f"{before['device_ms_per_step']:.2f} ms of it"
                        if before and before.get("device_ms_per_step") is not None else "")
                     + ".")
    if loader:
        sp = loader["samples_per_s"]
        lines.append(f"- The host loader (memory-mapped store -> pinned -> GPU, batch "
                     f"{loader['batch']:,}, {loader['cores']} cores): "
                     + ", ".join(f"shuffle `{k}` {v / 1e6:.1f} M" for k, v in sp.items())
                     + " samples/s. That is why a split that fits is kept on the GPU "
                     "(`train.data_on_device: auto`) and each batch gathered there.")
    if emb:
        lines.append(f"- Embedding lookup + row update alone (`benchmarks/embedding_bandwidth.py`"
                     f", {emb['rows']:,} rows x {emb['dim']}, {emb['batch']:,} x "
                     f"{emb['fields']} Zipf ids, {emb['unique_rows']:,} distinct): gather "
                     f"{emb['gather_ms']:.2f} ms ({emb['gather_fraction_of_copy']:.1%} of the "
                     f"copy bandwidth), gather + backward + lazy Adam {emb['step_ms']:.2f} ms "
                     f"({emb['step_fraction_of_copy']:.1%}).")
    if dist:
        got = {r["procs"]: r for r in dist["results"]}
        parts = []
        for n in dist["args"]["procs"]:
            r = got.get(n)
            if r is None:
                parts.append(f"{n} processes on the one GPU (sharing it over gloo): did not "
                             f"finish within {dist['args'].get('timeout')} s, not measured")
            else:
                ci = r.get("test_auc_ci95")
                parts.append(f"{n} process{'es' if n > 1 else ''}: "
                             f"{r['samples_per_s']:,.0f} samples/s, test AUC "
                             f"{r['test_auc']:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]"
                                                       if ci else ""))
        lines.append(f"- Data parallel (`benchmarks/distributed.py`, built-in data, "
                     f"{dist['args']['rows']:,} rows, global batch "
                     f"{dist['args']['batch_size']:,}): " + "; ".join(parts) + ".")
    lines.append("- Not measured: more than one GPU (NCCL), `torch.compile` or CUDA graphs on "
                 "the GPU, and ONNX Runtime's CUDA and TensorRT providers (the GPU machine's "
                 "onnxruntime has the CPU provider only).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--readme", type=Path, default=None)
    args = ap.parse_args()
    text = render(args.dir)
    print(text)
    if args.readme:
        from _readme import update_block

        update_block(args.readme, "gpu", text, after="<!-- /perf:train_throughput_avx")


if __name__ == "__main__":
    main()
