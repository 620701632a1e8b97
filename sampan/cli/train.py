"""``sampan train``: one experiment, in one process or launched data-parallel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
import typer.core

from sampan.cli.base import AddressOpt, EngineOpt, SetOpt, app, console, engine_sets, fail


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(
        help="Experiment YAML. Omit it to train DeepFM on the built-in synthetic data.")] = None,
    set_: SetOpt = None,
    from_: Annotated[str | None, typer.Option(
        "--from", metavar="FORMAT",
        help="Read CONFIG as this format: sampan or paddlerec (a PaddleRec model folder's "
        "config.yaml). Default: detected (PaddleRec configs have runner: and "
        "hyper_parameters: sections).")] = None,
    resume: Annotated[Path | None, typer.Option(
        "--resume", metavar="RUN_DIR",
        help="Continue an interrupted run from its last checkpoint (uses the run's own config)."
    )] = None,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="Write the run here instead of OUTPUT_DIR/NAME/TIMESTAMP.")] = None,
    nproc_per_node: Annotated[int, typer.Option(
        "--nproc-per-node", help="Data-parallel processes on this machine (one per GPU; "
        "gloo on CPU). Launches through torch.distributed.run.", min=1)] = 1,
    nnodes: Annotated[int, typer.Option(help="Machines in the job.", min=1)] = 1,
    node_rank: Annotated[int | None, typer.Option(
        help="This machine's index (with --rdzv-endpoint the rendezvous assigns it).")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(
        "--rdzv-endpoint", metavar="HOST:PORT",
        help="Rendezvous address shared by every machine of a multi-node job.")] = None,
    engine: EngineOpt = None,
    address: AddressOpt = None,
) -> None:
    """Prepare the data, train, evaluate on the test split and print the metrics.

    Examples:

      sampan train                                   # built-in synthetic Criteo-shaped data

      sampan train configs/criteo_deepfm.yaml --set train.epochs=2

      sampan train --resume runs/criteo_deepfm/20261130-101500

      sampan train configs/criteo_deepfm.yaml --nproc-per-node 2   # 2 processes (gloo on CPU)

      sampan train PaddleRec/models/rank/dnn/config.yaml   # a PaddleRec model folder
    """
    import os

    from sampan import distributed
    from sampan.config import load_config
    from sampan.train.experiment import print_results, run_experiment

    set_ = [*(set_ or []), *engine_sets(engine, address)]
    if (nproc_per_node > 1 or nnodes > 1) and "WORLD_SIZE" not in os.environ:
        _launch(config, set_, from_, resume, run_dir, nproc_per_node, nnodes, node_rank,
                rdzv_endpoint)
        return
    done = False
    try:
        if resume is not None:
            if config is not None or set_ or from_:
                fail("--resume uses the run's saved config; do not pass CONFIG, --set or "
                     "--from with it")
            cfg = load_config(resume / "config.yaml")
            if (resume / "results.json").exists():  # its saved config has run its course
                results = json.loads((resume / "results.json").read_text())
                console.print(f"[yellow]note[/]: {resume} has finished "
                              f"({results.get('steps', '?')} steps); nothing to resume. Its "
                              "results:")
                print_results(results, console)
            else:
                run_experiment(cfg, run_dir=resume, resume=True, console=console)
        else:
            if from_ is not None and config is None:
                fail(f"--from {from_} reads CONFIG: give the config file")
            cfg = load_config(config, overrides=set_ or [], source=from_)
            run_experiment(cfg, run_dir=run_dir, console=console)
        done = True
    finally:
        distributed.shutdown(failed=not done)


def _launch(config: Path | None, set_: list[str] | None, from_: str | None,
            resume: Path | None,
            run_dir: Path | None, nproc: int, nnodes: int, node_rank: int | None,
            rdzv: str | None) -> None:
    """Re-run this `sampan train` under torch.distributed.run, one process per rank."""
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from sampan.config import load_config
    from sampan.train.evaluate import resolve_device

    # the config is checked here once, not in every process (each would fail alike)
    cfg = load_config(resume / "config.yaml") if resume is not None else \
        load_config(config, overrides=set_ or [], source=from_)
    world, batch = nproc * nnodes, cfg.train.batch_size
    device = resolve_device(cfg.train.device)  # a GPU this machine lacks: said once
    if device.type == "cuda" and nproc > torch.cuda.device_count():
        fail(f"--nproc-per-node {nproc} processes on train.device={cfg.train.device!r}: this "
             f"machine has {torch.cuda.device_count()} CUDA device(s), one a process")
    if isinstance(batch, int) and batch < 2 * world:
        fail(f"train.batch_size {batch} (the global batch) must give each of the {world} "
             f"processes two rows or more: --set train.batch_size={2 * world} or more")

    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if rdzv:
        args += [f"--rdzv-endpoint={rdzv}", "--rdzv-backend=c10d"]
    elif nnodes == 1:
        args += ["--standalone"]
    else:
        fail("a multi-node job needs --rdzv-endpoint HOST:PORT (the same on every machine)")
    if node_rank is not None:
        args += [f"--node-rank={node_rank}"]
    child = ["-m", "sampan", "train"]
    if config is not None:
        child.append(str(config))
    for item in set_ or []:
        child += ["--set", item]
    if from_ is not None:
        child += ["--from", from_]
    if resume is not None:
        child += ["--resume", str(resume)]
    if run_dir is not None:
        child += ["--run-dir", str(run_dir)]
    console.print(f"launching {nproc * nnodes} processes: torchrun {' '.join(args + child)}",
                  highlight=False)
    try:
        torchrun(args + child)
    except ChildFailedError as e:  # each process printed its own error above
        fail(f"{len(e.failures)} of the {world} processes failed; their errors are above",
             code=1)
