"""Next-item benchmark: Sampan's SASRec and HSTU against RecBole 1.2.1's SASRec on the same
leave-one-out split, every model's test item ranked against the whole catalogue by the same
code. Prints, and writes into RESULTS.md (the ``perf:sequential`` block):

* NDCG@10, HitRate@10 and MRR on the test users, with 95 % bootstrap intervals over users;
* the paired difference of NDCG@10 with RecBole's SASRec (the same users resampled);
* wall time per epoch and wall time to the best validation, on the same machine and
  threads.

Datasets: Amazon Beauty, Sports and Toys (the S3-Rec 5-core files) and the partial
MovieLens-1M in ../shared/data. RecBole runs in its own environment (see
benchmarks/recbole_sasrec.py); without ``--recbole`` only Sampan's models run.

    python benchmarks/sequential.py --datasets beauty --recbole rb/bin/python
    python benchmarks/sequential.py --datasets beauty sports toys ml1m --models sasrec hstu
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "benchmarks"))

DATASETS = {  # name: (source, max_len)
    "beauty": ("amazon_s3rec/Beauty.txt.gz", 50),
    "sports": ("amazon_s3rec/Sports_and_Outdoors.txt.gz", 50),
    "toys": ("amazon_s3rec/Toys_and_Games.txt.gz", 50),
    "ml1m": ("movielens/ml-1m-partial/ratings.partial_users1-2999.dat.gz", 200),
}
# Sampan's recipe for both models (configs/amazon_beauty_sasrec.yaml); HSTU with the
# reference's cosine / temperature scoring
MODELS = {
    "sasrec": {"name": "sasrec", "embedding_dim": 64, "blocks": 2, "heads": 1,
               "dropout": 0.5},
    "hstu": {"name": "hstu", "embedding_dim": 64, "blocks": 2, "heads": 2, "dropout": 0.5},
}
TRAIN = {"epochs": 60, "batch_size": 128, "lr": 0.001, "schedule": "constant",
         "embedding_l2": 0.0, "progress": False,
         "tensorboard": False}
RESAMPLES = 1000


def events(name: str, work: Path, max_users: int | None = None) -> tuple[Path, Path]:
    """The dataset as Sampan's samples (one row per event, with its history) and as a TSV
    of (user, item, position) events for RecBole: the same events, the same order. With
    ``max_users``, only the first users (a quick check of the pipeline)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from sampan.data.behaviour import BuildOptions, build_sequences

    source, max_len = DATASETS[name]
    tag = f"{name}-{max_users}" if max_users else name
    samples, tsv = work / f"{tag}.parquet", work / f"{tag}.tsv"
    if samples.exists() and tsv.exists():
        return samples, tsv
    path = DATA / source
    if max_users and name != "ml1m":
        with pa.input_stream(str(path), compression="gzip") as f:
            head = f.read().decode().splitlines()[:max_users]
        path = work / f"{tag}.txt"
        path.write_text("\n".join(head) + "\n")
    if name == "ml1m":  # UserID::MovieID::Rating::Timestamp -> time-ordered events
        with pa.input_stream(str(path), compression="gzip") as f:
            text = f.read().decode()
        t = pacsv.read_csv(pa.py_buffer(text.replace("::", "\t").encode()),
                           read_options=pacsv.ReadOptions(
                               column_names=["user_id", "item_id", "rating", "timestamp"]),
                           parse_options=pacsv.ParseOptions(delimiter="\t"),
                           convert_options=pacsv.ConvertOptions(column_types={
                               "user_id": pa.string(), "item_id": pa.string()}))
        if max_users:
            t = t.filter(pc.less_equal(pc.cast(t.column("user_id"), pa.int64()), max_users))
        raw = work / f"{tag}_events.parquet"
        pq.write_table(t.select(["user_id", "item_id", "timestamp"]), raw)
        build_sequences(str(raw), samples, BuildOptions(category=None, action=None,
                                                        max_len=max_len))
    else:
        build_sequences(str(path), samples, BuildOptions(format="sequence_lines",
                                                         max_len=max_len))
    t = pq.read_table(samples, columns=["user_id", "item_id", "timestamp"])
    lines = ["user_id\titem_id\ttimestamp"]
    cols = [pc.cast(t.column(c), pa.string()).to_pylist() for c in t.column_names]
    lines += ["\t".join(row) for row in zip(*cols, strict=True)]
    tsv.write_text("\n".join(lines) + "\n")
    return samples, tsv


def sampan_run(name: str, model: str, samples: Path, work: Path, epochs: int,
               reuse: bool = False) -> dict:
    """Train (``reuse``: take the finished run already in ``work``), then rank the test
    users: metrics, ranks by user and wall times."""
    from rich.console import Console

    from sampan.config import load_config
    from sampan.train.experiment import run_experiment

    max_len = DATASETS[name][1]
    run = work / f"{samples.stem}-{model}"  # beauty-sasrec, beauty-3000-sasrec
    if reuse:
        if not (run / "results.json").exists():
            raise SystemExit(f"--reuse-sampan: no finished run {run}; run without it first")
        made = json.loads((run / "results.json").read_text())
        if made.get("model") != MODELS[model]["name"]:
            raise SystemExit(f"--reuse-sampan: {run} trained {made.get('model')!r}")
        return sampan_result(run, made)
    if run.exists():
        import shutil

        shutil.rmtree(run)
    cfg = load_config(raw={
        "name": f"{name}_{model}", "output_dir": str(work),
        "data": {"train": str(samples), "split": {"method": "leave_one_out",
                                                  "column": "user_id", "order": "timestamp"}},
        "features": {"label": "label", "group": "user_id", "categorical": ["item_id"],
                     "lists": [{"name": "hist_item_id", "share": "item_id",
                                "kind": "sequence", "max_len": max_len}]},
        "model": MODELS[model], "train": {**TRAIN, "epochs": epochs}})
    res = run_experiment(cfg, run_dir=run, console=Console(quiet=True))
    from accuracy import machine

    (run / "made.json").write_text(json.dumps({"date": dt.date.today().isoformat(),
                                               "machine": machine()}))
    return sampan_result(run, res)


def sampan_result(run: Path, res: dict) -> dict:
    """A finished run's test ranks by user and wall times (``res``: its results)."""
    from sampan.train.experiment import RunArtifacts

    history = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [h for h in history if h.get("split") == "valid"]
    logged = [h for h in history if h.get("split") == "train"]
    # training began one logging interval before the first training record (the data
    # preparation before it is left out, as RecBole's is)
    first, second = logged[0], logged[1] if len(logged) > 1 else logged[0]
    per_step = (second["time"] - first["time"]) / max(second["step"] - first["step"], 1)
    start = first["time"] - first["step"] * per_step
    best = max(valid, key=lambda h: h["ndcg@10"])
    stamps = [start] + [h["time"] for h in valid]
    art = RunArtifacts(run)
    test = art.labelled("test")
    ranks, _ = art.evaluator.task.ranks(art.model, test, art.evaluator.infer)
    users = np.asarray(test.group)[test.positive_rows()]
    return {"ranks": dict(zip(users.tolist(), ranks.tolist(), strict=True)),
            "test": res["test"], "epochs": len(valid),
            "epoch_seconds": float(np.mean(np.diff(stamps))),
            "seconds_to_best": best["time"] - start, "train_seconds": res["train_seconds"],
            "best_epoch": valid.index(best), "made": made_by(run)}


def made_by(run: Path) -> str:
    """When and where a Sampan run trained (its date alone for runs that did not record
    their machine)."""
    if (run / "made.json").exists():
        m = json.loads((run / "made.json").read_text())
        return f"{m['date']} on {m['machine']['cpu']}"
    day = dt.date.fromtimestamp((run / "results.json").stat().st_mtime).isoformat()
    return f"{day} (machine not recorded)"


def recbole_run(python: str | None, name: str, tsv: Path, work: Path, threads: int,
                epochs: int, result: Path | None = None) -> dict:
    """RecBole's SASRec on ``tsv``; with ``python`` None, its result from an earlier run in
    ``work`` on the same events, or ``result``, a result made elsewhere (on a GPU machine:
    benchmarks/recbole_gpu.sh); ``r["reused"]`` then says when and where that run was."""
    from accuracy import machine

    from sampan.data.hashing import stable_hash

    out = work / f"{tsv.stem}-recbole.json"
    settings = {"events_bytes": tsv.stat().st_size, "max_len": DATASETS[name][1],
                "threads": threads, "epochs": epochs}
    if python is None:
        src = result or out
        if not src.exists():
            raise SystemExit(f"--reuse-recbole: no earlier RecBole result {src}; run with "
                             "--recbole PYTHON first")
        r = json.loads(src.read_text())
        inputs = r.get("inputs", {})  # what recbole_sasrec.py trained on (since 2026-12-07)
        if inputs and (inputs["events_sha256"] != file_sha256(tsv)
                       or inputs["max_len"] != DATASETS[name][1]):
            raise SystemExit(f"{src} was made on other events or another length than "
                             f"{tsv} at {DATASETS[name][1]}: {inputs}")
        if result is not None:
            if not inputs:
                raise SystemExit(f"--recbole-result: {result} does not say what it trained on")
            r["reused"] = r.get("made", f"{dt.date.fromtimestamp(result.stat().st_mtime)} on "
                                f"{r.get('device_name', 'an unnamed machine')}")
        else:
            made = r.get("settings", {})
            # results written before the settings were recorded carry none to check
            if made and any(made.get(k) != v for k, v in settings.items()):
                raise SystemExit(f"--reuse-recbole: {out} was made with {made}, not "
                                 f"{settings}")
            r["reused"] = r.get("made", dt.date.fromtimestamp(
                out.stat().st_mtime).isoformat())
    else:
        cmd = [python, str(ROOT / "benchmarks" / "recbole_sasrec.py"), str(tsv), str(out),
               "--max-len", str(DATASETS[name][1]), "--threads", str(threads),
               "--epochs", str(epochs)]
        subprocess.run(cmd, check=True)
        r = json.loads(out.read_text())
        r |= {"settings": settings, "made": f"{dt.date.today().isoformat()} on "
              f"{machine()['cpu']}"}
        out.write_text(json.dumps(r))
    import pyarrow as pa

    users = list(r["ranks"])
    hashed = stable_hash(pa.array(users)).view(np.int64).tolist()
    r["ranks"] = dict(zip(hashed, (r["ranks"][u] for u in users), strict=True))
    r["epoch_seconds"] = float(np.mean(r["epoch_seconds"])) if r["epoch_seconds"] else 0.0
    return r


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def ndcg10(ranks: np.ndarray) -> np.ndarray:
    return np.where(ranks <= 10, 1.0 / np.log2(np.minimum(ranks, 1e18) + 1.0), 0.0)


def summary(ranks: np.ndarray, rng: np.random.Generator) -> dict:
    per = {"ndcg@10": ndcg10(ranks), "hitrate@10": (ranks <= 10).astype(float),
           "mrr": 1.0 / ranks}
    idx = rng.integers(0, len(ranks), (RESAMPLES, len(ranks)))
    return {k: [float(v.mean()), *np.quantile(v[idx].mean(axis=1), [0.025, 0.975]).tolist()]
            for k, v in per.items()}


def paired(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> list[float]:
    d = ndcg10(a) - ndcg10(b)
    idx = rng.integers(0, len(d), (RESAMPLES, len(d)))
    return [float(d.mean()), *np.quantile(d[idx].mean(axis=1), [0.025, 0.975]).tolist()]


def earlier(path: Path) -> dict:
    """The datasets of an earlier run of the same block, each with the command, date and
    machine that made it: a run of some datasets keeps the others' rows."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if "machine" in old:  # one run for every dataset
        run = {k: old[k] for k in ("command", "date", "machine")}
        return {n: {"run": run, "models": models} for n, models in old["datasets"].items()}
    return old["datasets"]


def run_line(names: list[str], run: dict) -> str:
    m = run["machine"]
    return (f"{', '.join(names)}: `{run['command']}` on {run['date']}, {m['cpu']}, "
            f"{m['cores']} cores, {m['threads']} torch threads, PyTorch {m['torch']}."
            + (f" {run['caveat']}" if run.get("caveat") else ""))


def markdown(report: dict) -> str:
    runs: dict[str, list[str]] = {}  # each run's command, with the datasets it made
    for name, d in report["datasets"].items():
        runs.setdefault(json.dumps(d["run"], sort_keys=True), []).append(name)
    made = [run_line(names, json.loads(r)) for r, names in runs.items()]
    lines = ["## Next-item recommendation (leave-one-out, full ranking)", "",
             "Generated by (datasets: command, date, machine):", "",
             *(f"- {x}" for x in made), "",
             "Each model's test item is ranked against every item by the same code (ties "
             "pessimistic); [a, b] = 95 % bootstrap interval over the test users; Δ = paired "
             "difference of NDCG@10 with RecBole's SASRec (for HSTU also with Sampan's "
             "SASRec) on the same users.", "",
             "| dataset | model | NDCG@10 | HitRate@10 | MRR | Δ NDCG@10 vs RecBole | "
             "Δ vs SASRec | s / epoch | s to best valid | epochs |", "|" + "---|" * 10]
    for name, d in report["datasets"].items():
        for model, r in d["models"].items():
            s = r["summary"]
            cell = [f"{s[k][0]:.4f} [{s[k][1]:.4f}, {s[k][2]:.4f}]"
                    for k in ("ndcg@10", "hitrate@10", "mrr")]
            delta = [f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]" if d else "-"
                     for d in (r.get("vs_recbole"), r.get("vs_sasrec"))]
            lines.append(f"| {name} | {model} | " + " | ".join(cell + delta)
                         + f" | {r['epoch_seconds']:.1f} | {r['seconds_to_best']:.0f} | "
                         f"{r['epochs']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", nargs="*", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--recbole", metavar="PYTHON", help="a Python with RecBole 1.2.1")
    ap.add_argument("--reuse-recbole", action="store_true",
                    help="take RecBole's result from an earlier run in --work on the same "
                    "events and settings instead of training it again")
    ap.add_argument("--recbole-result", type=Path, metavar="JSON",
                    help="RecBole's result made elsewhere on the same events (on a GPU "
                    "machine: benchmarks/recbole_gpu.sh) instead of training it here; with "
                    "one dataset")
    ap.add_argument("--reuse-sampan", action="store_true",
                    help="take Sampan's finished runs in --work instead of training again")
    ap.add_argument("--events-only", action="store_true",
                    help="only write each dataset's events (Sampan's samples and RecBole's "
                    "TSV) into --work")
    ap.add_argument("--epochs", type=int, default=TRAIN["epochs"],
                    help="the most epochs each model trains (both stop early)")
    ap.add_argument("--caveat", help="a note on the run, printed in its line (e.g. that "
                    "other jobs shared the cores)")
    ap.add_argument("--max-users", type=int, help="only the first users (a quick check)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_sequential")
    ap.add_argument("--json", type=Path,
                    default=ROOT / "benchmarks" / "results" / "sequential.json")
    ap.add_argument("--results", type=Path, default=ROOT / "RESULTS.md")
    a = ap.parse_args()
    if sum(map(bool, (a.recbole, a.reuse_recbole, a.recbole_result))) > 1:
        ap.error("one of --recbole (train RecBole here), --reuse-recbole (its earlier result "
                 "in --work) and --recbole-result (a result made elsewhere)")
    if a.recbole_result and len(a.datasets) != 1:
        ap.error("--recbole-result is one dataset's result: name that dataset alone")
    import torch
    from _readme import update_block
    from accuracy import machine

    a.work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    # a run on the first users only is a block (and a file) of its own
    tag = f"_first{a.max_users}users" if a.max_users else ""
    out_json = a.json.with_name(a.json.stem + tag + a.json.suffix)
    argv = [x for x in sys.argv[1:] if not x.startswith("--caveat=")]
    if "--caveat" in argv:  # the command as typed, its caveat (printed beside it) left out
        at = argv.index("--caveat")
        argv = argv[:at] + argv[at + 2:]
    run_info = {"command": shlex.join(["python", "benchmarks/sequential.py", *argv]),
                "date": dt.date.today().isoformat(), "machine": machine()}
    report = {"datasets": earlier(out_json)}
    if a.events_only:
        for name in a.datasets:
            print(*events(name, a.work, a.max_users))
        return
    for name in a.datasets:
        samples, tsv = events(name, a.work, a.max_users)
        runs = {f"sampan {m}": sampan_run(name, m, samples, a.work, a.epochs, a.reuse_sampan)
                for m in a.models}
        info = dict(run_info)
        notes = [a.caveat] if a.caveat else []
        if a.reuse_sampan:
            notes.append("Sampan's rows are its runs of " + ", ".join(sorted({
                r["made"] for r in runs.values()})) + ".")
        if a.recbole or a.reuse_recbole or a.recbole_result:
            runs["recbole sasrec"] = r = recbole_run(a.recbole, name, tsv, a.work,
                                                     torch.get_num_threads(), a.epochs,
                                                     a.recbole_result)
            if "reused" in r:
                notes.append(f"RecBole's row is its run of {r['reused']}.")
            if r.get("device", "cpu") != "cpu":
                notes.append(f"RecBole trained on a GPU ({r['device_name']}): its time "
                             "columns are not comparable with Sampan's.")
            if r.get("time_limited_after_epochs"):
                n = r["time_limited_after_epochs"]
                notes.append(f"RecBole reached its time limit after {n} epoch"
                             f"{'s' if n != 1 else ''} (best at epoch {r['best_epoch'] + 1}).")
        if notes:
            info["caveat"] = " ".join(notes)
        users = sorted(set.intersection(*(set(r["ranks"]) for r in runs.values())))
        ranks = {k: np.array([r["ranks"][u] for u in users], np.float64)
                 for k, r in runs.items()}
        np.savez(a.work / f"{samples.stem}-ranks.npz", users=np.array(users),
                 **{k.replace(" ", "_"): v for k, v in ranks.items()})  # to compare later
        out = {}
        for k, r in runs.items():
            out[k] = {"summary": summary(ranks[k], rng), "epochs": r["epochs"],
                      "epoch_seconds": r["epoch_seconds"],
                      "seconds_to_best": r["seconds_to_best"], "users": len(users)}
            if "recbole sasrec" in ranks and k != "recbole sasrec":
                out[k]["vs_recbole"] = paired(ranks[k], ranks["recbole sasrec"], rng)
            if "sampan sasrec" in ranks and k == "sampan hstu":
                out[k]["vs_sasrec"] = paired(ranks[k], ranks["sampan sasrec"], rng)
            print(name, k, {m: round(v[0], 4) for m, v in out[k]["summary"].items()},
                  f"{r['epoch_seconds']:.1f} s/epoch, {r['seconds_to_best']:.0f} s to best",
                  flush=True)
        report["datasets"][name] = {"run": info, "models": out}
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(report, indent=1))  # each dataset as it ends
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1))
    text = markdown(report)
    if a.max_users:
        text = text.replace("(leave-one-out, full ranking)",
                            f"(leave-one-out, full ranking; the first {a.max_users:,} users)")
    print(text)
    update_block(a.results, "sequential" + tag, text)


if __name__ == "__main__":
    main()
