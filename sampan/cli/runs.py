"""Commands on finished runs: ``eval``, ``compare``, ``predict``, ``export``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
import typer.core

from sampan.cli.base import KeyFileOpt, app, console, err, fail


def _significant(value: Any, digits: int = 6) -> Any:
    """``value`` with every float to ``digits`` significant digits, for printing: a metric
    reads 0.711123, not 0.7111234567890123 (the bootstrap's resolution is far coarser)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _significant(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_significant(v, digits) for v in value]
    return value


@app.command("eval")
def eval_(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory.")],
    data: Annotated[list[str] | None, typer.Option(
        "--data", help="Raw file(s) to evaluate, in the run's input format (default: the "
                       "run's test split).")] = None,
    split: Annotated[str, typer.Option(help="Processed split to use when --data is not given: "
                                            "train, valid or test.")] = "test",
    bootstrap: Annotated[int, typer.Option(
        min=0, help="Resample the rows this many times (e.g. 1000) and add each AUC's 95 % "
                    "interval as auc_ci95 (auc_0_ci95, ... per task): on a small test set, "
                    "AUCs that differ by less than this are not told apart. For a two-tower "
                    "or next-item model, the queries (users) are resampled and each ranking "
                    "metric gets its interval.")] = 0,
    ranking: Annotated[str, typer.Option(
        "--ranking", metavar="K[,K...]", help="Ranking cut-offs, e.g. 5,10,20. A CTR model "
        "ranks each group's rows (features.group, e.g. the user) as one query: MRR, NDCG@K, "
        "HitRate@K and Recall@K over the groups with a positive (at K=10 they are in every "
        "evaluation of a run with groups); a two-tower or next-item model reports its "
        "ranking metrics at these cut-offs too.")] = "",
) -> None:
    """Evaluate a trained run's best model: AUC, LogLoss (and GAUC, MRR, NDCG@10 and
    HitRate@10 per group when features.group is set); for a two-tower model Recall, NDCG
    and HitRate@K and MRR over the item corpus; for a next-item model HitRate and NDCG@K
    and MRR over the whole catalogue."""
    from sampan.train.experiment import RunArtifacts

    parts = [x.strip() for x in ranking.split(",") if x.strip()]
    if not all(x.isdigit() for x in parts):
        fail(f"--ranking expects cut-offs like 5,10,20, got {ranking!r}")
    ks = [int(x) for x in parts]
    if any(k < 1 for k in ks):
        fail(f"--ranking cut-offs must be 1 or more, got {ranking!r}")
    art = RunArtifacts(run_dir)
    metrics = art.evaluate(data if data else split, bootstrap=bootstrap, ranking=ks or None)
    if data:
        log = art.last_log
        err.print(log.describe())
    console.print_json(json.dumps(_significant(metrics)))


@app.command()
def report(
    runs: Annotated[list[Path], typer.Argument(help="Run directories (finished, or still "
                                               "training with --follow).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for index.html and the "
                                      "PNGs (created).")] = Path("report"),
    split: Annotated[str, typer.Option(help="Split whose scores are drawn: train, valid "
                                       "or test.")] = "test",
    resamples: Annotated[int, typer.Option(min=0, help="Bootstrap resamples of the metrics' "
                                           "95 % intervals (the AUC's; a next-item run's "
                                           "ranking metrics').")] = 500,
    follow: Annotated[float, typer.Option(
        min=0, metavar="SECONDS", help="Draw again every SECONDS while a run trains (the "
        "page reloads itself), until every run has finished; 0: once.")] = 0,
) -> None:
    """Draw runs: training curves (loss, validation metrics, learning rate, gradient and
    embedding norms), ROC, calibration and score histogram, the feature table and rejected
    rows, as an HTML page with PNGs; several runs are also overlaid with one metric table;
    a `sampan tune` folder adds its study. A run still training shows its curves so far."""
    import time

    from sampan.report import build_report
    from sampan.train.rundir import is_training

    while True:
        running = [r for r in runs if not (r / "study.json").is_file() and (
            is_training(r) or (r / "metrics.jsonl").is_file()
            and not (r / "results.json").is_file())]
        if follow and (starting := [r for r in running if not (r / "metrics.jsonl").is_file()]):
            # just started: no curve to draw yet
            console.print(f"waiting for {', '.join(map(str, starting))} to log its first "
                          f"metrics; again in {follow:g} s", highlight=False)
            time.sleep(follow)
            continue
        rep = build_report(list(runs), out, split=split, resamples=resamples,
                           refresh=follow if follow and running else None)
        console.print(f"report: {rep.page} ({rep.describe()}; open it in a browser)"
                      + (f"; {len(running)} still training, again in {follow:g} s"
                         if follow and running else ""), highlight=False)
        for note in rep.notes:
            console.print(f"note: {note}", highlight=False)
        if not (follow and running):
            return
        time.sleep(follow)


@app.command()
def compare(
    run_a: Annotated[Path, typer.Argument(help="A finished run directory (the baseline).")],
    run_b: Annotated[Path, typer.Argument(help="Another run, on the same data and split.")],
    data: Annotated[list[str] | None, typer.Option(
        "--data", help="Raw file(s) to score with both runs (default: their test split).")
    ] = None,
    split: Annotated[str, typer.Option(help="Processed split when --data is not given.")
                     ] = "test",
    resamples: Annotated[int, typer.Option(min=100, help="Bootstrap resamples.")] = 1000,
    task: Annotated[int, typer.Option(min=0, help="Label to compare (multi-task runs).")] = 0,
) -> None:
    """Is B better than A? Paired bootstrap of the AUC difference on the same rows.

    Both models score the same rows; each resample draws rows with replacement and takes
    both AUCs on it, so the spread of the difference is that of the two models on this data,
    not of two independent test sets. Prints both AUCs, `diff` (B - A), its 95 % interval
    `diff_ci95` and `p_b_better` (the share of resamples where B wins). An interval that
    holds 0 means this data cannot tell the two apart.

    Next-item runs (sasrec, hstu) and retrieval runs (two_tower) are compared on every
    ranking metric instead (HitRate@K, NDCG@K, MRR, and Recall@K for retrieval), resampling
    the queries (the users); the top-level `diff` is that of the metric early stopping
    followed (NDCG@K, Recall@K).
    """
    from sampan.train.experiment import RunArtifacts, compare_runs

    result = compare_runs(RunArtifacts(run_a), RunArtifacts(run_b),
                          data if data else split, resamples, task)
    console.print_json(json.dumps(_significant(result)))


@app.command()
def predict(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory.")],
    inputs: Annotated[list[str], typer.Argument(
        help="Raw file(s) in the run's input format. The label may be empty; in files with "
             "a header the label column may also be left out.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="CSV to write: line,probability.")],
) -> None:
    """Score raw rows through the run's saved feature pipeline and best model."""
    from sampan.data.sources import DataError
    from sampan.train.experiment import RunArtifacts

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    rows = 0
    try:
        art = RunArtifacts(run_dir)
        labels = art.store.schema.labels
        names = ["probability"] if len(labels) == 1 else [f"probability_{t}" for t in labels]
        with open(tmp, "w") as f:  # chunk by chunk: any file size in bounded memory
            f.write("line," + ",".join(names) + "\n")
            for lines, probs in art.predict_chunks(inputs):
                np.savetxt(f, np.column_stack([lines, probs]), delimiter=",",
                           fmt=["%d"] + ["%.8f"] * probs.shape[1])
                rows += len(probs)
        if not rows:
            raise DataError("no rows left to use after reading the input")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)  # a failed run leaves no half-written file
    log = art.last_log
    console.print(f"wrote {rows:,} predictions to {out}"
                  + (f"; {log.rejected:,} rows rejected {dict(log.reasons)}"
                     if log.rejected else ""))


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle directory to create.")],
    format: Annotated[str, typer.Option(
        "--format", "-f", help="onnx (served with ONNX Runtime) or torchscript.")] = "onnx",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing bundle.")] = False,
    feature_tables: Annotated[bool, typer.Option(
        help="Read the run's data files again and put its item and user tables (the "
        "attributes with one value per item / user, and each user's latest history) in "
        "the bundle, so requests need only ids.")] = True,
    key_file: KeyFileOpt = None,
) -> None:
    """Export a run's best model with its fitted feature pipeline as a bundle.

    The bundle holds the model graph (transformed tensors in, probabilities out), the
    pipeline that turns raw records into those tensors, and `manifest.json` (schema, input
    signature, metrics, versions, sha256 of every file). The export is checked against
    PyTorch on rows of the run's test split before it is written.

    With a bundle key (`--key-file`, `SAMPAN_BUNDLE_KEY` or `SAMPAN_BUNDLE_KEY_FILE`) the
    manifest is signed (HMAC-SHA256), and `sampan serve` with the same key serves it and
    refuses it once edited; the sha256s alone catch accidental damage, not a deliberate
    edit whose checksums were recomputed.
    """
    from sampan.bundle import bundle_key
    from sampan.export import export_run

    key = bundle_key(key_file)
    path = export_run(run_dir, out, fmt=format, overwrite=overwrite,
                      feature_tables=feature_tables, key=key)
    manifest = json.loads((path / "manifest.json").read_text())
    p = manifest["parity"]
    console.print(f"exported {manifest['model']} ({manifest['format']}) to {path}: "
                  f"inputs {', '.join(i['name'] for i in manifest['inputs'])}; parity on "
                  f"{p['rows']} {p['split']} rows, max |diff| {p['max_abs_diff']:.2g}")
    tables = manifest.get("feature_tables") or {}
    if "skipped" in tables:
        console.print(f"feature tables: none ({tables['skipped']})", highlight=False)
    for name, t in tables.items():
        if name == "skipped":
            continue
        hist = [h["column"] for h in t.get("histories", [])]
        console.print(f"feature tables: {name} by {t['key']}: {t['rows']:,} rows, columns "
                      f"{t['columns']}" + (f", histories {hist}" if hist else ""),
                      highlight=False)
    r = manifest.get("retrieval")
    if r:
        console.print(f"retrieval for /v1/recommend: user tower {r['user_tower']} (parity max "
                      f"|diff| {r['user_tower_max_abs_diff']:.2g}), {r['count']:,} items in a "
                      f"{r['index_kind']} faiss index of dimension {r['dim']}", highlight=False)
    console.print(f"signed with HMAC-SHA256 (key from {key.source})" if key is not None else
                  "unsigned: checksums only (set SAMPAN_BUNDLE_KEY or --key-file to sign it "
                  "for a server that requires signed bundles)", highlight=False)
