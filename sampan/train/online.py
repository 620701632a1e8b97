"""Online training from a stream (``sampan stream``): windows of rows, each scored before
it is trained on, with the stream position checkpointed with the model.

A stream run directory is a run directory (``sampan eval / predict / export`` take it)::

    config.yaml        the resolved config, `train` values fixed at the start
    data/              manifest, the feature pipeline, and the latest window's first rows
                       (the rows export checks its graph on)
    checkpoints/last.pt model, optimizers, the stream position, the window count
    metrics.jsonl      one "stream" record per window: progressive-validation AUC /
                       LogLoss (scored before training on it), moving averages, lag, loss
    rejects.jsonl      rejected records, with their file (or kafka:TOPIC/PARTITION) and
                       line (or offset)

**Exactly once.** The position after a window (Kafka offsets per partition, or the
directory cursor) is written in the same ``last.pt`` as the weights and optimizer state
(one atomic rename), and only then are the offsets committed to Kafka. A restarted run
(``--resume``) reads on from the checkpoint's position, so every record is trained on
exactly once, and with the same windows the weights equal an uninterrupted run's.

**Numeric statistics** (normalisation, buckets) and fitted vocabularies are frozen when
the stream starts: those of the ``--from`` run, or fitted on the first window when
starting from scratch. New ids reach the model through dynamic tables
(``dynamic:`` on a feature), which admit and evict keys as the stream goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from sampan.config import ExperimentConfig, dump_config
from sampan.data.arrays import SplitArrays
from sampan.data.loader import BatchLoader
from sampan.data.pipeline import FeaturePipeline
from sampan.data.rejects import RejectLog
from sampan.data.stream import Window, WindowReader, open_source
from sampan.errors import ConfigError, DivergenceError, MissingPathError, RunError, SampanError
from sampan.metrics import auc
from sampan.models import build_model
from sampan.train import checkpoint as ckpt
from sampan.train import guard
from sampan.train import stream_data as sd
from sampan.train.experiment import lock_run
from sampan.train.state import BEST, LAST
from sampan.train.stream_data import TRACE_ENV, StreamData, read_roles, resolve_run
from sampan.train.trainer import Trainer


class StreamRun:
    """One stream run: see the module docstring. ``run_stream`` is the entry point."""

    def __init__(self, cfg: ExperimentConfig, run: Path, console: Console,
                 from_run: Path | None = None, resume: bool = False,
                 publisher: Callable[..., Any] | None = None):
        if cfg.stream is None:
            raise ConfigError("the config has no stream: section (source, kafka or "
                              "directory, window_rows, ...)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("sampan stream runs in one process; launch it without "
                              "torchrun / --nproc-per-node")
        self.cfg, self.run, self.console, self.s = cfg, run, console, cfg.stream
        self.from_run, self.resume = from_run, resume
        self.windows = 0  # windows trained on (and checkpointed, after a resume)
        self.rows = 0
        self.history: deque[dict[str, float]] = deque(maxlen=self.s.average_windows)
        self.position: dict[str, Any] | None = None
        # called after each checkpoint (the export layer's Publisher pushes versions)
        self.publish = publisher(self.s.publish, run, console) \
            if publisher is not None and self.s.publish is not None else None
        if self.s.publish is not None and publisher is None:
            raise ConfigError("stream.publish is set but no publisher was given: run "
                              "`sampan stream`, or pass publisher=sampan.export.publish."
                              "Publisher to run_stream")
        self.publish_failures = 0
        self.final_publish_error: Exception | None = None
        self._late_told = 0
        self.trainer: Trainer | None = None
        self.pipe: FeaturePipeline | None = None
        self.dir = StreamData(run, self.s)  # data/: pipeline, manifest, latest rows

    # ---------------------------------------------------------------- the parts
    # ------------------------------------------------------------------ starting
    def _start(self) -> tuple[WindowReader, Window | None]:
        """Open the source where the run stands and build the model and its Trainer;
        returns the reader and the first window when one was needed to start."""
        run, cfg = self.run, self.cfg
        log = RejectLog(run / "rejects.jsonl")
        self.log = log
        first: Window | None = None
        if self.resume:
            log.load_known()  # the rows read again are not rejected (and written) twice
            self.pipe = FeaturePipeline.load(run / "data" / "pipeline")
            self.dir.repair()
            sample = SplitArrays.load(run / "data" / "valid")
            model = build_model(cfg.model, self.pipe.schema())
            trainer = self._trainer(model, sample)
            trainer._restore(run / "checkpoints" / LAST, quiet=True)
            state = trainer.restored["stream"]
            self.position, self.windows, self.rows = (state["position"], state["windows"],
                                                      state["rows"])
            self.history.extend(state.get("history", []))
            trainer.reference_loss = state["reference_loss"]
            trainer.explode_at = 3.0 * trainer.reference_loss + 1.0
            sd.truncate_trace(self.windows)
            self.console.print(f"resumed at window {self.windows} ({self.rows:,} rows, "
                               f"step {trainer.state.step}) from {self._where()}")
        else:
            # a start killed during its first checkpoint left a trace line and no checkpoint
            sd.truncate_trace(0)
            if self.from_run is not None:
                self.pipe = FeaturePipeline.load(self.from_run / "data" / "pipeline")
                relabelled = self.pipe.relabel(cfg.features)
                if relabelled:
                    self.console.print(relabelled)
            else:  # from scratch: the pipeline is fitted on the first window
                self.pipe = FeaturePipeline(cfg.features)
            roles = read_roles(self.pipe, self.s, cfg.data)
            source = open_source(self.s, cfg.data, roles, log)
            reader = WindowReader(source, self.s, None)
            self.console.print(f"waiting for the first window ({self.s.window_rows:,} rows"
                               + (f" or {self.s.window_seconds:g} s"
                                  if self.s.window_seconds else "") + ")")
            first = reader.next()
            if first is None:
                source.close()
                raise RunError("the stream ended before its first record arrived; nothing "
                               "was trained")
            if self.from_run is None:
                self.pipe.fit([first.table])
            self.dir.write(self.pipe, first.table, "the stream's first window"
                             if self.from_run is None else f"{self.from_run}")
            model = build_model(cfg.model, self.pipe.schema())
            if self.from_run is not None:
                weights = self.from_run / "checkpoints" / BEST
                if not weights.exists():
                    weights = self.from_run / "checkpoints" / LAST
                model.load_state_dict(ckpt.load(weights)["model"])
            data = sd.stream_arrays(self.pipe, first.table, self.cfg.data)
            trainer = self._trainer(model, data)
            # the resolved settings are the run's from now on: a resume plans the same
            self.cfg = cfg = cfg.model_copy(update={"train": trainer.tc})
            (run / "config.yaml").write_text(dump_config(cfg))
            fit_data = getattr(trainer.model, "fit_data", None)
            if self.from_run is None and fit_data is not None:
                done = fit_data(data)
                if done:
                    self.console.print(done)
            if self.from_run is None and self.cfg.train.init_output_bias:
                done = trainer.task.init_output_bias(trainer.model, data, trainer.device)
                if done:
                    self.console.print(done)
            self.trainer = trainer
            self.source = source
            return reader, first
        self.trainer = trainer
        self.source = open_source(self.s, cfg.data, read_roles(self.pipe, self.s, cfg.data),
                                  log, self.position)
        return WindowReader(self.source, self.s, self.position), None

    def _trainer(self, model: torch.nn.Module, data: SplitArrays) -> Trainer:
        return Trainer(model, self.cfg, self.run, data, None, console=self.console)

    def _where(self) -> str:
        return json.dumps(self.position, sort_keys=True)

    # --------------------------------------------------------------------- a window
    def _score(self, data: SplitArrays, fresh: bool) -> dict[str, float]:
        """Progressive validation: the model before it sees the window."""
        if fresh:  # a model from scratch has seen nothing yet
            return {}
        t = self.trainer
        assert t is not None
        m = {k: float(v) for k, v in t.evaluate(data).items()
             if isinstance(v, (int, float)) and k != "rows"}
        if data.oracle is not None and data.labels is not None:
            m["oracle_auc"] = auc(torch.from_numpy(np.asarray(data.oracle)),
                                  torch.from_numpy(np.asarray(data.labels[:, 0])))
        # a window whose labels have one class (a window of one row, say) has no AUC: it is
        # left out, not logged as nan (which would make every moving average nan)
        return {k: v for k, v in m.items() if np.isfinite(v)}

    def _train(self, data: SplitArrays) -> tuple[float, float]:
        """One pass over the window in stream order; (mean loss, samples per second)."""
        t = self.trainer
        assert t is not None
        t.model.train()
        loader = BatchLoader(data, t.tc.batch_size, shuffle="none", prefetch=t.tc.prefetch,
                             drop_singleton=True)
        total = torch.zeros((), device=t.device)
        n, t0 = 0, time.perf_counter()
        for batch in loader:
            total += t._train_step(batch.to(t.device, non_blocking=True))
            t.state.step += 1
            n += 1
        mean = float(total / max(n, 1))
        guard.check_loss(t, mean, n)
        return mean, len(data) / max(time.perf_counter() - t0, 1e-9)

    def _window(self, w: Window) -> None:
        t = self.trainer
        assert t is not None
        data = sd.stream_arrays(self.pipe, w.table, self.cfg.data)
        fresh = self.from_run is None and self.windows == 0 and not self.resume
        m = self._score(data, fresh)
        loss, speed = self._train(data)
        now = time.time()
        self.windows += 1
        self.rows += len(data)
        record: dict[str, Any] = {"step": t.state.step, "split": "stream",
                                  "window": self.windows, "rows": len(data),
                                  "rows_total": self.rows, **m, "train_loss": loss,
                                  "samples_per_s": speed, "wait_s": round(now - w.opened, 3)}
        if m:
            self.history.append({k: m[k] for k in ("auc", "logloss") if k in m})
            for k in ("auc", "logloss"):
                vals = [h[k] for h in self.history if k in h]
                if vals:
                    record[f"{k}_avg"] = float(np.mean(vals))
        tc = self.s.time_column
        if tc and tc in w.table.column_names:
            ev = w.table.column(tc).to_numpy(zero_copy_only=False).astype(np.float64)
            ev = ev[np.isfinite(ev)]
            if len(ev):
                record["lag_s"] = float(now - ev.mean())
                record["lag_max_s"] = float(now - ev.min())
        prev = self.position
        self.position = w.position
        if late := self._new_late():
            record["late_partitions"] = late
        if t.metrics is not None:
            t.metrics.write(record)
        shown = "  ".join(f"{k} {record[k]:.4f}" for k in ("auc", "auc_avg", "logloss")
                          if k in record)
        lag = f"  lag {record['lag_s']:.1f} s" if "lag_s" in record else ""
        shown = shown or ("first window: trained, not scored" if fresh else "no metric")
        self.console.print(f"window {self.windows:>5}: {len(data):>8,} rows  {shown}{lag}  "
                           f"loss {loss:.4f}  {speed:,.0f} rows/s", highlight=False)
        if self.windows % self.s.checkpoint_every_windows == 0:
            self._checkpoint(w, prev)
        if self.log.read >= 1000:  # of everything read so far (one bad record of the first
            self.log.check(self.cfg.data.max_bad_fraction)  # few is no share yet)

    def _new_late(self) -> list[str]:
        """Directory partitions that appeared after later ones were read (skipped), not
        yet said; said here."""
        late = getattr(self.source, "late", [])[self._late_told:]
        if late:
            self.console.print(f"[yellow]note[/]: partition(s) {late} appeared after later "
                               "ones were read: skipped (partitions are read once, in order)")
            self._late_told += len(late)
        return late

    def _checkpoint(self, w: Window, prev: dict[str, Any] | None) -> None:
        t = self.trainer
        assert t is not None
        self.dir.write_recent(self.pipe, w.table)
        if trace := os.environ.get(TRACE_ENV):  # before: a resume cuts what it lacks
            with open(trace, "a") as f:
                f.write(json.dumps({"window": self.windows, "rows": self.rows,
                                    "from": prev, "to": self.position}) + "\n")
        self._checkpoint_last()
        self._publish(final=False)

    def _publish(self, final: bool) -> None:
        """A new version for serving when due. A failed push is said and retried at the
        next checkpoint; training goes on (the checkpoint holds everything)."""
        if self.publish is None or not self.windows:
            return
        try:
            self.publish({"windows": self.windows, "rows": self.rows,
                          "position": self.position, "final": final})
        except (SampanError, OSError) as e:
            self.publish_failures += 1
            self.console.print(f"[yellow]publish failed[/] after window {self.windows}: {e}")
            if final:  # no next checkpoint to retry at: the run ends with this error
                self.final_publish_error = e

    # -------------------------------------------------------------------- the loop
    def run_loop(self) -> dict[str, Any]:
        reader, first = self._start()
        stopping = {"signal": None}

        def on_signal(signum: int, _frame: Any) -> None:
            stopping["signal"] = signum
            reader.stop()

        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        t0 = time.perf_counter()
        try:
            window = first
            while True:
                if window is None:
                    if self.s.max_windows is not None and self.windows >= self.s.max_windows:
                        break
                    window = reader.next()
                    if window is None:
                        break
                try:
                    self._window(window)
                except guard.Diverged as e:
                    reader = self._recover(str(e))
                window = None
                if stopping["signal"] is not None:
                    break
            if self.windows % self.s.checkpoint_every_windows and self.position is not None:
                self._checkpoint_last()
            self._publish(final=True)
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
            self.source.close()
            self.log.close()
            if self.trainer is not None and self.trainer.metrics is not None:
                self.trainer.metrics.close()
        why = ("stopped by signal" if stopping["signal"] is not None else
               "max_windows reached" if self.s.max_windows is not None
               and self.windows >= self.s.max_windows else "the stream went quiet")
        results = {"windows": self.windows, "rows": self.rows, "position": self.position,
                   "stopped": why, "seconds": round(time.perf_counter() - t0, 2),
                   "rejects": self.log.summary(), "publish_failures": self.publish_failures,
                   "late_partitions": getattr(self.source, "late", [])}
        self._new_late()
        if self.history:
            keys = dict.fromkeys(k for h in self.history for k in h)
            results["progressive"] = {k: float(np.mean([h[k] for h in self.history if k in h]))
                                      for k in keys}
        (self.run / "results.json").write_text(json.dumps(results, indent=1))
        self.console.print(f"stream: {self.windows} windows, {self.rows:,} rows ({why}); "
                           f"data: {self.log.describe()}")
        self.console.print(f"run directory: {self.run}")
        self.log.check(self.cfg.data.max_bad_fraction)
        if (e := self.final_publish_error) is not None:
            raise RunError(f"the final version (window {self.windows}) was not published: "
                           f"{e}; its checkpoint holds it: sampan stream --resume {self.run} "
                           "publishes it") from e
        return results

    def _checkpoint_last(self) -> None:
        """``last.pt`` with the stream position, then the source's commit."""
        t = self.trainer
        assert t is not None
        t.save_checkpoint(extra={"stream": {
            "position": self.position, "windows": self.windows, "rows": self.rows,
            "history": list(self.history), "reference_loss": t.reference_loss}})
        self.source.commit(self.position)  # only once the checkpoint holds it

    def _recover(self, reason: str) -> WindowReader:
        """A diverged window: back to the last checkpoint with halved learning rates (as
        a batch run does), reading the stream again from its position."""
        t = self.trainer
        assert t is not None
        if not (self.run / "checkpoints" / LAST).exists():
            raise DivergenceError(f"training diverged in window {self.windows + 1} before "
                                  f"the first checkpoint: {reason}. Try a lower train.lr")
        guard.recover(t, reason)  # restores last.pt
        state = t.restored["stream"]
        self.position, self.windows, self.rows = (state["position"], state["windows"],
                                                  state["rows"])
        sd.truncate_trace(self.windows)
        self.console.print(f"[yellow]diverged[/] ({reason}): back to window {self.windows} "
                           f"with the learning rates halved")
        self.source.seek(self.position)
        return WindowReader(self.source, self.s, self.position)


def run_stream(cfg: ExperimentConfig, run_dir: str | Path | None = None,
               from_run: str | Path | None = None, resume: bool = False,
               console: Console | None = None,
               publisher: Callable[..., Any] | None = None,
               overrides: list[str] | None = None) -> dict[str, Any]:
    """Train on the stream of ``cfg.stream`` until it is stopped (SIGTERM / Ctrl-C, with a
    checkpoint), ``max_windows`` or ``idle_stop_seconds``; returns ``results.json``.

    ``from_run``: start from a batch-trained run's weights and pipeline (its model and
    features must be the config's). ``resume``: continue ``run_dir`` from its checkpoint.
    ``publisher``: with ``stream.publish``, what pushes versions to serving
    (:class:`sampan.export.publish.Publisher`, which ``sampan stream`` passes).
    ``overrides``: with ``resume``, ``key=value`` changes of where the stream is read and
    published (:data:`~sampan.train.stream_data.RESUME_KEYS`), saved with the run.
    """
    console = console or Console()
    cfg, run, from_path = resolve_run(cfg, run_dir, from_run, resume, overrides)
    if from_path is not None and not (from_path / "data" / "pipeline").exists():
        raise MissingPathError(f"--from {from_path}: not a finished run (no data/pipeline)")
    cfg, notes = sd.stream_train_config(cfg)
    lock = lock_run(run)
    try:
        if not (run / "checkpoints" / LAST).exists() and (run / "config.yaml").exists():
            # stopped before its first checkpoint: start again (resumed: with the saved
            # config; started anew: with this one)
            keep = ("config.yaml", ".lock", "stream-from.txt") if resume else (".lock",)
            for p in run.iterdir():
                if p.name not in keep:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            resume = False
        elif resume and overrides:
            (run / "config.yaml").write_text(dump_config(cfg))
        if not resume:
            (run / "config.yaml").write_text(dump_config(cfg))
            if from_path is not None:
                (run / "stream-from.txt").write_text(str(from_path.resolve()) + "\n")
            console.print(f"[bold]stream run[/] {run}")
            for note in [*cfg.notices, *notes]:
                console.print(f"[yellow]note[/]: {note}")
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        ckpt.seed_everything(cfg.seed)
        torch.manual_seed(cfg.seed)
        return StreamRun(cfg, run, console, from_path, resume, publisher).run_loop()
    finally:
        lock.close()

