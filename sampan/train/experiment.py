"""One experiment end to end: config -> processed data -> model -> training -> test metrics.

A run directory holds everything needed to evaluate, predict, resume or export later::

    config.yaml        the resolved config (defaults < preset < file < --set)
    data/              processed store and the fitted pipeline (see sampan.data.store)
    checkpoints/       last.pt (resume), best.pt (best validation weights)
    metrics.jsonl      train loss / valid metrics over time
    results.json       final valid and test metrics (and the oracle AUC when known)
    tensorboard/       scalars, when tensorboard is installed
    .lock              held (flock) by the process training the run: a second
                       ``--resume`` of a run that is still training is refused
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from sampan import distributed
from sampan.config import ExperimentConfig, dump_config, load_config
from sampan.data.sources import RejectLog
from sampan.data.store import (
    SplitArrays,
    Store,
    build_store,
    check_inputs,
    iter_transformed,
    reuse_store,
    transform_files,
)
from sampan.distributed.strategy import SingleProcess, strategy_for
from sampan.embedding.collection import dynamic_summary
from sampan.errors import DataError, ExistingPathError, MissingPathError, RunError, not_a_run
from sampan.metrics import (
    RANKING_K,
    auc,
    auc_bootstrap,
    grouped_ranking_metrics,
    paired_auc_comparison,
)
from sampan.models import build_model
from sampan.tasks import make_task
from sampan.train import checkpoint as ckpt
from sampan.train import guard
from sampan.train.compute import apply_saved
from sampan.train.evaluate import Evaluator, headline_metrics, probabilities, resolve_device
from sampan.train.rundir import _clear_for_restart, lock_run, new_run_dir
from sampan.train.trainer import BEST, LAST, Trainer
from sampan.train.warm_start import fit_first_order


def run_experiment(cfg: ExperimentConfig, run_dir: str | Path | None = None,
                   resume: bool = False, console: Console | None = None,
                   should_stop: Callable[[int, float, dict[str, float]], str | None]
                   | None = None, data_from: Path | None = None) -> dict[str, Any]:
    """Prepare data (unless resuming), train, evaluate on test; returns ``results.json``.

    ``should_stop(step, epochs, valid_metrics)``, asked after every validation, may return
    a reason to stop there (``sampan tune``'s ``"pruned"``), kept as ``stopped_by``.
    ``data_from``: a finished run whose processed data this run links to when it was built
    from the same data and features sections (else the data is prepared as usual).

    Under a distributed launch (``WORLD_SIZE`` > 1) every process runs this: rank 0 names
    the run directory and prepares the data, the others wait and open it; only rank 0
    prints and writes files (see :mod:`sampan.distributed`).
    """
    dist = distributed.init_from_env(resolve_device(cfg.train.device).type)
    console = console or Console()
    if not dist.is_main:
        console = Console(quiet=True)
    run = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
    run = Path(distributed.broadcast_object(str(run)))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    ckpt.seed_everything(cfg.seed)
    lock = None
    restart = False
    if resume and not (run / "checkpoints" / LAST).exists():
        if not (run / "config.yaml").exists():
            raise MissingPathError(f"{run} is not a run directory (no config.yaml) and has "
                                    f"no checkpoints/{LAST} to resume from")
        # stopped before its first checkpoint (while preparing the data, or early in
        # training): the run starts again from the beginning with its saved config
        resume, restart = False, True
    if resume:
        if dist.is_main:
            lock = lock_run(run)
        store = Store.open(run / "data")
    else:
        problem = None
        if dist.is_main:
            try:
                if not restart and data_from is None:
                    check_inputs(cfg)  # a missing file fails before the run has a folder
                lock = lock_run(run)
                if restart:
                    _clear_for_restart(run)
                    console.print(f"[yellow]note[/]: {run} has no checkpoint yet: starting "
                                  "it again from the beginning with its saved config")
                elif (run / "config.yaml").exists():
                    raise ExistingPathError(f"{run} already holds a run; resume it with "
                                          f"--resume {run} or choose a new --run-dir")
                (run / "config.yaml").write_text(dump_config(cfg))
                console.print(f"[bold]run[/] {run}")
                for notice in cfg.notices:
                    console.print(f"[yellow]note[/]: {notice}")
                if data_from is not None and reuse_store(cfg, data_from, run / "data"):
                    console.print(f"data: the processed data of {data_from} (same data and "
                                  "features sections)")
                else:
                    build_store(cfg, run / "data", echo=console.print)
            except Exception as e:  # noqa: BLE001 - told to the other ranks, then re-raised
                problem = e
        failed = distributed.broadcast_object(None if problem is None else repr(problem))
        if problem is not None:
            raise problem
        if failed is not None:  # rank 0 says why; this rank only stops
            raise RunError(f"rank {dist.rank}: stopped, as rank 0 could not prepare the run "
                           "(its error is above)")
        if not (run / "data").is_dir():
            raise RunError(
                f"rank {dist.rank}: {(run / 'data').resolve()} does not exist on this machine:"
                " rank 0 wrote the run's data there. With several machines, the run folder "
                "must be on storage every machine sees at the same path (output_dir or "
                "--run-dir: an absolute path on a shared file system)")
        store = Store.open(run / "data")
    train, valid, test = store.split("train"), store.split("valid"), store.split("test")
    if train is None:
        raise DataError("the train split is empty; check data.split")

    strategy = strategy_for(cfg.train)
    torch.manual_seed(cfg.seed)  # model init depends only on the seed (same on every rank)
    # a distributed build defers the tables (no process allocates a whole one); the
    # strategy then gives each process the rows it keeps
    model = build_model(cfg.model, store.schema.with_table_device(strategy.table_device))
    n_params = sum(p.numel() for p in model.parameters())
    model = strategy.parallelize(model)
    if strategy.enabled:
        torch.manual_seed(cfg.seed + strategy.rank)  # dropout masks differ between ranks
        if n_bn := strategy.synced_batch_norms:
            console.print(f"batch norm: {n_bn} layer(s) normalised over the global batch")
        print_placement(strategy, model, console)
    console.print(f"model {cfg.model.name}: {n_params:,} parameters on "
                  f"{resolve_device(cfg.train.device)}")
    trainer = Trainer(model, cfg, run, train, valid, console=console, strategy=strategy)
    trainer.should_stop = should_stop
    if strategy.enabled:
        b, w = trainer.tc.batch_size, strategy.world
        each = f"{b // w}" if b % w == 0 else f"{b // w}-{b // w + 1}"  # cut as evenly as can be
        console.print(f"distributed: {w} processes, global batch {b} ({each} per process)")
    for line in trainer.describe_plan():
        console.print(f"schedule: {line}")
    if trainer.kernels is not None:
        console.print(f"kernels: {trainer.kernels.describe()}")
    if dist.is_main and not resume:
        (run / "schedule.json").write_text(json.dumps(trainer.plan.to_json(), indent=1))
    if trainer.tc.first_order_warm_start and not resume:
        fit_first_order(trainer)
    state = trainer.fit(resume=resume)
    train_time = state.seconds  # across resumes

    results: dict[str, Any] = {"model": cfg.model.name, "steps": state.step,
                               # without a validation split the final weights are kept
                               "best_step": state.best_step if valid is not None else state.step,
                               "stopped_early": state.stopped_early,
                               **({"stopped_by": trainer.stopped_by} if trainer.stopped_by
                                  else {}),
                               "train_seconds": round(train_time, 2)}
    if trainer.warm_start is not None:
        results["first_order_warm_start"] = trainer.warm_start
    if dynamic := dynamic_summary(trainer.model):  # is the capacity enough?
        results["dynamic_tables"] = dynamic
        for name, d in dynamic.items():
            console.print(f"dynamic table {name}: {d['live']:,} of {d['capacity']:,} rows in "
                          f"use, {d['evicted']:,} evicted")
    if valid is not None:
        results["valid"] = trainer.evaluate(valid)
    if test is not None:
        results["test"] = trainer.evaluate(test)
        if test.oracle is not None:
            results["test"]["oracle_auc"] = auc(torch.tensor(np.asarray(test.oracle)),
                                                torch.tensor(np.asarray(test.labels[:, 0])))
    if dist.enabled:
        results["world_size"] = dist.world
    notes = [n for n in (guard.overconfidence_note(results, trainer.metric),
                         few_candidates_note(results.get("test") or {}),
                         one_class_note(results)) if n]
    if notes:
        results["notes"] = notes
    if dist.is_main:
        (run / "results.json").write_text(json.dumps(results, indent=1))
    print_results(results, console)
    console.print(f"run directory: {run}")
    results["run_dir"] = str(run)
    dist.barrier()
    if lock is not None:
        lock.close()
    return results


def one_class_note(results: dict[str, Any]) -> str | None:
    """Why an AUC reads nan: its label has one class only in that split (no positive, or
    no negative), where no ranking of the rows can be scored."""
    bad = [f"{split} {k}" for split in ("valid", "test")
           for k, v in (results.get(split) or {}).items()
           if (k == "auc" or k.startswith("auc_")) and isinstance(v, float) and math.isnan(v)]
    if not bad:
        return None
    return (f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} undefined (nan): the label "
            "has one class only in that split (no positive or no negative row); its LogLoss "
            "still scores the predictions")


def few_candidates_note(m: dict[str, Any]) -> str | None:
    """A warning when a CTR model's per-user ranking metrics rank too few rows to mean
    anything (each user's rows are its candidates: with 2 of them HitRate@10 is 1)."""
    n = m.get("candidates_per_query")
    if n is None or n > RANKING_K:
        return None
    return (f"HitRate@{RANKING_K}, NDCG@{RANKING_K} and MRR rank each user's own test rows: "
            f"{n:.1f} per user on average, so HitRate@{RANKING_K} says little (with "
            f"{RANKING_K} rows or fewer every positive is in the top {RANKING_K}). To rank "
            "the catalogue, train a next-item (sasrec) or two-tower model.")


def print_placement(strategy: SingleProcess, model: torch.nn.Module,
                    console: Console) -> None:
    """The embedding placement plan of a distributed run: every table, its size, where it
    lives."""
    plan = strategy.describe(model)
    rows, nbytes = sum(r[1] for r in plan), sum(r[3] for r in plan)
    # the features' tables are parts of one fused table per collection: the placement
    # (and train.shard_min_bytes) is that table's
    table = Table(title="embedding placement", caption=(
        f"the features' rows are parts of one fused table ({rows:,} rows, {nbytes:,} bytes "
        "in all), replicated or row-sharded as a whole: train.shard_min_bytes is compared "
        "with its size; dim includes a first-order weight where the model has one"))
    for col in ("table", "rows", "dim", "bytes", "placement"):
        table.add_column(col, justify="left" if col in ("table", "placement") else "right")
    for name, n, dim, size, where in plan:
        table.add_row(name, f"{n:,}", str(dim), f"{size:,}", where)
    console.print(table)


def print_results(results: dict[str, Any], console: Console) -> None:
    kept = (f"best step {results['best_step']} of {results['steps']}" if results.get("valid")
            else f"final weights after {results['steps']} steps (no validation split)")
    table = Table(title=f"{results['model']}: {kept}, {results['train_seconds']} s")
    splits = [s for s in ("valid", "test") if results.get(s)]
    cols = list(dict.fromkeys(k for s in splits for k in headline_metrics(results[s])))
    if any("oracle_auc" in results[s] for s in splits):
        cols.append("oracle_auc")
    table.add_column("split")
    for col in [*cols, "rows"]:
        table.add_column(col, justify="right")
    for split in splits:
        m = results[split]
        table.add_row(split, *(f"{m[c]:.4f}" if c in m else "-" for c in cols),
                      f"{int(m['rows']):,}")
    console.print(table)
    for note in results.get("notes", []):
        console.print(f"[yellow]note[/]: {note}")
    test = results.get("test", {})
    if "oracle_auc" in test:
        console.print(f"test AUC {test['auc']:.4f} vs oracle AUC {test['oracle_auc']:.4f} "
                      f"(gap {test['oracle_auc'] - test['auc']:.4f})")
    for key in test:
        if key.startswith("pop_recall@"):
            mine = key[len("pop_"):]
            console.print(f"test {mine} {test[mine]:.4f} vs popularity baseline "
                          f"{test[key]:.4f}")


# --------------------------------------------------------------- using a finished run
class RunArtifacts:
    """A finished run opened for evaluation and prediction (best weights, saved pipeline)."""

    def __init__(self, run_dir: str | Path):
        self.run = Path(run_dir)
        if not (self.run / "config.yaml").exists():
            raise not_a_run(self.run)
        self.cfg = load_config(self.run / "config.yaml", finished=True)
        self.store = Store.open(self.run / "data")
        self.pipeline = self.store.pipeline()
        self.model = build_model(self.cfg.model, self.store.schema)
        weights = self.run / "checkpoints" / BEST
        if not weights.exists():
            weights = self.run / "checkpoints" / LAST
        self.model.load_state_dict(ckpt.load(weights)["model"])
        tc = self.cfg.train
        device = resolve_device(tc.device)
        self.model.to(device)
        if device.type == "cpu":  # the GEMM paths the run measured
            apply_saved(self.model, self.run)
        # a retrieval task reads its item corpus from the train split
        task = make_task(self.model, self.store.split("train") or self._empty())
        self.evaluator = Evaluator(self.model, task, device, tc.eval_batch_size, tc.prefetch)

    def _empty(self) -> SplitArrays:
        s = self.store.schema
        return SplitArrays(dense=np.zeros((0, s.num_dense), np.float32),
                           sparse=np.zeros((0, s.num_sparse), np.int64))

    def read(self, files: str | list[str], with_labels: bool) -> SplitArrays:
        """Raw files -> arrays through the saved pipeline; bad rows go to
        ``<run>/rejects-input.jsonl`` (rewritten by each call)."""
        rejects = self.run / "rejects-input.jsonl"
        rejects.unlink(missing_ok=True)
        data, log = transform_files(self.cfg, self.pipeline, files, with_labels, rejects=rejects)
        self.last_log = log
        return data

    def labelled(self, split_or_files: str | list[str]) -> SplitArrays:
        """A stored split (``train`` / ``valid`` / ``test``) or raw files with labels,
        through the run's pipeline."""
        if isinstance(split_or_files, str) and split_or_files in ("train", "valid", "test"):
            data = self.store.split(split_or_files)
            if data is None:
                raise RunError(f"the {split_or_files} split of {self.run} is empty")
            return data
        return self.read(split_or_files, with_labels=True)

    def evaluate(self, split_or_files: str | list[str], bootstrap: int = 0,
                 ranking: int | list[int] | None = None) -> dict[str, Any]:
        """The run's metrics on a split or raw files; with ``bootstrap`` resamples of the
        rows (of the queries, for a next-item or retrieval model), each AUC (each ranking
        metric) also gets ``<name>_ci95``: its 95 % bootstrap interval. With ``ranking`` = K
        (or several Ks): a CTR model's groups (``features.group``, e.g. the user) are each
        ranked as a query (MRR, NDCG@K, HitRate@K and Recall@K over the groups with a
        positive); a retrieval or next-item model reports its ranking metrics at those
        cut-offs."""
        data = self.labelled(split_or_files)
        outputs: list[torch.Tensor] = []
        ks = sorted({ranking} if isinstance(ranking, int) else set(ranking or []))
        task = self.evaluator.task
        if ks and hasattr(task, "cutoffs"):  # a ranking task: its own metrics at these Ks
            task.cutoffs = tuple(sorted({*task.cutoffs, *ks}))
            ks = []

        def infer(fn, d):  # type: ignore[no-untyped-def]  # keeps the logits: one pass
            outputs.append(self.evaluator.infer(fn, d))
            return outputs[-1]

        metrics: dict[str, Any] = dict(task.evaluate(self.model, data, infer))
        if bootstrap and getattr(task, "last_ranks", None) is not None:
            from sampan.tasks.next_item import rank_bootstrap

            metrics.update(rank_bootstrap(task.last_ranks, task.cutoffs, bootstrap))
        if bootstrap and getattr(task, "name", "") == "retrieval":
            from sampan.tasks.next_item import query_bootstrap

            _, names, per_query = task.query_metrics(self.model, data, self.evaluator.infer)
            metrics.update(query_bootstrap(names, per_query, bootstrap))
        for ranking in ks:
            if data.group is None or not outputs:
                raise RunError(f"{self.run}: ranking metrics rank each group's rows (set "
                               "features.group, e.g. to user_id, and train again)"
                               if data.group is None else "ranking metrics need a CTR model")
            metrics.update(grouped_ranking_metrics(
                outputs[0][:, 0], torch.from_numpy(np.array(data.labels[:, 0])),
                torch.from_numpy(np.array(data.group)), ranking))
        if bootstrap and "auc" in metrics:
            logits = outputs[0]
            labels = torch.from_numpy(np.array(data.labels, dtype=np.float32))
            names = ["auc"] + [f"auc_{t}" for t in range(logits.shape[1])
                               if f"auc_{t}" in metrics]
            for name in names:
                t = 0 if name == "auc" else int(name[len("auc_"):])
                b = auc_bootstrap(logits[:, t], labels[:, t], bootstrap)
                b = b[~b.isnan()]
                if len(b):
                    metrics[f"{name}_ci95"] = [float(torch.quantile(b, 0.025)),
                                               float(torch.quantile(b, 0.975))]
        return metrics

    def predict(self, files: str | list[str]) -> np.ndarray:
        """Probabilities ``[N, T]`` for raw rows (labels not needed)."""
        parts = [probs for _, probs in self.predict_chunks(files)]
        if not parts:
            raise DataError("no rows left to use after reading the input")
        return np.concatenate(parts)

    def predict_chunks(self, files: str | list[str]
                       ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(line numbers, probabilities [n, T])`` chunk by chunk, so files of any size
        are scored in bounded memory. Bad rows go to ``<run>/rejects-input.jsonl``; when
        the iteration ends, ``last_log`` holds the counts and ``data.max_bad_fraction`` has
        been checked (raising :class:`DataError` when exceeded)."""
        rejects = self.run / "rejects-input.jsonl"
        rejects.unlink(missing_ok=True)
        log = RejectLog(rejects)
        self.last_log = log
        try:
            for arrays in iter_transformed(self.cfg, self.pipeline, files, False, log):
                chunk = SplitArrays.concat([arrays], None)
                yield arrays["line"], probabilities(self.evaluator.predict_logits(chunk))
        finally:
            log.close()
        log.check(self.cfg.data.max_bad_fraction)


def compare_runs(a: RunArtifacts, b: RunArtifacts, split_or_files: str | list[str] = "test",
                 resamples: int = 1000, task: int = 0) -> dict[str, Any]:
    """Paired bootstrap of two runs' AUC on the same rows: a stored split of both runs
    (which must hold the same rows: same count and labels) or raw files read by each run's
    own pipeline. Returns both AUCs, ``diff`` (b - a), its 95 % interval and how often b
    came out ahead, over ``resamples`` resamples shared by the two models. Next-item and
    retrieval runs are compared on their ranking metrics instead, query by query
    (:func:`_compare_rankings`)."""
    kinds = {getattr(art.model, "task", "binary") for art in (a, b)}
    for ranked, what in (("next_item", "next-item"), ("retrieval", "retrieval")):
        if ranked not in kinds:
            continue
        if kinds != {ranked}:
            raise RunError(f"{a.run} and {b.run} are not both {what} runs: a {what} model "
                           "is compared with another on its ranking metrics")
        return _compare_rankings(a, b, split_or_files, resamples)

    def scored(art: RunArtifacts) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None]:
        data = art.labelled(split_or_files)
        if data.labels is None or task >= data.labels.shape[1]:
            raise RunError(f"{art.run} has no label {task} to compare on")
        logits = art.evaluator.predict_logits(data)
        if task >= logits.shape[1]:
            raise RunError(f"{art.run}'s model predicts {logits.shape[1]} label(s); "
                             f"there is no task {task}")
        return logits[:, task], np.asarray(data.labels[:, task]), data.line

    za, ya, la = scored(a)
    zb, yb, lb = scored(b)
    if len(ya) != len(yb) or not np.array_equal(ya, yb) or (
            la is not None and lb is not None and not np.array_equal(la, lb)):
        raise RunError(f"{a.run} and {b.run} do not hold the same rows ({len(ya):,} vs "
                         f"{len(yb):,} rows, or different labels): a paired comparison needs "
                         "the same data and split (or give the same --data files)")
    y = torch.from_numpy(ya.astype(np.float32))
    r = paired_auc_comparison(za, zb, y, resamples)
    return {"a": {"run": str(a.run), "auc": r["auc_a"]},
            "b": {"run": str(b.run), "auc": r["auc_b"]},
            "rows": len(ya), "resamples": resamples, "task": task, "diff": r["diff"],
            "diff_ci95": r["diff_ci95"], "p_b_better": r["p_b_better"]}


def _compare_rankings(a: RunArtifacts, b: RunArtifacts, split_or_files: str | list[str],
                      resamples: int) -> dict[str, Any]:
    """Two next-item or two retrieval runs on the same queries (next-item: each positive
    row, a user's next item; retrieval: each user with a positive row): every ranking
    metric of both, with the paired bootstrap of its difference over the queries; ``diff``
    / ``diff_ci95`` / ``p_b_better`` at the top are those of a's headline metric (the one
    its early stopping followed)."""
    from sampan.tasks.next_item import paired_query_comparison

    tasks = [art.evaluator.task for art in (a, b)]
    cutoffs = tuple(sorted({c for t in tasks for c in t.cutoffs}))
    scored = [_query_metrics(art, split_or_files, cutoffs) for art in (a, b)]
    (qa, names, ma), (qb, _, mb) = scored
    if len(qa) != len(qb) or not np.array_equal(qa, qb):
        raise RunError(f"{a.run} and {b.run} do not rank the same queries ({len(qa):,} vs "
                       f"{len(qb):,}, or different users or next items): a paired comparison "
                       "needs the same data and split (or give the same --data files)")
    metrics = paired_query_comparison(names, ma, mb, resamples)
    head = metrics[tasks[0].default_metric]
    return {"a": {"run": str(a.run), **{n: m["a"] for n, m in metrics.items()}},
            "b": {"run": str(b.run), **{n: m["b"] for n, m in metrics.items()}},
            "queries": len(qa), "resamples": resamples, "metric": tasks[0].default_metric,
            "diff": head["diff"], "diff_ci95": head["diff_ci95"],
            "p_b_better": head["p_b_better"],
            "metrics": {n: {k: m[k] for k in ("diff", "diff_ci95", "p_b_better")}
                        for n, m in metrics.items()}}


def _query_metrics(art: RunArtifacts, split_or_files: str | list[str],
                   cutoffs: tuple[int, ...]) -> tuple[np.ndarray, list[str], np.ndarray]:
    """``(queries, metric names, [Q, metrics])`` of a ranking run, the queries as raw
    values (the runs may number users and items differently): a retrieval query is its
    user (sorted), a next-item query its row's next item (in the split's row order)."""
    from sampan.tasks.next_item import per_query_metrics

    data = art.labelled(split_or_files)
    task = art.evaluator.task
    if getattr(task, "name", "") == "retrieval":
        users, names, per_query = task.query_metrics(art.model, data, art.evaluator.infer,
                                                     cutoffs)
        keys = _raw_values(art, task.user_col, users).astype(str)
        order = np.argsort(keys, kind="stable")
        return keys[order], names, per_query[order]
    # next-item: the rows in the split's order, each named by its next item
    ranks, _ = task.ranks(art.model, data, art.evaluator.infer)
    names, per_query = per_query_metrics(ranks, cutoffs)
    pos = np.asarray(data.labels[:, 0]) > 0.5 if data.labels is not None else None
    rows = data if pos is None else data.take(np.flatnonzero(pos))
    return _raw_values(art, task.target, np.asarray(rows.sparse[:, task.target])).astype(str), \
        names, per_query


def _raw_values(art: RunArtifacts, column: int, ids: np.ndarray) -> np.ndarray:
    """The raw values of sparse feature ``column``'s ids (text; ``""`` for padding and
    OOV, and for a hashed feature the ids themselves as text)."""
    from sampan.data.transforms import FIRST_VOCAB_ID

    name = art.store.schema.sparse[column].name
    enc = next((e for e in art.pipeline.categorical if e.spec.name == name), None)
    vocab = getattr(enc, "vocab_", None)
    if vocab is None:
        return ids.astype(str)
    named = (ids >= FIRST_VOCAB_ID) & (ids < FIRST_VOCAB_ID + len(vocab))
    out = np.full(len(ids), "", dtype=object)
    out[named] = np.asarray(vocab.take(ids[named] - FIRST_VOCAB_ID).to_pylist(), dtype=object)
    return out
