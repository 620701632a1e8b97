"""A run directory's lock and name: what makes one process the only one training a run.

(The directory's layout is described in :mod:`sampan.train.experiment`.)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sampan.config import ExperimentConfig


def lock_run(run: Path) -> Any:
    """Take the run directory's lock (``run/.lock``, an exclusive ``flock`` released when
    the process ends, kill -9 included) and return the open file that holds it; refuse
    with :class:`~sampan.errors.SampanError` when another process holds it."""
    import fcntl
    import os

    from sampan.errors import SampanError

    run.mkdir(parents=True, exist_ok=True)
    f = open(run / ".lock", "a+")  # noqa: SIM115 - held until the run ends
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SampanError(f"{run} is in use by {holder}: it is still training; wait for it "
                          "to finish (or stop it) before resuming") from None
    f.truncate(0)
    f.write(f"process {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def is_training(run: Path) -> bool:
    """Whether a process holds ``run``'s lock now: it is training (the file itself stays
    after the run ends; its lock does not, however the process ended)."""
    import fcntl

    try:
        with open(run / ".lock") as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def _clear_for_restart(run: Path) -> None:
    """Everything a run stopped before its first checkpoint wrote, but its config and lock:
    partial data, metrics records, a start checkpoint, temporary files."""
    import shutil

    for p in run.iterdir():
        if p.name not in ("config.yaml", ".lock"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def new_run_dir(cfg: ExperimentConfig) -> Path:
    base = Path(cfg.output_dir) / cfg.name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = base / stamp
    k = 1
    while path.exists():
        k += 1
        path = base / f"{stamp}-{k}"
    return path
