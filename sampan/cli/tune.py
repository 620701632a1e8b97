"""``sampan tune``: search the ``tune:`` section's space with Optuna."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from sampan.cli.base import SetOpt, app, console


@app.command()
def tune(
    config: Annotated[Path, typer.Argument(help="Experiment YAML with a tune: section.")],
    set_: SetOpt = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="The study folder: study.db, trials/, defaults/, best.yaml, "
        "summary.json (default OUTPUT_DIR/NAME-tune). Run the same command again to resume "
        "the study there.")] = None,
    workers: Annotated[int, typer.Option(
        min=1, help="Trial processes on this machine, sharing the study.")] = 1,
    trials: Annotated[int | None, typer.Option(
        min=1, help="Finished trials the study ends with (default: tune.trials).")] = None,
    timeout: Annotated[float | None, typer.Option(
        min=0.1, metavar="MINUTES", help="Start no trial after this long (default: "
        "tune.timeout_minutes).")] = None,
    storage: Annotated[str | None, typer.Option(
        help="SQLAlchemy URL of the study's database, shared by every process (default: "
        "sqlite in the folder). Start `sampan tune` on several machines with one URL to "
        "search together.")] = None,
    threads: Annotated[int | None, typer.Option(
        min=1, help="Torch threads per trial (default: the cores / --workers, unless the "
        "config sets train.threads).")] = None,
    worker: Annotated[int | None, typer.Option(hidden=True)] = None,
    parent: Annotated[int | None, typer.Option(hidden=True)] = None,
    deadline: Annotated[float | None, typer.Option(hidden=True)] = None,
) -> None:
    """Search hyper-parameters: trials of the config with values from its tune: section,
    judged on the validation split, pruned when they fall behind.

    Each trial is a normal run directory (FOLDER/trials/NNNN). The config as written is
    trained once too (FOLDER/defaults); at the end the best trial is compared with it on the
    test split (paired bootstrap), and its config is written to FOLDER/best.yaml, ready for
    `sampan train`. A killed study resumes where it stopped when the command runs again.

    Examples:

      sampan tune configs/tune_deepfm.yaml --workers 2

      sampan tune configs/tune_deepfm.yaml --trials 60 --timeout 30

      sampan report runs/synthetic_deepfm-tune --out report/   # the study's pictures
    """
    from sampan.config import load_config
    from sampan.tune import cores, launch, prepare
    from sampan.tune import worker as run_worker

    if threads is None and not load_config(config, set_ or []).train.threads:
        threads = max(1, cores() // workers)
    job = prepare(config, set_ or [], out, trials=trials, timeout_minutes=timeout,
                  storage=storage, threads=threads, create=worker is None)
    if worker is not None:  # one of the processes a `--workers N` run started
        job.deadline = deadline
        run_worker(job, worker, parent, console)
        return
    argv = [sys.executable, "-m", "sampan", "tune", str(config), "--out", str(job.folder),
            "--storage", job.storage_url, "--trials", str(job.budget),
            "--parent", str(os.getpid())]
    if threads:
        argv += ["--threads", str(threads)]
    argv += [x for s in set_ or [] for x in ("--set", s)]
    if job.deadline is not None:
        argv += ["--deadline", str(job.deadline)]
    launch(job, workers, console, argv)
