"""The ``sampan`` command line: a thin layer over the library."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console

app = typer.Typer(
    help="Sampan: train, evaluate and use recommender models from one YAML file.\n\n"
         "Start with `sampan train` (DeepFM on the built-in synthetic data), then try "
         "`sampan train configs/criteo_deepfm.yaml` on a real Criteo file.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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
) -> None:
    """Prepare the data, train, evaluate on the test split and print the metrics.

    Examples:

      sampan train                                   # built-in synthetic Criteo-shaped data

      sampan train configs/criteo_deepfm.yaml --set train.epochs=2

      sampan train --resume runs/criteo_deepfm/20261130-101500
    """
    from sampan.config import ConfigError, load_config
    from sampan.data.sources import DataError
    from sampan.train.experiment import run_experiment

    try:
        if resume is not None:
            if config is not None or set_:
                _fail("--resume uses the run's saved config; do not pass CONFIG or --set with it")
            cfg = load_config(resume / "config.yaml")
            run_experiment(cfg, run_dir=resume, resume=True, console=console)
        else:
            cfg = load_config(config, overrides=set_ or [])
            run_experiment(cfg, run_dir=run_dir, console=console)
    except (ConfigError, DataError, FileNotFoundError, FileExistsError) as e:
        _fail(str(e))


@app.command("eval")
def eval_(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory.")],
    data: Annotated[list[str] | None, typer.Option(
        "--data", help="Raw file(s) to evaluate, in the run's input format (default: the "
                       "run's test split).")] = None,
    split: Annotated[str, typer.Option(help="Processed split to use when --data is not given: "
                                            "train, valid or test.")] = "test",
) -> None:
    """Evaluate a trained run's best model: AUC, LogLoss (and GAUC when groups are set)."""
    from sampan.config import ConfigError
    from sampan.data.sources import DataError
    from sampan.train.experiment import RunArtifacts

    try:
        art = RunArtifacts(run_dir)
        metrics = art.evaluate(data if data else split)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if data:
        log = art.last_log
        err.print(f"read {log.read:,} rows, kept {log.kept:,}, rejected {log.rejected:,}"
                  + (f" {dict(log.reasons)} -> {log.path}" if log.rejected else ""))
    console.print_json(json.dumps(metrics))


@app.command()
def predict(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory.")],
    inputs: Annotated[list[str], typer.Argument(
        help="Raw file(s) in the run's input format. The label may be empty; in files with "
             "a header the label column may also be left out.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="CSV to write: line,probability.")],
) -> None:
    """Score raw rows through the run's saved feature pipeline and best model."""
    from sampan.config import ConfigError
    from sampan.data.sources import DataError
    from sampan.train.experiment import RunArtifacts

    try:
        art = RunArtifacts(run_dir)
        probs = art.predict(inputs)
    except (ConfigError, DataError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    lines = art.last_log
    line_numbers = art.read_lines
    out.parent.mkdir(parents=True, exist_ok=True)
    names = ["probability"] if probs.shape[1] == 1 else [f"probability_{t}"
                                                       for t in art.store.schema.labels]
    with open(out, "w") as f:
        f.write("line," + ",".join(names) + "\n")
        np.savetxt(f, np.column_stack([line_numbers, probs]), delimiter=",",
                   fmt=["%d"] + ["%.8f"] * probs.shape[1])
    console.print(f"wrote {len(probs):,} predictions to {out}"
                  + (f"; {lines.rejected:,} rows rejected {dict(lines.reasons)}"
                     if lines.rejected else ""))


@app.command()
def models() -> None:
    """List the registered model names (the values `model.name` accepts)."""
    from sampan.models import get_model_class, model_names

    for name in model_names():
        doc = (get_model_class(name).__doc__ or "").strip().splitlines()[0]
        console.print(f"[bold]{name:10}[/] {doc}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
