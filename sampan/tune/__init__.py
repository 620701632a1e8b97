"""``sampan tune``: hyper-parameter search on Optuna, whose trials are Sampan runs.

* :mod:`~sampan.tune.space`: the ``tune:`` section's space (sampling, the grid, the check at
  load time);
* :mod:`~sampan.tune.study`: the study in its RDB storage, the trial loop every process runs,
  pruning, and the reclaiming of a killed process's trials;
* :mod:`~sampan.tune.summary`: the defaults run, ``best.yaml`` and ``summary.json``;
* :mod:`~sampan.tune.plots`: the study's pictures for ``sampan report``.

:func:`launch` is what ``sampan tune CONFIG --workers N`` does: it runs the config as
written once (``FOLDER/defaults``, the baseline), and N processes that share the study until
it has its trials, then writes the summary.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

from rich.console import Console

from sampan.tune.study import ASKING, TuneJob, counts, prepare, work
from sampan.tune.summary import run_defaults, summarize


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def launch(job: TuneJob, workers: int, console: Console, worker_argv: list[str]) -> dict:
    """Run the study with ``workers`` processes (this one alone when 1; else as many
    ``sampan tune`` workers, started with ``worker_argv + ["--worker", K]``) and summarize."""
    c = counts(job.study())
    console.print(
        f"study {job.name}: {c['complete'] + c['pruned']} of {job.budget} trials done "
        f"({job.tune.sampler} sampler, {job.tune.pruner} pruner, {job.direction} valid "
        f"{job.metric}), {workers} process(es)"
        + (f" of {job.threads} thread(s)" if job.threads else "")
        + f"\nfolder {job.folder}, storage {job.storage_url}", highlight=False)
    if workers == 1:
        run_defaults(job, console)
        work(job, 0, console)
    else:
        procs = [subprocess.Popen([*worker_argv, "--worker", str(k)]) for k in range(workers)]
        try:
            codes = [p.wait() for p in procs]
        except BaseException:
            for p in procs:
                p.terminate()
            raise
        if any(codes):
            console.print(f"[yellow]note[/]: worker exit codes {codes}; run the same command "
                          "again to resume the study")
    return summarize(job, console)


def worker(job: TuneJob, index: int, parent: int | None, console: Console) -> None:
    """One process of ``--workers N``: the first also trains the defaults; each stops when
    its parent does (a killed ``sampan tune`` takes its workers with it)."""
    if parent:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.2)
            with ASKING:  # not between asking for a trial and marking it as ours
                os._exit(3)

        threading.Thread(target=watch, daemon=True, name="sampan-tune-parent").start()
    tag = f"[w{index}] "
    if index == 0:
        run_defaults(job, console)
    work(job, index, console, tag)


__all__ = ["TuneJob", "cores", "launch", "prepare", "run_defaults", "summarize", "work",
           "worker"]
