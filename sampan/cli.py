"""The ``sampan`` command line: a thin layer over the library."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import click
import numpy as np
import typer
import typer.core
from rich.console import Console

from sampan.errors import SampanError


class _Commands(typer.core.TyperGroup):
    """The one error handler of every command: a :class:`SampanError` (or a full disk) is
    ``error: <message>`` and exit code 2; anything else is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SampanError as e:
            _fail(str(e))
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            _fail(f"no space left on the device ({e.filename or e}); free some space and "
                  "run the command again (a training run resumes with --resume RUN_DIR: its "
                  "last checkpoint is intact)")


app = typer.Typer(
    cls=_Commands,
    help="Sampan: train, evaluate and use recommender models from one YAML file.\n\n"
         "Start with `sampan train` (DeepFM on the built-in synthetic data), then try "
         "`sampan train configs/criteo_deepfm.yaml` on a real Criteo file.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
console = Console()
err = Console(stderr=True)

SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", metavar="KEY=VALUE",
                 help="Override a config value, e.g. --set train.epochs=2 --set model.mlp=[64,32]."
                      " Values are parsed as YAML. Repeatable; applied after the file."),
]


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(
        help="Experiment YAML. Omit it to train DeepFM on the built-in synthetic data.")] = None,
    set_: SetOpt = None,
    resume: Annotated[Path | None, typer.Option(
        "--resume", metavar="RUN_DIR",
        help="Continue an interrupted run from its last checkpoint (uses the run's own config)."
    )] = None,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="Write the run here instead of OUTPUT_DIR/NAME/TIMESTAMP.")] = None,
    nproc_per_node: Annotated[int, typer.Option(
        "--nproc-per-node", help="Data-parallel processes on this machine (one per GPU; "
        "gloo on CPU). Launches through torch.distributed.run.")] = 1,
    nnodes: Annotated[int, typer.Option(help="Machines in the job.")] = 1,
    node_rank: Annotated[int | None, typer.Option(
        help="This machine's index (with --rdzv-endpoint the rendezvous assigns it).")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(
        "--rdzv-endpoint", metavar="HOST:PORT",
        help="Rendezvous address shared by every machine of a multi-node job.")] = None,
) -> None:
    """Prepare the data, train, evaluate on the test split and print the metrics.

    Examples:

      sampan train                                   # built-in synthetic Criteo-shaped data

      sampan train configs/criteo_deepfm.yaml --set train.epochs=2

      sampan train --resume runs/criteo_deepfm/20261130-101500

      sampan train configs/criteo_deepfm.yaml --nproc-per-node 2   # 2 processes (gloo on CPU)
    """
    import os

    from sampan import distributed
    from sampan.config import load_config
    from sampan.train.experiment import run_experiment

    if (nproc_per_node > 1 or nnodes > 1) and "WORLD_SIZE" not in os.environ:
        _launch(config, set_, resume, run_dir, nproc_per_node, nnodes, node_rank,
                rdzv_endpoint)
        return
    try:
        if resume is not None:
            if config is not None or set_:
                _fail("--resume uses the run's saved config; do not pass CONFIG or --set with it")
            cfg = load_config(resume / "config.yaml")
            run_experiment(cfg, run_dir=resume, resume=True, console=console)
        else:
            cfg = load_config(config, overrides=set_ or [])
            run_experiment(cfg, run_dir=run_dir, console=console)
    finally:
        distributed.shutdown()


def _launch(config: Path | None, set_: list[str] | None, resume: Path | None,
            run_dir: Path | None, nproc: int, nnodes: int, node_rank: int | None,
            rdzv: str | None) -> None:
    """Re-run this `sampan train` under torch.distributed.run, one process per rank."""
    from torch.distributed.run import main as torchrun

    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if rdzv:
        args += [f"--rdzv-endpoint={rdzv}", "--rdzv-backend=c10d"]
    elif nnodes == 1:
        args += ["--standalone"]
    else:
        _fail("a multi-node job needs --rdzv-endpoint HOST:PORT (the same on every machine)")
    if node_rank is not None:
        args += [f"--node-rank={node_rank}"]
    child = ["-m", "sampan", "train"]
    if config is not None:
        child.append(str(config))
    for item in set_ or []:
        child += ["--set", item]
    if resume is not None:
        child += ["--resume", str(resume)]
    if run_dir is not None:
        child += ["--run-dir", str(run_dir)]
    console.print(f"launching {nproc * nnodes} processes: torchrun {' '.join(args + child)}",
                  highlight=False)
    torchrun(args + child)


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
                    "AUCs that differ by less than this are not told apart.")] = 0,
) -> None:
    """Evaluate a trained run's best model: AUC, LogLoss (and GAUC when groups are set)."""
    from sampan.train.experiment import RunArtifacts

    art = RunArtifacts(run_dir)
    metrics = art.evaluate(data if data else split, bootstrap=bootstrap)
    if data:
        log = art.last_log
        err.print(log.describe())
    console.print_json(json.dumps(metrics))


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
    """
    from sampan.train.experiment import RunArtifacts, compare_runs

    result = compare_runs(RunArtifacts(run_a), RunArtifacts(run_b),
                          data if data else split, resamples, task)
    console.print_json(json.dumps(result))


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
) -> None:
    """Export a run's best model with its fitted feature pipeline as a bundle.

    The bundle holds the model graph (transformed tensors in, probabilities out), the
    pipeline that turns raw records into those tensors, and `manifest.json` (schema, input
    signature, metrics, versions, sha256 of every file). The export is checked against
    PyTorch on rows of the run's test split before it is written.
    """
    from sampan.export import export_run

    path = export_run(run_dir, out, fmt=format, overwrite=overwrite)
    manifest = json.loads((path / "manifest.json").read_text())
    p = manifest["parity"]
    console.print(f"exported {manifest['model']} ({manifest['format']}) to {path}: "
                  f"inputs {', '.join(i['name'] for i in manifest['inputs'])}; parity on "
                  f"{p['rows']} {p['split']} rows, max |diff| {p['max_abs_diff']:.2g}")


@app.command()
def serve(
    bundle: Annotated[str | None, typer.Argument(
        help="Bundle directory (from `sampan export`); or give `bundle:` in --config.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Serve config YAML (see sampan.config.ServeConfig).")] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind [127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [8000].")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="Also serve gRPC on this port.")] = None,
    workers: Annotated[int | None, typer.Option(help="HTTP worker processes [1].")] = None,
    set_: SetOpt = None,
) -> None:
    """Serve a bundle over HTTP (FastAPI under uvicorn) and optionally gRPC.

    Routes: `POST /v1/predict` (raw records -> probabilities), `POST /v1/rank` (context +
    candidate item ids -> top-k, user and item features joined from the feature store),
    `GET /healthz`, `GET /readyz`, `GET /metrics` (Prometheus), `POST /v1/admin/reload`
    (needs the bearer token from `admin_token` or `SAMPAN_ADMIN_TOKEN`). API docs at `/docs`.
    """
    import os

    import uvicorn

    from sampan.config import load_serve_config

    overrides = list(set_ or [])
    for key, value in (("bundle", bundle), ("host", host), ("port", port),
                       ("grpc_port", grpc_port), ("workers", workers)):
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = load_serve_config(config, overrides)
    where = f"http://{cfg.host}:{cfg.port}" + (
        f" and gRPC {cfg.host}:{cfg.grpc_port}" if cfg.grpc_port is not None else "")
    if cfg.workers > 1:
        import shutil
        import tempfile

        from sampan.serving.workers import ReloadSync

        shared = tempfile.mkdtemp(prefix="sampan-serve-")
        ReloadSync.create(f"{shared}/bundle.json", cfg.bundle, cfg.retrieval_bundle)
        os.environ["SAMPAN_SERVE_CONFIG"] = cfg.model_dump_json()
        os.environ["SAMPAN_SERVE_SYNC"] = f"{shared}/bundle.json"
        os.makedirs(f"{shared}/metrics")  # every worker's Prometheus metrics, added up
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = f"{shared}/metrics"
        os.environ["SAMPAN_GRPC_IN_WORKER"] = "1"
        console.print(f"serving {cfg.bundle} on {where} with {cfg.workers} workers")
        try:
            uvicorn.run("sampan.serving.workers:app_from_env", factory=True, host=cfg.host,
                        port=cfg.port, workers=cfg.workers, log_level="warning")
        finally:
            shutil.rmtree(shared, ignore_errors=True)
        return
    from sampan.serving.http import create_app
    from sampan.serving.service import ServerState

    state = ServerState(cfg)
    grpc_server = None
    if cfg.grpc_port is not None:
        from sampan.serving.grpc_server import start_grpc

        grpc_server = start_grpc(state, cfg.host, cfg.grpc_port)
    p = state.predictor
    console.print(f"serving {p.bundle.manifest.get('model')} ({p.version}) on {where}",
                  highlight=False)
    try:
        uvicorn.run(create_app(state), host=cfg.host, port=cfg.port, log_level="warning")
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace=1)
        state.close()


data_app = typer.Typer(help="Look at raw data, prepare it, build behaviour sequences.",
                       no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(data_app, name="data")


@data_app.command("inspect")
def data_inspect(
    file: Annotated[Path, typer.Argument(help="CSV/TSV (gzip/zstd too), Parquet or JSON lines.")],
    rows: Annotated[int, typer.Option(help="Rows to look at (from the start).")] = 100_000,
    delimiter: Annotated[str | None, typer.Option(help="Field separator (default: guessed).")]
    = None,
    header: Annotated[bool | None, typer.Option("--header/--no-header",
                                                help="Whether line 1 names the columns "
                                                     "(default: guessed).")] = None,
) -> None:
    """Guess the schema of a raw file: per column the type, null rate, cardinality and
    sample values, plus the first rows. Use it to write the `data` and `features` config."""
    from rich.table import Table

    from sampan.data.inspect import inspect_file

    info = inspect_file(file, rows=rows, delimiter=delimiter, header=header)
    console.print(f"[bold]{file}[/]: format {info['format']}"
                  + (f", delimiter {info['delimiter']!r}" if info.get("delimiter") else "")
                  + (f", header {info['header']}" if info.get("header") is not None else "")
                  + f"; {info['rows']:,} rows read")
    t = Table(show_lines=False)
    for col in ("column", "type", "null %", "distinct", "top values"):
        t.add_column(col, justify="right" if col in ("null %", "distinct") else "left")
    for c in info["columns"]:
        t.add_row(c["name"], c["type"], f"{100 * c['null_rate']:.1f}",
                  f"{c['distinct']:,}" + ("+" if c["distinct_capped"] else ""),
                  ", ".join(str(v) for v in c["top"])[:60])
    console.print(t)
    s = Table(title="first rows")
    for c in info["columns"]:
        s.add_column(c["name"], overflow="fold")
    for r in info["sample"]:
        s.add_row(*["" if v is None else str(v)[:24] for v in r])
    console.print(s)


@data_app.command("prepare")
def data_prepare(
    config: Annotated[Path | None, typer.Argument(help="Experiment YAML (default: built-in).")]
    = None,
    set_: SetOpt = None,
    out: Annotated[Path | None, typer.Option(help="Where to write the processed data "
                                                  "(default: OUTPUT_DIR/NAME/data).")] = None,
) -> None:
    """Read, validate, split, fit the feature pipeline on train and write model-ready arrays,
    without training. Reports rows kept and rejected by reason, and every feature."""

    from sampan.config import load_config
    from sampan.data.store import build_store

    cfg = load_config(config, overrides=set_ or [])
    root = out or Path(cfg.output_dir) / cfg.name / "data"
    build_store(cfg, root, echo=console.print)
    console.print(f"processed data: {root}")


@data_app.command("build-sequences")
def data_build_sequences(
    events: Annotated[list[str], typer.Argument(help="Events file(s): one row per event.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Parquet file to write.")],
    user: Annotated[str, typer.Option(help="User column.")] = "user_id",
    item: Annotated[str, typer.Option(help="Item column.")] = "item_id",
    category: Annotated[str | None, typer.Option(help="Item category column ('' for none).")]
    = "category_id",
    time: Annotated[str, typer.Option(help="Timestamp column (numbers).")] = "timestamp",
    action: Annotated[str | None, typer.Option(help="Action column ('' for none).")]
    = "behavior",
    positive: Annotated[str | None, typer.Option(
        help="Comma list of actions that are positives (default: every event).")] = None,
    history_actions: Annotated[str | None, typer.Option(
        help="Comma list of actions that enter histories (default: all).")] = None,
    targets: Annotated[str, typer.Option(help="'all' events become samples, or only "
                                              "'positive' ones.")] = "all",
    max_len: Annotated[int, typer.Option(help="Longest history kept (most recent).")] = 50,
    negatives: Annotated[int, typer.Option(help="Sampled negatives per positive.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the negative sampler.")] = 0,
    columns: Annotated[str | None, typer.Option(
        help="Comma list of column names for a file without header.")] = None,
    delimiter: Annotated[str | None, typer.Option(help="Field separator.")] = None,
    format: Annotated[str, typer.Option(
        help="auto (by extension), csv, tsv, parquet, jsonl, or sequence_lines: 'user item_1 "
             "item_2 ...' per line in time order (SASRec / S3-Rec files).")] = "auto",
) -> None:
    """Turn an events log into DIN-style samples: each target event with the user's history
    strictly before it (items and categories, most recent last), its label, and optional
    sampled negatives. Train on the output with a `sequence` feature sharing the item's
    vocabulary (see the README)."""
    from sampan.data.behaviour import BuildOptions, build_sequences

    def split(v: str | None) -> list[str] | None:
        return [x for x in v.split(",") if x] if v else None

    opt = BuildOptions(user=user, item=item, category=category or None, time=time,
                       action=action or None, positive=split(positive),
                       history_actions=split(history_actions), targets=targets,
                       max_len=max_len, negatives=negatives, seed=seed,
                       header=columns is None, columns=split(columns), delimiter=delimiter,
                       format=format)
    if format == "sequence_lines":
        opt.category, opt.action = None, None
    if targets not in ("all", "positive"):
        _fail(f"--targets must be 'all' or 'positive', got {targets!r}")
    r = build_sequences(events, out, opt)
    console.print(f"read {r.events:,} events ({r.rejected:,} rejected) of {r.users:,} users; "
                  f"wrote {r.samples:,} samples ({r.positives:,} positive, {r.negatives:,} "
                  f"negative), mean history {r.mean_history:.2f}, to {out}")


@app.command()
def models() -> None:
    """List the registered models (the values `model.name` accepts), what each is, and
    the options each takes with their defaults."""
    from rich.markup import escape

    from sampan.config import ModelConfig
    from sampan.models import get_model_class, model_names

    def options(fields: dict, skip: set[str]) -> str:
        return ", ".join(f"{k}={f.get_default(call_default_factory=True)!r}"
                         for k, f in fields.items() if k not in skip)

    shared = set(ModelConfig.model_fields)
    console.print("Every model takes " + escape(options(ModelConfig.model_fields, {"name"}))
                  + ".\nPick one with `model: {name: NAME, option: value}` or "
                  "--set model.name=NAME.\n")
    for name in model_names():
        cls = get_model_class(name)
        doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip()
        summary = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
        console.print(f"[bold]{name}[/]: {escape(summary)}")
        own = options(cls.Config.model_fields, shared)
        console.print(f"  options: {escape(own) if own else '(only the shared ones)'}\n")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
