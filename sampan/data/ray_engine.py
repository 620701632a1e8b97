"""Preparing the data on a Ray cluster (``data.engine: ray``): the same processed data as the
local engine, with the work spread over Ray tasks.

:func:`~sampan.data.store.build_store` keeps its steps and asks this module for three of
them:

1. **Stage** (:func:`stage`): one task per input file reads and validates it into an Arrow
   file of its own under the store's ``staging`` folder, with its own rejects file; the
   rejects are then counted and written in file order, as the local engine writes them.
2. **Fit** (:func:`fit`): the staged rows are cut into units (runs of record batches, about
   four a CPU of the cluster); each task fits the pipeline on its unit's train rows, and
   the partial fits are merged in unit order (:meth:`FeaturePipeline.merge`): exact
   category counts, so ``min_count`` and ``max_size`` give the local vocabulary; numeric
   moments folded chunk by chunk, as one pass folds them. Quantile buckets come from a
   uniform sample of 200,000 values, as locally: the same edges while the train split has
   no more values than that, and within the sample's rank error beyond (by the DKW
   inequality, 0.36 % of the rows either side with 99 % probability).
3. **Transform** (:func:`transform`): each task transforms its unit and writes its rows at
   their place in every split's files, made in full beforehand (rows per split and unit are
   counted first). The splits' folders replace the final ones only when every task is done.

Every task can run again from the start with the same result, so Ray retries a task whose
worker died. The store's folder must be on storage that every node of the cluster sees (on
one machine, any folder).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from sampan.data.rejects import RejectLog
from sampan.data.sources import DataError, expand_paths, read_inputs
from sampan.data.splits import ROLE_CODES, Splitter
from sampan.errors import ConfigError

if TYPE_CHECKING:
    from sampan.config import DataConfig, ExperimentConfig
    from sampan.data.pipeline import FeaturePipeline

RETRIES = 3  # a task whose worker dies is run again this many times
UNITS_PER_CPU = 4
# fault injection for the tests: a path; the first transform task that finds its folder
# and not the file makes the file and kills its own worker
FAIL_ONCE = "SAMPAN_RAY_FAIL_ONCE"


@dataclass
class Unit:
    """Record batches ``[lo, hi)`` of one staged file, whose first row is ``start`` of its
    source's rows; ``roles``: the splits its rows go to (carved by the splitter when the
    source is the train data)."""

    source: str  # train, or the valid / test role of files of their own
    path: Path
    lo: int
    hi: int
    start: int
    rows: dict[str, int] = field(default_factory=dict)  # split -> rows it holds


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:  # the config refuses engine: ray without Ray; a stale env
        raise ConfigError("data.engine: ray needs Ray: pip install 'sampan[ray]'") from e
    return ray


def connect(address: str | None) -> bool:
    """Join the cluster at ``address`` (start one of this machine's cores when None), unless
    this process is connected already; True when this call connected."""
    ray = _ray()
    if ray.is_initialized():
        return False
    _reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
    except (ConnectionError, TimeoutError) as e:
        raise ConfigError(
            f"data.ray_address {address!r}: no Ray cluster answers there ({e}); start one "
            "with `ray start --head` (then address auto on that machine), or leave "
            "ray_address null to start a Ray of this machine for the preparation") from None
    except (RuntimeError, ValueError) as e:  # a malformed address, another Ray version
        raise ConfigError(f"data.ray_address {address!r}: cannot join that Ray cluster "
                          f"with Ray {ray.__version__}: {e}") from None
    return True


def _reachable(address: str | None) -> None:
    """Fail at once, naming where the address came from, when the cluster ``address`` (or
    ``$RAY_ADDRESS``, which Ray reads when none is given) names a host and port that take no
    connection: Ray itself retries such an address for minutes."""
    import os
    import socket

    given, where = (address, "data.ray_address") if address is not None else \
        (os.environ.get("RAY_ADDRESS"), "the environment's RAY_ADDRESS")
    if not given or given in ("auto", "local") or "://" in given or ":" not in given:
        return
    host, _, port = given.rpartition(":")
    if not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(
            f"{where} {given!r}: no Ray cluster answers there ({e.strerror or e}); start one "
            "with `ray start --head` (then address auto on that machine)"
            + (", or unset RAY_ADDRESS" if address is None else "") + ", or leave "
            "ray_address null to start a Ray of this machine for the preparation") from None


def disconnect() -> None:
    _ray().shutdown()


def describe() -> str:
    """The cluster's CPUs and nodes, for the run's log."""
    ray = _ray()
    cpus = int(ray.cluster_resources().get("CPU", 0))
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"{cpus} CPU(s) on {nodes} node(s)"


def _run(fn: Callable[..., Any], calls: list[tuple]) -> Iterator[Any]:
    """``fn(*args)`` for each of ``calls`` as Ray tasks, results in order. A task's
    ``DataError`` or ``ConfigError`` (bad input) is raised as itself; anything else keeps
    Ray's error, with the task's traceback."""
    ray = _ray()
    task = ray.remote(max_retries=RETRIES)(fn)
    refs = [task.remote(*args) for args in calls]
    try:
        for ref in refs:
            yield ray.get(ref)
    except BaseException as e:
        # nothing may go on writing into the store once its build has failed
        for r in refs:
            ray.cancel(r, force=True)
        ray.wait(refs, num_returns=len(refs), timeout=30)
        cause = getattr(e, "cause", None)
        if isinstance(e, ray.exceptions.RayTaskError) and isinstance(
                cause, DataError | ConfigError | OSError):
            raise cause from None  # bad input, or a full disk: as the local engine says it
        if isinstance(e, ray.exceptions.RayTaskError) and (
                missing := _missing_module(str(e))) is not None:
            raise ConfigError(missing) from e
        raise


def _missing_module(error: str) -> str | None:
    """What to do when a task's error says its worker could not import Sampan (or a module
    it needs): the cluster's Python lacks it. None for any other error."""
    import re

    name = re.findall(r"No module named '([^']+)'", error)
    if not name:  # the task's function, or its arguments, could not be loaded there
        return None
    node = re.search(r"ip=([^)\s]+)", error)
    from sampan import __version__

    top = name[-1].split(".")[0]
    fix = (f"install Sampan {__version__} there with pip install 'sampan[ray]'"
           if top == "sampan" else f"install {top} there")
    return (f"a Ray worker{f' on {node.group(1)}' if node else ''} cannot import "
            f"{name[-1]!r}: every node of the cluster runs the preparation's code in its own "
            f"Python; {fix} (or leave data.ray_address null to prepare on this machine)")


# ------------------------------------------------------------------------------ staging


def _stage_file(data: DataConfig, plugins: list[str], path: Any, roles: Any, out: Path,
                rejects: Path, first: bool) -> tuple[int, RejectLog]:
    from sampan.config.plugins import load_all
    from sampan.data.store import _stage

    load_all(plugins)  # a reader of the user's own registers itself in this worker too
    log = RejectLog(rejects)
    # as the local engine's one log, which counts the earlier files' kept rows: only the
    # train data's first file may stop the preparation on its own; the driver checks the
    # running totals of the others (see stage)
    log.early = first
    rejects.unlink(missing_ok=True)  # a retried task starts its rejects again
    try:
        n = _stage(read_inputs(data, [path], roles, log), out)
    except DataError:
        if not (first and log.read >= 1000 and log.kept == 0):
            raise
        n = 0  # stopped early: the driver raises it, naming the final rejects file
    finally:
        log.close()
    return n, log


def stage(cfg: ExperimentConfig, role: str, spec: str | list[str], pipe: FeaturePipeline,
          staging: Path, log: RejectLog) -> tuple[list[Path], int]:
    """Read and validate each file of ``spec`` in a task of its own: the staged files in
    input order and their rows; their rejects added to ``log``."""
    # the inputs as found here (a worker may start elsewhere: local paths made absolute;
    # a URI's file keeps its filesystem), never expanded again from their names
    given = expand_paths(spec)
    paths = [p.resolve() if isinstance(p, Path) else p for p in given]
    staging = staging.resolve()
    outs = [staging / f"{role}-{i:05d}.arrow" for i in range(len(paths))]
    # the data section only: the whole config would import the model zoo (and torch)
    # into every worker
    roles = pipe.roles()
    calls = [(cfg.data, cfg.plugins, p, roles, out,
              staging / f"rejects-{role}-{i:05d}.jsonl", role == "train" and i == 0)
             for i, (p, out) in enumerate(zip(paths, outs, strict=True))]
    n = 0
    for (rows, part), name in zip(_run(_stage_file, calls), given, strict=True):
        n += rows
        log.merge(part, file=str(name))  # as the local engine names it
        if part.path is not None:
            part.path.unlink(missing_ok=True)
        # the local engine's one log stops on 1,000 rejected rows before any kept: the
        # running totals, file by file, stop this build alike
        log.check_early()
    return outs, n


# ------------------------------------------------------------------------------- units


def plan_units(staged: dict[str, tuple[list[Path], int]], carve: list[str],
               splitter: Splitter) -> list[Unit]:
    """Cut every staged file into units of about equal rows (``UNITS_PER_CPU`` a CPU of the
    cluster), and count the rows each unit gives each split."""
    from sampan.data.store import _staged_chunks

    ray = _ray()
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    total = sum(n for _, n in staged.values())
    target = max(1, -(-total // (UNITS_PER_CPU * cpus)))
    units: list[Unit] = []
    for source, (paths, _) in staged.items():
        start = 0
        for path in paths:
            if path.stat().st_size == 0:
                continue
            with pa.memory_map(str(path)) as f:
                reader = pa.ipc.open_file(f)
                sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
            lo = rows = 0
            for i, size in enumerate(sizes):
                rows += size
                if rows >= target or i == len(sizes) - 1:
                    units.append(Unit(source, path, lo, i + 1, start,
                                      {} if source == "train" else {source: rows}))
                    start, lo, rows = start + rows, i + 1, 0
    columns = _split_columns(splitter)
    for u in units:
        if u.source != "train":
            continue
        for start, t in _staged_chunks([u.path], columns, u.start, (u.lo, u.hi)):
            codes = splitter.codes(t, start)
            for r in carve:
                u.rows[r] = u.rows.get(r, 0) + int((codes == ROLE_CODES[r]).sum())
    return units


def _split_columns(splitter: Splitter) -> list[str]:
    return [splitter.split.column] if splitter.split.method in ("time", "group") else []


def _unit_tables(u: Unit, splitter: Splitter, only: str | None = None
                 ) -> Iterator[tuple[str, pa.Table]]:
    """(split, rows of that split) for each record batch of ``u``, in order; ``only``: the
    rows of that split alone."""
    from sampan.data.store import _staged_chunks

    for start, t in _staged_chunks([u.path], None, u.start, (u.lo, u.hi)):
        if u.source != "train":
            yield u.source, t
            continue
        codes = splitter.codes(t, start)
        for role, code in ROLE_CODES.items():
            if u.rows.get(role) and only in (None, role):
                part = t.filter(pa.array(codes == code))
                if part.num_rows:
                    yield role, part


# --------------------------------------------------------------------------------- fit


def _fit_unit(pipe: FeaturePipeline, index: int, u: Unit, splitter: Splitter,
              limit: int | None) -> FeaturePipeline:
    pipe.reseed(index)
    for _, t in _unit_tables(u, splitter, only="train"):
        if limit is not None:
            if limit <= 0:
                break
            t, limit = t.slice(0, limit), limit - min(limit, t.num_rows)
        pipe.partial_fit(t)
    return pipe


def fit(pipe: FeaturePipeline, units: list[Unit], splitter: Splitter,
        fit_rows: int | None) -> None:
    """Fit ``pipe`` on the train rows of ``units`` (the first ``fit_rows`` of them when
    given): a task per unit, merged in order, then finalized."""
    calls, before = [], 0
    for i, u in enumerate(units):
        n = u.rows.get("train", 0)
        if not n:
            continue
        limit = None if fit_rows is None else max(0, fit_rows - before)
        before += n
        if limit == 0:
            break
        calls.append((pipe, i, u, splitter, limit))
    ray = _ray()
    if calls:  # one copy of what every task reads, in the object store
        shared = ray.put(pipe), ray.put(splitter)
        calls = [(shared[0], i, u, shared[1], limit) for _, i, u, _, limit in calls]
    for part in _run(_fit_unit, calls):
        pipe.merge(part)
    pipe.finalize()


# --------------------------------------------------------------------------- transform


def _layout(schema: Any, rows: dict[str, int], oracle: str | None, out: Path
            ) -> dict[str, dict[str, tuple[int, int, Any]]]:
    """Every split's files made at their full size: split -> file -> (offset of row 0,
    bytes a row, dtype)."""
    from sampan.data.store import split_layout, write_header

    layout: dict[str, dict[str, tuple[int, int, Any]]] = {}
    for role, n in rows.items():
        shapes, dtypes = split_layout(schema, n, oracle)
        (out / role).mkdir(parents=True, exist_ok=True)
        layout[role] = {}
        for key, shape in shapes.items():
            dtype = np.dtype(dtypes[key])
            with open(out / role / f"{key}.npy", "wb") as f:
                head = write_header(f, dtype, shape)
                row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
                f.truncate(head + row * n)
            layout[role][key] = (head, row, dtype)
    return layout


def _transform_unit(pipe: FeaturePipeline, u: Unit, splitter: Splitter, oracle: str | None,
                    out: Path, layout: dict[str, dict[str, tuple[int, int, Any]]],
                    first: dict[str, int]) -> dict[str, int]:
    from sampan.data.store import stored_arrays

    fail = os.environ.get(FAIL_ONCE)
    pos = dict(first)
    files: dict[tuple[str, str], Any] = {}
    try:
        for role, t in _unit_tables(u, splitter):
            arrays = stored_arrays(pipe.transform(t), oracle)
            for key, (head, row, dtype) in layout[role].items():
                f = files.get((role, key))
                if f is None:
                    f = files[role, key] = open(out / role / f"{key}.npy", "r+b")  # noqa: SIM115
                f.seek(head + row * pos[role])
                f.write(memoryview(np.ascontiguousarray(arrays[key], dtype=dtype)))
            pos[role] += t.num_rows
            if fail and Path(fail).parent.is_dir() and not Path(fail).exists():
                Path(fail).touch()
                for f in files.values():
                    f.flush()  # some of its rows are written: the retry writes them again
                os._exit(1)  # the worker dies mid-transform; Ray runs the task again
    finally:
        for f in files.values():
            f.close()
    return {r: pos[r] - first[r] for r in pos}


def transform(pipe: FeaturePipeline, units: list[Unit], splitter: Splitter,
              rows: dict[str, int], oracle: str | None, root: Path) -> None:
    """Transform every unit in a task of its own, each writing its rows at their place;
    the splits' folders are moved into ``root`` once every task has written its rows."""
    out = root.resolve() / "staging" / "splits"
    layout = _layout(pipe.schema(), rows, oracle, out)
    ray = _ray()
    shared = ray.put(pipe), ray.put(splitter)  # one copy for every task (the vocabularies)
    calls, at = [], dict.fromkeys(rows, 0)
    for u in units:
        calls.append((shared[0], u, shared[1], oracle, out, layout,
                      {r: at[r] for r in u.rows}))
        for r, n in u.rows.items():
            at[r] += n
    written = dict.fromkeys(rows, 0)
    for got in _run(_transform_unit, calls):
        for r, n in got.items():
            written[r] += n
    off = {r: (written[r], n) for r, n in rows.items() if written[r] != n}
    if off:
        raise RuntimeError("the transform wrote the wrong number of rows (split: written, "
                           f"expected): {off}")
    for role in rows:
        os.replace(out / role, root / role)
