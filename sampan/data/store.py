"""Building the processed dataset from raw files (:func:`build_store`) in one streaming pass:
read, validate, split, fit the pipeline on train, transform, write. Its layout on disk and
how it is read are described in :mod:`sampan.data.arrays` (:class:`Store`,
:class:`SplitArrays`, importable from here).
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from sampan.config import ExperimentConfig
from sampan.data.arrays import FIELDS, SPLITS, SplitArrays, Store  # noqa: F401  (importable from here)
from sampan.data.pipeline import FeaturePipeline
from sampan.data.sources import LINE_COLUMN, DataError, RejectLog, expand_paths, read_source
from sampan.data.splits import ROLE_CODES, Splitter, split_fractions
from sampan.data.synthetic import iter_synthetic
from sampan.schema import DataSchema


def _source_tables(cfg: ExperimentConfig, spec: str | list[str] | None,
                   pipe: FeaturePipeline, log: RejectLog) -> Iterator[pa.Table]:
    if cfg.data.format == "synthetic":
        cols = pipe.roles().all
        for t in iter_synthetic(cfg.data.synthetic):
            log.read += t.num_rows
            log.kept += t.num_rows
            yield t.select(cols)
        return
    yield from read_source(cfg.data, spec, pipe.roles(), log)


MARK = ".sampan-store"  # in every folder build_store writes


def _first_rows(tables: Iterator[pa.Table], n: int | None) -> Iterator[pa.Table]:
    """The first ``n`` rows of ``tables`` (all of them when ``n`` is None)."""
    for t in tables:
        if n is not None:
            if n <= 0:
                return
            t, n = t.slice(0, n), n - min(n, t.num_rows)
        yield t


def check_inputs(cfg: ExperimentConfig) -> None:
    """Every data file and side table the config names exists (raises ``DataError`` naming
    the first that does not), so a run fails before it leaves a folder behind."""
    if cfg.data.format == "synthetic":
        return
    for spec in (cfg.data.train, cfg.data.valid, cfg.data.test,
                 *(j.path for j in cfg.data.joins)):
        if spec:
            expand_paths(spec)


def build_store(cfg: ExperimentConfig, root: str | Path, echo: Any = None) -> Store:
    """Read, validate, split, fit the pipeline on train, transform and write every split.

    ``echo`` receives the summary lines and the feature table (default: printed)."""
    echo = echo or Console().print
    root = Path(root)
    if root.exists():
        left = {p.name for p in root.iterdir()}
        ours = (root / "manifest.json").exists() or MARK in left
        if left - {"rejects.jsonl"} and not ours:
            raise DataError(f"{root} exists and is not processed data (no manifest.json); "
                            "refusing to overwrite it: choose an empty or new folder")
        shutil.rmtree(root)  # an earlier store being rebuilt (or what a stopped one left)
    (root / "staging").mkdir(parents=True)
    (root / MARK).touch()  # a build killed midway leaves a folder a new build may replace
    started = False
    try:
        if cfg.data.engine == "ray":
            from sampan.data import ray_engine

            started = ray_engine.connect(cfg.data.ray_address)
        return _build(cfg, root, echo)
    except BaseException as e:
        if started:  # its tasks are stopped before their files go
            ray_engine.disconnect()
            started = False
        # nothing half-written stays: a later build starts clean; the rejects file, which
        # says why a build stopped on bad rows, is kept
        for p in root.iterdir():
            if p.name not in ("rejects.jsonl", MARK):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"no space left on the device while writing the processed data "
                            f"to {root} ({e.strerror}); free some space or point output_dir "
                            "(or --out) elsewhere; nothing was kept") from e
        raise
    finally:
        if started:
            ray_engine.disconnect()


def _build(cfg: ExperimentConfig, root: Path, echo: Any) -> Store:
    extra = [cfg.data.oracle_column] if cfg.data.oracle_column else []
    if cfg.data.format == "synthetic" and not extra:
        extra = ["oracle_p"]
    split = cfg.data.split
    loo = split.method == "leave_one_out"
    order = [split.order] if loo and split.order else []
    pipe = FeaturePipeline(
        cfg.features,
        extra_numeric=extra + ([split.column] if split.method == "time" else []) + order,
        extra_categorical=[split.column] if split.method in ("group", "leave_one_out") else [],
        extra_required=([split.column] if split.method in ("time", "group", "leave_one_out")
                        else []) + order)
    log = RejectLog(root / "rejects.jsonl")

    # 1. Stage: raw -> validated Arrow IPC (the only pass over the raw text).
    explicit = [r for r in SPLITS if r == "train" or getattr(cfg.data, r)]
    ray = cfg.data.engine == "ray"
    if ray:
        from sampan.data import ray_engine

        echo(f"data: engine ray, {ray_engine.describe()}")
    # role -> (its staged parts, in order; rows)
    staged: dict[str, tuple[list[Path], int]] = {}
    try:
        for role in explicit:
            if ray and cfg.data.format != "synthetic":
                staged[role] = ray_engine.stage(cfg, role, getattr(cfg.data, role), pipe,
                                                root / "staging", log)
                continue
            path = root / "staging" / f"{role}.arrow"
            n = _stage(_source_tables(cfg, getattr(cfg.data, role), pipe, log), path)
            staged[role] = ([path], n)
    finally:
        log.close()
    log.check(cfg.data.max_bad_fraction)
    if staged["train"][1] == 0:
        raise DataError("the training data has no usable rows")

    # 2. Which rows of the train source go where.
    carve = [r for r in SPLITS if r not in explicit or r == "train"]
    fractions = split_fractions(split, carve)
    n_src = staged["train"][1]
    times = None
    if split.boundaries is not None and len(carve) < 3:
        raise DataError("split.boundaries carve valid and test out of data.train; with "
                        "data.valid / data.test files, leave boundaries out")
    if split.method == "time":
        _check_time_order(staged, split.column)
        if "valid" in explicit and "test" in carve:
            raise DataError("time split: data.valid is a separate file, so the test rows "
                            "cannot be carved from data.train (they would come before "
                            "validation); give data.test as well")
        times = _column_sample(staged["train"][0], split.column)
    held_out = _leave_one_out_rows(staged["train"][0], split.column, split.order) if loo \
        else None
    splitter = Splitter(split, fractions, n_src, times, held_out)

    def batches(role: str) -> Iterator[pa.Table]:
        src = "train" if role in carve else role
        for start, t in _staged_chunks(staged[src][0], None):
            if src == "train":
                t = t.filter(pa.array(splitter.codes(t, start) == ROLE_CODES[role]))
            if t.num_rows:
                yield t

    # 3. Fit on the train split only (the leakage guard: valid/test never reach fit); with
    # features.fit_rows, on its first rows only.
    if ray:
        units = ray_engine.plan_units(staged, carve, splitter)
        ray_engine.fit(pipe, units, splitter, cfg.features.fit_rows)
    else:
        pipe.fit(_first_rows(batches("train"), cfg.features.fit_rows))
    pipe.save(root / "pipeline")

    # 4. Transform every split: one pass over the train source feeds all carved splits.
    rows = {r: 0 if r in carve else staged[r][1] for r in SPLITS}
    key_cols = [split.column] if split.method in ("time", "group") else []
    if loo:  # leave_one_out reads only the row index
        key_cols = [split.column]
    if ray:
        for r in carve:
            rows[r] = sum(u.rows.get(r, 0) for u in units)
    else:
        for start, t in _staged_chunks(staged["train"][0], key_cols):
            codes = splitter.codes(t, start)  # chunk by chunk: memory stays bounded
            for r in carve:
                rows[r] += int((codes == ROLE_CODES[r]).sum())
    empty = [r for r in carve if fractions[r] > 0 and rows[r] == 0] if not loo else \
        [r for r in carve if r != "train" and rows[r] == 0]
    if empty and loo:
        raise DataError(f"split leave_one_out: no value of {split.column!r} has 3 rows or "
                        f"more among the {n_src:,} usable rows, so valid and test are empty "
                        "(users with fewer rows train only)")
    if empty:
        raise DataError(f"the {' and '.join(empty)} split(s) came out empty: "
                        f"{n_src:,} usable row(s) split {split.method} by "
                        f"{ {r: round(f, 3) for r, f in fractions.items()} } leave none "
                        "there; give more data, or set that fraction to 0")
    oracle = extra[0] if extra else None
    if ray:
        ray_engine.transform(pipe, units, splitter, rows, oracle, root)
    else:
        _transform_local(pipe, staged, carve, splitter, batches, rows, oracle, root)
    shutil.rmtree(root / "staging")

    sources = {r: (cfg.data.synthetic.model_dump() if cfg.data.format == "synthetic"
                   else [str(p) for p in expand_paths(getattr(cfg.data, r))])
               for r in explicit}
    manifest = {
        "schema": pipe.schema().to_json(),
        "splits": {r: {"rows": rows[r], "from": "train source" if r in carve else "own files"}
                   for r in SPLITS},
        "split": {"method": split.method, "fractions": None if loo else fractions,
                  "column": split.column, "order": split.order,
                  "boundaries": list(splitter.boundaries) if splitter.boundaries else None},
        "sources": sources,
        "rejects": log.summary(),
        "fitted_on": {"split": "train", "rows": pipe.fitted_rows_},
        "features": pipe.feature_report(),
        "oracle": bool(cfg.data.oracle_column or cfg.data.format == "synthetic"),
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    echo(f"data: {log.describe()}")
    schema = pipe.schema()
    kinds: dict[str, int] = {}
    for e in pipe.lists:  # sequences, bags, text
        kinds[e.spec.kind] = kinds.get(e.spec.kind, 0) + 1
    lists = "".join(f", {n} {k}{'s' if n > 1 and k != 'text' else ''}"
                    for k, n in kinds.items())
    echo("data: " + ", ".join(f"{r} {rows[r]:,}" for r in SPLITS) + " rows; "
         f"{len(pipe.categorical)} categorical, {len(pipe.numeric)} numeric features{lists}; "
         f"embedding rows {sum(s.cardinality for s in [*schema.sparse, *schema.own_tables]):,}")
    echo(feature_table(manifest["features"], pipe.fitted_rows_))
    return Store.open(root)


def _transform_local(pipe: FeaturePipeline, staged: dict[str, tuple[list[Path], int]],
                     carve: list[str], splitter: Splitter, batches: Any, rows: dict[str, int],
                     oracle: str | None, root: Path) -> None:
    """Transform every split in this process, writing each in order."""
    writers = {r: _SplitWriter(root / r, pipe.schema(), rows[r], oracle) for r in SPLITS}
    complete = False
    try:
        for start, t in _staged_chunks(staged["train"][0], None):
            codes = splitter.codes(t, start)
            for r in carve:
                part = t.filter(pa.array(codes == ROLE_CODES[r]))
                if part.num_rows:
                    writers[r].append(pipe.transform(part))
        for r in SPLITS:
            if r not in carve:
                for t in batches(r):
                    writers[r].append(pipe.transform(t))
        complete = True
    finally:
        for w in writers.values():
            w.close(check=complete)  # after a failure, its own error is the one to see


def unseen_share(feature: dict[str, Any]) -> str:
    """A feature report's OOV share (a vocabulary's) or missing share (a number's), as the
    console and ``sampan report`` show it: a percentage, or ``-`` where it has none."""
    share = feature.get("oov_share", feature.get("missing_share"))
    return "-" if share is None else f"{100 * share:.1f}%"


def feature_table(report: list[dict[str, Any]], rows: int) -> Table:
    """The effective feature settings as a table (``FeaturePipeline.feature_report``)."""
    t = Table(title=f"features fitted on {rows:,} train rows")
    # a narrow terminal wraps the cells; a name or a word is folded, never cut off
    t.add_column("feature", overflow="fold")
    t.add_column("kind", no_wrap=True, min_width=len("categorical"))
    t.add_column("transform", overflow="fold")
    for col in ("ids", "OOV / missing"):
        t.add_column(col, justify="right")
    for f in report:
        t.add_row(f["feature"], f["kind"], f["transform"],
                  f"{f['ids']:,}" if "ids" in f else "-", unseen_share(f))
    return t


def _staged_chunks(paths: list[Path], columns: list[str] | None, start: int = 0,
                   batches: tuple[int, int] | None = None) -> Iterator[tuple[int, pa.Table]]:
    """(first row index, chunk) over staged files, one after the other: every column
    (``None``), or only ``columns`` — then the files are memory-mapped so only those
    columns' pages are read (and not mapped otherwise, so memory stays bounded). Row
    indices count from ``start``; ``batches``: only the record batches ``[lo, hi)`` (of
    one file)."""
    for path in paths:
        if path.stat().st_size == 0:
            continue
        with (pa.memory_map(str(path)) if columns is not None else pa.OSFile(str(path))) as f:
            reader = pa.ipc.open_file(f)
            lo, hi = batches or (0, reader.num_record_batches)
            for i in range(lo, hi):
                b = reader.get_batch(i)
                t = pa.Table.from_batches([b])
                yield start, (t if columns is None else t.select(columns))
                start += b.num_rows


def _leave_one_out_rows(path: list[Path], user: str, order: str | None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The row indices of each user's second-to-last and last row of a staged file (users
    with 3 rows or more), in ``order`` (else file order)."""
    from sampan.data.splits import LeaveOneOut
    from sampan.data.transforms import stable_hash

    loo = LeaveOneOut()
    for start, t in _staged_chunks(path, [user] + ([order] if order else [])):
        times = t.column(order).to_numpy().astype(np.float64) if order else None
        loo.add(stable_hash(t.column(user).combine_chunks()), times, start)
    return loo.rows()


def _column_sample(path: list[Path], column: str, size: int = 1_000_000) -> np.ndarray:
    """Up to ``size`` values of a numeric column of a staged file (a uniform sample)."""
    from sampan.data.transforms import Reservoir

    res = Reservoir(size=size, seed=0)
    for _, t in _staged_chunks(path, [column]):
        res.add(t.column(column).to_numpy().astype(np.float64))
    return res.values()


def _check_time_order(staged: dict[str, tuple[list[Path], int]], column: str) -> None:
    """With separate train/valid/test files, each must end before the next begins."""
    spans = {}
    for role in SPLITS:
        if role in staged and staged[role][1]:
            lo, hi = np.inf, -np.inf
            for _, t in _staged_chunks(staged[role][0], [column]):
                x = t.column(column).to_numpy().astype(np.float64)
                lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
            spans[role] = (lo, hi)
    order = [r for r in SPLITS if r in spans]
    for a, b in zip(order, order[1:], strict=False):
        if spans[a][1] >= spans[b][0]:
            raise DataError(f"time split on {column!r}: {a} ends at {spans[a][1]:g} but {b} "
                            f"starts at {spans[b][0]:g}; {a} must be strictly before {b}")


def _stage(tables: Iterator[pa.Table], path: Path) -> int:
    n = 0
    writer = None
    try:
        for t in tables:
            if not t.num_rows:
                continue
            if writer is None:
                writer = pa.ipc.new_file(str(path), t.schema)
            writer.write_table(t)
            n += t.num_rows
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        path.write_bytes(b"")
    return n


def split_layout(schema: DataSchema, n: int, oracle: str | None
                 ) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """The ``.npy`` files of a split of ``n`` rows: each one's shape and dtype, by name."""
    shapes: dict[str, tuple[int, ...]] = {
        "dense": (n, schema.num_dense), "sparse": (n, schema.num_sparse),
        "labels": (n, schema.num_tasks)}
    if schema.has_group:
        shapes["group"] = (n,)
    if oracle:
        shapes["oracle"] = (n,)
    # Ids are stored as int32 when every table fits (half the bytes to write and to read
    # while training); the loader hands int64 tensors to the model. A dynamic table's
    # values are 64-bit keys, not rows: they keep all their bits.
    tables = [*schema.sparse, *schema.own_tables]
    narrow = max((t.cardinality for t in tables), default=0) < 2**31 and \
        all(t.dynamic is None for t in tables)
    ids = np.int32 if narrow else np.int64
    dtypes: dict[str, Any] = {"dense": np.float32, "sparse": ids, "labels": np.float32,
                              "group": np.int64, "oracle": np.float64}
    for spec in schema.sequences:
        shapes[f"seq_{spec.name}"] = (n, spec.max_len)
        dtypes[f"seq_{spec.name}"] = ids
    return shapes, dtypes


def write_header(f: Any, dtype: Any, shape: tuple[int, ...]) -> int:
    """Write an ``.npy`` header for ``shape`` rows of ``dtype`` to the open file ``f``;
    returns where the data begins."""
    np.lib.format.write_array_header_1_0(
        f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
            "shape": shape})
    return f.tell()


def stored_arrays(arrays: dict[str, Any], oracle: str | None) -> dict[str, Any]:
    """:meth:`FeaturePipeline.transform`'s arrays named as a split's files are."""
    arrays = dict(arrays)
    for name, ids in arrays.pop("sequences", {}).items():
        arrays[f"seq_{name}"] = ids
    if oracle:
        arrays["oracle"] = arrays.pop(oracle)
    return arrays


class _SplitWriter:
    """Appends transformed chunks to one split's ``.npy`` files (header first, then rows).

    Plain appends, not a writable memory map: written pages do not stay in this process's
    resident set, so peak memory does not grow with the data."""

    def __init__(self, out: Path, schema: DataSchema, n: int, oracle: str | None):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.n, self.oracle, self.pos = out, n, oracle, 0
        shapes, self.dtypes = split_layout(schema, n, oracle)
        self.files = {k: open(out / f"{k}.npy", "wb") for k in shapes}  # noqa: SIM115
        for k, f in self.files.items():
            write_header(f, self.dtypes[k], shapes[k])

    def append(self, arrays: dict[str, Any]) -> None:
        arrays = stored_arrays(arrays, self.oracle)
        for k, f in self.files.items():
            f.write(memoryview(np.ascontiguousarray(arrays[k], dtype=self.dtypes[k])))
        self.pos += len(arrays["sparse"])

    def close(self, check: bool = True) -> None:
        for f in self.files.values():
            f.close()
        if check and self.pos != self.n:
            raise RuntimeError(f"{self.out.name}: wrote {self.pos} rows, expected {self.n}")


def iter_transformed(cfg: ExperimentConfig, pipe: FeaturePipeline, spec: str | list[str],
                     with_labels: bool, log: RejectLog) -> Iterator[dict[str, Any]]:
    """Read raw files as configured and transform them chunk by chunk (memory bounded by
    ``data.block_size``): the arrays of :meth:`FeaturePipeline.transform` plus ``line``,
    the line numbers of the chunk's rows. Bad rows go to ``log``; the caller closes it and
    checks ``data.max_bad_fraction``."""
    roles = pipe.roles(with_labels=with_labels, with_extra=False)
    # A run trained on the built-in generator reads files in the generator's column layout.
    data_cfg = cfg.data if cfg.data.format != "synthetic" else cfg.data.model_copy(
        update={"format": "auto"})
    for t in read_source(data_cfg, spec, roles, log):
        if not t.num_rows:
            continue
        arrays = pipe.transform(t, with_labels=with_labels)
        arrays["line"] = t.column(LINE_COLUMN).to_numpy()
        yield arrays


def transform_files(cfg: ExperimentConfig, pipe: FeaturePipeline, spec: str | list[str],
                    with_labels: bool, rejects: Path | None = None) -> tuple[SplitArrays,
                                                                             RejectLog]:
    """Read raw files as configured and transform them in memory (for eval)."""
    log = RejectLog(rejects)
    try:
        parts = list(iter_transformed(cfg, pipe, spec, with_labels, log))
    finally:
        log.close()
    log.check(cfg.data.max_bad_fraction)
    data = SplitArrays.concat(parts, None)
    data.line = np.concatenate([p["line"] for p in parts])
    return data, log


def reuse_store(cfg: ExperimentConfig, src_run: Path, root: Path) -> bool:
    """Hard-link the processed data of the finished run ``src_run`` into ``root`` when it
    was built from the same ``data``, ``features`` and ``plugins`` sections (a processed
    store is never written again, so links are safe); ``False``, and nothing made, when they
    differ or ``src_run`` has no complete data. Copies where links cannot be made."""
    import os

    import yaml

    src = Path(src_run) / "data"
    if not (src / "manifest.json").exists() or not (Path(src_run) / "config.yaml").exists():
        return False
    theirs = yaml.safe_load((Path(src_run) / "config.yaml").read_text()) or {}
    mine = cfg.model_dump(mode="json")
    for c in (theirs, mine):  # either engine makes the same data
        for key in ("engine", "ray_address"):
            (c.get("data") or {}).pop(key, None)
    if any(theirs.get(k) != mine.get(k) for k in ("data", "features", "plugins")):
        return False
    if root.exists():
        shutil.rmtree(root)

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, root, copy_function=link)
    return True
