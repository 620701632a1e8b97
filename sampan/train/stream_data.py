"""The data side of a stream run: its training settings, the roles it reads, its
windows as arrays, and its ``data/`` folder (pipeline, manifest, the latest window's first
rows as ``valid``), written so that a kill at any moment leaves a whole folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from sampan.config import ExperimentConfig, load_config
from sampan.data.arrays import SplitArrays
from sampan.data.pipeline import FeaturePipeline
from sampan.data.roles import ColumnRoles
from sampan.data.store import MARK, _SplitWriter
from sampan.errors import ConfigError, MissingPathError, RunError

RECENT_ROWS = 1024  # rows of the latest window kept in data/valid
TRACE_ENV = "SAMPAN_STREAM_TRACE"  # a test hook: what every checkpointed window held


# what a resumed stream may change in its saved config: where the stream is read and
# published, and when it stops; never what is read or how it is trained
RESUME_KEYS = ("stream.kafka.brokers", "stream.kafka.options", "stream.directory.root",
               "stream.directory.poll_seconds", "stream.publish", "stream.idle_stop_seconds",
               "stream.max_windows")


def resolve_run(cfg: ExperimentConfig, run_dir: str | Path | None,
                from_run: str | Path | None, resume: bool,
                overrides: list[str] | None = None
                ) -> tuple[ExperimentConfig, Path, Path | None]:
    """``(config, run directory, --from run)`` of a new or resumed stream run (a resumed
    one keeps its saved config, changed only by ``overrides`` of :data:`RESUME_KEYS`, and
    the run it started from). A run directory whose earlier start trained no window (it
    could not reach its source, say) takes a new start."""
    from sampan.train.experiment import new_run_dir
    from sampan.train.state import LAST

    from_path = Path(from_run) if from_run is not None else None
    if resume:
        if run_dir is None:
            raise ConfigError("resume needs the run directory")
        run = Path(run_dir)
        if not (run / "config.yaml").exists():
            raise MissingPathError(f"{run} is not a stream run directory (no config.yaml)")
        for o in overrides or []:
            key = o.split("=", 1)[0].strip()
            if not any(key == k or key.startswith(k + ".") for k in RESUME_KEYS):
                raise ConfigError(f"--set {key}: a resumed stream keeps its saved config; it "
                                  f"may change only {', '.join(RESUME_KEYS)}")
        cfg = load_config(run / "config.yaml", overrides=overrides or [])
        saved = run / "stream-from.txt"
        if saved.exists():
            from_path = Path(saved.read_text().strip())
    else:
        run = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
        if (run / "config.yaml").exists() and (run / "checkpoints" / LAST).exists():
            raise RunError(f"{run} already holds a run; resume it with --resume {run}")
    return cfg, run, from_path


def truncate_trace(windows: int) -> None:
    """The test hook's trace cut back to the windows a resumed run's checkpoint holds."""
    trace = os.environ.get(TRACE_ENV)
    if not trace or not Path(trace).exists():
        return
    keep = []
    for line in Path(trace).read_text().splitlines():
        try:
            if json.loads(line)["window"] <= windows:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            continue  # cut short by a kill
    Path(trace).write_text("".join(k + "\n" for k in keep))


def stream_train_config(cfg: ExperimentConfig) -> tuple[ExperimentConfig, list[str]]:
    """The training settings of a stream: one pass per window, a constant rate after the
    warmup (a stream has no end to decay towards), no early stopping, no warm start;
    returns the config and notes on what changed."""
    tc = cfg.train
    notes = []
    upd: dict[str, Any] = {"epochs": 1, "max_steps": None, "eval_every_steps": None,
                           "checkpoint_every_steps": None, "first_order_warm_start": False,
                           "shuffle": "none", "progress": False}
    if tc.schedule != "constant":
        notes.append(f"train.schedule {tc.schedule} -> constant: a stream has no end to "
                     "decay the learning rate towards")
        upd["schedule"] = "constant"
    if tc.embedding_placement == "row_sharded":
        raise ConfigError("sampan stream runs in one process; train.embedding_placement "
                          "row_sharded is for data-parallel runs")
    return cfg.model_copy(update={"train": tc.model_copy(update=upd)}), notes


def read_roles(pipe: FeaturePipeline, stream: Any, data: Any) -> ColumnRoles:
    """The columns a stream reads: the pipeline's, with labels, and its time and oracle
    columns."""
    roles = pipe.roles(with_labels=True, with_extra=False)
    extra = [c for c in (stream.time_column, data.oracle_column) if c and c not in roles.all]
    return ColumnRoles(numeric=roles.numeric + extra, categorical=roles.categorical,
                       required=roles.required, labels=roles.labels, lists=roles.lists)


def stream_arrays(pipe: FeaturePipeline, table: pa.Table, data: Any) -> SplitArrays:
    """A window's rows as arrays (with the oracle column, when the data has one)."""
    out = SplitArrays.concat([pipe.transform(table, with_labels=True)], None)
    oc = data.oracle_column
    if oc and oc in table.column_names:
        out.oracle = table.column(oc).to_numpy(zero_copy_only=False).astype(np.float64)
    return out


class StreamData:
    """A stream run's ``data/`` folder."""

    def __init__(self, run: Path, stream: Any):
        self.run, self.s = run, stream
        self._manifest: dict[str, Any] = {}

    def write(self, pipe: FeaturePipeline, table: pa.Table, fitted_on: str) -> None:
        """``data/``: the pipeline (once), then the manifest and the first rows of
        ``table`` as ``valid`` (:meth:`write_recent`)."""
        root = self.run / "data"
        if not (root / "pipeline").exists():
            root.mkdir(parents=True, exist_ok=True)
            (root / MARK).touch()
            pipe.save(root / "pipeline")
        self._manifest = {"schema": pipe.schema().to_json(),
                          "stream": self.s.model_dump(mode="json"),
                          "fitted_on": {"split": fitted_on, "rows": pipe.fitted_rows_},
                          "features": pipe.feature_report(), "oracle": False}
        self.write_recent(pipe, table)

    def write_recent(self, pipe: FeaturePipeline, table: pa.Table) -> None:
        """The first rows of ``table`` as the ``valid`` split, swapped in whole: a kill at
        any moment leaves the old rows or the new ones (see :meth:`repair`)."""
        root = self.run / "data"
        part = table.slice(0, RECENT_ROWS)
        tmp, dest, old = root / "valid.tmp", root / "valid", root / "valid.old"
        shutil.rmtree(tmp, ignore_errors=True)
        w = _SplitWriter(tmp, pipe.schema(), part.num_rows, None)
        w.append(pipe.transform(part, with_labels=True))
        w.close()
        shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
        manifest = {**self._manifest, "splits": {
            "train": {"rows": 0, "from": "the stream"},
            "valid": {"rows": part.num_rows, "from": "the latest window's first rows"},
            "test": {"rows": 0, "from": "the stream"}}}
        mtmp = root / "manifest.json.tmp"
        mtmp.write_text(json.dumps(manifest, indent=1))
        os.replace(mtmp, root / "manifest.json")

    def repair(self) -> None:
        """After a kill in :meth:`write_recent`: the rows it was swapping out come back."""
        root = self.run / "data"
        if not (root / "valid").exists() and (root / "valid.old").exists():
            os.replace(root / "valid.old", root / "valid")
        for p in ("valid.tmp", "valid.old", "manifest.json.tmp"):
            q = root / p
            shutil.rmtree(q, ignore_errors=True) if q.is_dir() else q.unlink(missing_ok=True)
        self._manifest = {k: v for k, v in json.loads(
            (root / "manifest.json").read_text()).items() if k != "splits"}
