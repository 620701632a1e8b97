"""Parquet files, read by row group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sampan.config import DataConfig
from sampan.data.io.paths import StreamInput
from sampan.data.rejects import RejectLog
from sampan.data.roles import ColumnRoles
from sampan.data.validate import validate_table
from sampan.errors import DataError


# --------------------------------------------------------------------------------- parquet
def iter_parquet(cfg: DataConfig, path: Path, roles: ColumnRoles,
                  log: RejectLog) -> Iterator[pa.Table]:
    pf = pq.ParquetFile(path.open_file() if isinstance(path, StreamInput) else path)
    names = pf.schema_arrow.names
    missing = [c for c in roles.all if c not in names]
    if missing:
        raise DataError(f"{path}: column(s) {missing} not found; the file has {names}")
    yield from validated((pa.Table.from_batches([b]) for b in
                          pf.iter_batches(batch_size=65536, columns=roles.all)),
                         str(path), roles, log)


def validated(tables: Iterator[pa.Table], path: str, roles: ColumnRoles,
              log: RejectLog) -> Iterator[pa.Table]:
    """Typed, checked tables of a file read as whole records (Parquet, a reader of your
    own), a row's line being its 1-based position in the file."""
    start = 1
    for table in tables:
        lines = np.arange(start, start + table.num_rows)
        start += table.num_rows
        out = validate_table(table.select(roles.all), roles, lines, path, log, ",")
        log.check_early()
        if out.num_rows:
            yield out


# ---------------------------------------------------------------------- your own reader
def iter_plugin(cfg: DataConfig, path: Path, roles: ColumnRoles,
                log: RejectLog) -> Iterator[pa.Table]:
    """A file read by the ``@register_reader`` function named by ``data.format``."""
    from sampan.config.registry import get_reader

    reader = get_reader(cfg.format)
    yield from validated(_checked(reader(path, dict(cfg.reader_options)), path, roles,
                                  cfg.format), str(path), roles, log)


def _checked(tables: Iterator[pa.Table], path: Path, roles: ColumnRoles,
             fmt: str) -> Iterator[pa.Table]:
    for table in tables:
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise DataError(f"{path}: the reader of format {fmt!r} yielded a "
                            f"{type(table).__name__}; expected pyarrow Tables (or "
                            "RecordBatches) of the file's records")
        missing = [c for c in roles.all if c not in table.column_names]
        if missing:
            raise DataError(f"{path}: column(s) {missing} not found in what the reader of "
                            f"format {fmt!r} yields; it has {table.column_names}")
        yield table
