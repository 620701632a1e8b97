"""The study behind ``sampan tune``: an Optuna study in an RDB storage whose trials are
ordinary Sampan runs.

* The storage (SQLite ``study.db`` in the study folder by default, or any SQLAlchemy URL) is
  the only shared state: every ``sampan tune`` process pointed at it, on this machine or
  another, takes trials from the same study. There is no scheduler beside it.
* A trial's values are ``--set`` overrides of the config file (:mod:`sampan.tune.space`);
  the trial runs in ``FOLDER/trials/NNNN`` as ``sampan train`` would, its console output in
  ``tune.log`` there. After each validation the trial reports the metric at its epochs done,
  in hundredths (``report(value, step=round(100 * epochs))``, so trials with different batch
  sizes line up), and the pruner may stop it there.
* The budget counts finished trials (completed or pruned). A process asks for a trial only
  while finished plus running trials are below it, under a lock file in the folder, so the
  processes of one machine never overshoot. (Processes on several machines each hold their
  own lock; at the very end they may overshoot by one trial each.)
* A killed process leaves its trial ``RUNNING``. The next ask finds it, from its owner
  (host, pid and process start time: this machine's dead processes are found at once) or its
  heartbeat (silent for :data:`STALE_SECONDS`: another machine's; one killed between asking
  for a trial and marking it, after :data:`OWNERLESS_SECONDS`), marks it failed, and
  queues its values again, so a killed and resumed study ends with the same trials it would
  have had.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from sampan.config import ConfigError, TuneConfig, dump_config, load_config
from sampan.errors import MissingExtraError
from sampan.tune.space import check_space, grid, sample, trial_config

STUDY_FILE = "study.json"  # what the folder's study is: name, storage, metric, direction
HEARTBEAT_SECONDS = 20
STALE_SECONDS = 300
OWNERLESS_SECONDS = 60  # a trial asked for but not yet marked with its owner (ms, normally)
ASKING = threading.Lock()  # held from ask to owner: a stopping process waits for it
HOST = socket.gethostname()
EPOCH_UNITS = 100  # intermediate values are reported at round(100 * epochs done)


def _optuna():  # type: ignore[no-untyped-def]
    try:
        import optuna
    except ImportError:
        raise MissingExtraError("sampan tune runs on Optuna: pip install 'sampan[tune]' "
                                "(or optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


@dataclass
class TuneJob:
    """One study: where its config, folder and storage are, and how it is judged."""

    config: Path
    overrides: list[str]
    folder: Path
    tune: TuneConfig
    name: str
    storage_url: str
    metric: str
    direction: str
    budget: int
    threads: int | None = None  # torch threads per trial (None: the config's own)
    deadline: float | None = None  # time.time() after which no trial starts
    _storage: Any = field(default=None, repr=False)

    @property
    def run_overrides(self) -> list[str]:
        extra = [f"train.threads={self.threads}"] if self.threads else []
        return [*self.overrides, *extra, "train.progress=false"]

    def storage(self) -> Any:
        if self._storage is None:
            optuna = _optuna()
            from sqlalchemy.exc import IntegrityError  # optuna's own dependency

            kwargs = {"connect_args": {"timeout": 60}} \
                if self.storage_url.startswith("sqlite") else {}
            try:
                self._storage = optuna.storages.RDBStorage(self.storage_url,
                                                           engine_kwargs=kwargs)
            except IntegrityError:
                # another process made the new database's tables at the same moment (both
                # saw none and wrote the schema version): they are there now
                self._storage = optuna.storages.RDBStorage(self.storage_url,
                                                           engine_kwargs=kwargs)
        return self._storage

    def trial_id(self, number: int) -> int:
        storage = self.storage()
        return storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(self.name), number)

    def study(self, seed_offset: int = 0) -> Any:
        optuna = _optuna()
        return optuna.load_study(study_name=self.name, storage=self.storage(),
                                 sampler=sampler(self.tune, seed_offset),
                                 pruner=pruner(self.tune))


def sampler(tc: TuneConfig, offset: int = 0) -> Any:
    """TPE (multivariate, grouped when the space has ``when`` branches, with the constant
    liar so parallel processes spread out), random, or for a grid random over the queued
    points. Each process of a study draws from its own seed (``seed + offset``)."""
    optuna = _optuna()
    seed = (tc.seed or 0) + offset
    if tc.sampler == "tpe":
        branched = any(s.when for s in tc.space.values())
        return optuna.samplers.TPESampler(n_startup_trials=tc.startup_trials, seed=seed,
                                          multivariate=True, group=branched,
                                          constant_liar=True)
    return optuna.samplers.RandomSampler(seed=seed)  # grid: the points are queued


def pruner(tc: TuneConfig) -> Any:
    """Median: a trial whose value is below the median of earlier trials at the same epoch,
    from its second epoch on, once ``startup_trials`` have finished. Hyperband: successive
    halving from one epoch (:data:`EPOCH_UNITS`) up."""
    optuna = _optuna()
    if tc.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=tc.startup_trials,
                                           n_warmup_steps=EPOCH_UNITS)
    if tc.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=EPOCH_UNITS, reduction_factor=3)
    return optuna.pruners.NopPruner()


def resolve_metric(cfg: Any, tc: TuneConfig) -> tuple[str, str]:
    """The metric and direction of the study."""
    from sampan.config.registry import get_model_class

    metric = tc.metric or cfg.train.early_stopping.metric
    if metric is None:
        retrieval = getattr(get_model_class(cfg.model.name), "task", "binary") == "retrieval"
        metric = f"recall@{cfg.model.k}" if retrieval else "auc"
    return metric, tc.direction or ("minimize" if metric == "logloss" else "maximize")


def prepare(config: Path, overrides: list[str], folder: Path | None = None, *,
            trials: int | None = None, timeout_minutes: float | None = None,
            storage: str | None = None, threads: int | None = None,
            create: bool = True) -> TuneJob:
    """Load and check the config and its ``tune:`` section, and create (or open, to resume)
    its study. Command-line values win over the section's."""
    cfg = load_config(config, overrides)
    if cfg.tune is None:
        raise ConfigError(f"{config} has no tune: section (the search space: see "
                          "docs/guides/tuning.md, e.g. configs/tune_deepfm.yaml)")
    tc = cfg.tune.model_copy(update={k: v for k, v in (
        ("trials", trials), ("timeout_minutes", timeout_minutes), ("storage", storage))
        if v is not None})
    if tc.seed is None:
        tc = tc.model_copy(update={"seed": cfg.seed})
    check_space(config, overrides, tc.space)
    metric, direction = resolve_metric(cfg, tc)
    folder = Path(folder) if folder is not None else Path(cfg.output_dir) / f"{cfg.name}-tune"
    folder.mkdir(parents=True, exist_ok=True)
    url = tc.storage or f"sqlite:///{(folder / 'study.db').resolve()}"
    points = grid(tc.space) if tc.sampler == "grid" else None
    budget = min(tc.trials, len(points)) if points is not None else tc.trials
    job = TuneJob(config=Path(config), overrides=list(overrides), folder=folder, tune=tc,
                  name=cfg.name, storage_url=url, metric=metric, direction=direction,
                  budget=budget, threads=threads,
                  deadline=time.time() + 60 * tc.timeout_minutes if tc.timeout_minutes
                  else None)
    if create:
        _create(job, cfg, points)
    return job


def _fingerprint(job: TuneJob, cfg: Any) -> tuple[str, dict[str, str]]:
    """What a resumed study must share with the one it resumes: the experiment, the space,
    the metric and the sampler (not the budget, the time or the pruner); and each of them
    alone (the experiment and the space by digest), to say which one differs."""
    base = dump_config(cfg.model_copy(update={"tune": None}))
    space = json.dumps({k: s.model_dump() for k, s in job.tune.space.items()}, sort_keys=True,
                       default=str)
    text = "\n".join([base, space, job.metric, job.direction, job.tune.sampler])

    def digest(t: str) -> str:
        return hashlib.sha256(t.encode()).hexdigest()[:16]

    return digest(text), {"experiment": digest(base), "search space": digest(space),
                          "metric": f"{job.metric} ({job.direction})",
                          "sampler": job.tune.sampler}


def _create(job: TuneJob, cfg: Any, points: list[dict[str, Any]] | None) -> None:
    optuna = _optuna()
    mark, parts = _fingerprint(job, cfg)
    study = optuna.create_study(study_name=job.name, storage=job.storage(),
                                direction=job.direction, load_if_exists=True)
    had = study.user_attrs.get("sampan_fingerprint")
    if had is None:
        study.set_user_attr("sampan_fingerprint", mark)
        study.set_user_attr("sampan_parts", parts)
        study.set_user_attr("metric", job.metric)
        for p in points or []:  # a grid: every point queued once, in order
            study.enqueue_trial(p, skip_if_exists=False)
    elif had != mark:
        then = study.user_attrs.get("sampan_parts") or {}
        what = [k if k in ("experiment", "search space") else
                f"{k} ({then[k]} then, {v} now)" for k, v in parts.items()
                if k in then and then[k] != v]
        raise ConfigError(
            f"the study {job.name!r} in {job.storage_url} was made from another "
            f"{' and another '.join(what) or 'experiment, search space, metric or sampler'}"
            "; resume it with the config it was made from, or start a new one with --out "
            "(another folder) or another experiment name")
    (job.folder / STUDY_FILE).write_text(json.dumps(
        {"study": job.name, "storage": job.storage_url, "metric": job.metric,
         "direction": job.direction, "budget": job.budget, "config": str(job.config),
         "overrides": job.overrides}, indent=1))


# ---------------------------------------------------------------- owners and heartbeats
def _start_time(pid: int) -> str | None:
    try:  # field 22 of /proc/PID/stat: when the process started (tells a reused pid apart)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner() -> dict[str, Any]:
    return {"host": HOST, "pid": os.getpid(), "start": _start_time(os.getpid())}


def _alive(owner: dict[str, Any]) -> bool:
    pid = int(owner.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return owner.get("start") is None or _start_time(pid) in (None, owner["start"])


def reclaim(job: TuneJob, study: Any, console: Console) -> int:
    """Fail and queue again the running trials whose process is gone; returns how many."""
    optuna = _optuna()
    storage, n = job.storage(), 0
    study_id = storage.get_study_id_from_name(job.name)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        owner = t.system_attrs.get("sampan_owner") or {}
        beat = t.system_attrs.get("sampan_heartbeat", t.datetime_start.timestamp()
                                  if t.datetime_start else time.time())
        gone = owner.get("host") == HOST and not _alive(owner)
        quiet = time.time() - beat
        if not gone and quiet < (STALE_SECONDS if owner else OWNERLESS_SECONDS):
            continue
        tid = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            storage.set_trial_user_attr(tid, "error", "its process stopped (killed or lost)")
            storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:  # finished meanwhile
            continue
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number},
                            skip_if_exists=False)
        console.print(f"trial {t.number}: its process ({owner.get('host', '?')} pid "
                      f"{owner.get('pid', '?')}) is gone; its values are queued again")
        n += 1
    return n


@contextlib.contextmanager
def _heartbeat(job: TuneJob, trial_id: int) -> Iterator[None]:
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(Exception):  # a busy database: the next beat
                job.storage().set_trial_system_attr(trial_id, "sampan_heartbeat",
                                                    time.time())

    thread = threading.Thread(target=beat, daemon=True, name="sampan-tune-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()


@contextlib.contextmanager
def _ask_lock(folder: Path) -> Iterator[None]:
    import fcntl

    with open(folder / ".ask.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def counts(study: Any) -> dict[str, int]:
    """Trials by state: complete, pruned, running, waiting, failed."""
    out = {"complete": 0, "pruned": 0, "running": 0, "waiting": 0, "fail": 0}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name.lower()] = out.get(t.state.name.lower(), 0) + 1
    return out


# ----------------------------------------------------------------------------- workers
def work(job: TuneJob, index: int, console: Console, tag: str = "") -> int:
    """Take and run trials until the study has ``budget`` finished ones or the deadline
    passes; returns the trials this process finished."""
    optuna = _optuna()
    study = job.study(seed_offset=index)
    ran, failures = 0, 0
    while True:
        with _ask_lock(job.folder), ASKING:
            reclaim(job, study, console)
            c = counts(study)
            done = c["complete"] + c["pruned"]
            late = job.deadline is not None and time.time() >= job.deadline
            if done >= job.budget or late:
                return ran
            trial = study.ask() if done + c["running"] < job.budget else None
            if trial is not None:
                job.storage().set_trial_system_attr(job.trial_id(trial.number),
                                                    "sampan_owner", _owner())
        if trial is None:  # the last trials are running elsewhere: one of them may die
            time.sleep(2)
            continue
        state = run_trial(job, study, trial, console, tag)
        ran += state != optuna.trial.TrialState.FAIL
        failures = failures + 1 if state == optuna.trial.TrialState.FAIL else 0
        if failures >= 3 and not counts(study)["complete"]:
            raise ConfigError(f"the first trials of {job.name!r} all failed: see tune.log "
                              f"and error.txt in {job.folder / 'trials'}")


def _values_text(values: dict[str, Any]) -> str:
    def short(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return " ".join(f"{k.rsplit('.', 1)[-1]}={short(v)}" for k, v in values.items())


def run_trial(job: TuneJob, study: Any, trial: Any, console: Console, tag: str = "") -> Any:
    """Run one trial as a Sampan run and tell the study how it ended; returns its state."""
    optuna = _optuna()
    from sampan.train.experiment import run_experiment

    values = sample(trial, job.tune.space)
    run_dir = job.folder / "trials" / f"{trial.number:04d}"
    trial.set_user_attr("run_dir", str(run_dir.relative_to(job.folder)))
    trial.set_user_attr("values", values)  # config values (a choice's, not its label)
    state = optuna.trial.TrialState.FAIL
    reported = [0]  # the last step reported

    def should_stop(step: int, epochs: float, m: dict[str, float]) -> str | None:
        value = m.get(job.metric)
        if value is None or not math.isfinite(value):
            return None
        reported[0] = round(EPOCH_UNITS * epochs)
        trial.report(float(value), reported[0])
        return "pruned" if trial.should_prune() else None

    t0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _heartbeat(job, job.trial_id(trial.number)), open(run_dir / "tune.log", "w") as log:
            cfg = trial_config(job.config, job.run_overrides, values)
            results = run_experiment(cfg, run_dir, console=Console(file=log, width=110),
                                     should_stop=should_stop,
                                     data_from=job.folder / "defaults")
        # a finished trial is not resumed: its best weights stay, the resume state goes
        (run_dir / "checkpoints" / "last.pt").unlink(missing_ok=True)
        valid = results.get("valid") or {}
        if job.metric not in valid:
            raise ConfigError(f"tune.metric {job.metric!r} is not among the validation "
                              f"metrics of trial {trial.number}: {sorted(valid)}")
        seconds = time.perf_counter() - t0
        for key, v in (("seconds", round(seconds, 2)), ("steps", results["steps"]),
                       ("test", results.get("test") or {}), ("valid", valid)):
            trial.set_user_attr(key, v)
        if results.get("stopped_by") == "pruned":
            state = optuna.trial.TrialState.PRUNED
            study.tell(trial, state=state)
            how = f"pruned at epoch {reported[0] / EPOCH_UNITS:.2f}"
        else:
            state = optuna.trial.TrialState.COMPLETE
            study.tell(trial, float(valid[job.metric]))
            how = f"{job.metric} {valid[job.metric]:.4f}"
        console.print(f"{tag}trial {trial.number:>3}: {how:<26} {seconds:6.1f} s  "
                      f"{_values_text(values)}", highlight=False, markup=False,
                      soft_wrap=True)
    except ConfigError:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise
    except Exception as e:  # noqa: BLE001 - one trial's failure (a divergence...) is told
        (run_dir / "error.txt").write_text(traceback.format_exc())
        trial.set_user_attr("error", f"{type(e).__name__}: {e}")
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        console.print(f"{tag}trial {trial.number:>3}: failed ({type(e).__name__}: {e}); "
                      f"traceback in {run_dir / 'error.txt'}", highlight=False, markup=False,
                      soft_wrap=True)
    return state
