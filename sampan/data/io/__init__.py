"""Reading raw files: one reader per format, chosen by
:func:`~sampan.data.io.paths.detect_format`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sampan.config import DataConfig
from sampan.data.io.delimited import delimited_columns, iter_delimited
from sampan.data.io.lines import iter_line_format
from sampan.data.io.parquet import iter_parquet, iter_plugin
from sampan.data.io.paths import StreamInput, detect_format
from sampan.data.rejects import RejectLog
from sampan.data.roles import ColumnRoles
from sampan.errors import DataError


def iter_source(cfg: DataConfig, paths: list[Path], roles: ColumnRoles,
                log: RejectLog) -> Iterator[pa.Table]:
    """Typed, validated tables from ``paths`` (read in chunks; memory stays bounded)."""
    for path in paths:
        fmt = detect_format(path, cfg.format)
        if fmt == "parquet":
            yield from iter_parquet(cfg, path, roles, log)
        elif fmt in ("csv", "tsv"):
            yield from iter_delimited(cfg, path, fmt, roles, log)
        elif fmt in ("jsonl", "libsvm", "slot"):
            yield from iter_line_format(cfg, path, fmt, roles, log)
        elif fmt != "synthetic":
            yield from iter_plugin(cfg, path, roles, log)
        else:
            raise DataError(f"{path}: format {fmt!r} cannot be read from a file")


def file_columns(cfg: DataConfig, path: Path) -> list[str]:
    """The columns of a CSV / TSV / Parquet file as ``cfg`` reads it (side tables, and the
    main file's check against them)."""
    fmt = detect_format(path, cfg.format)
    if fmt == "parquet":
        return pq.ParquetFile(path.open_file() if isinstance(path, StreamInput)
                              else path).schema_arrow.names
    if fmt in ("csv", "tsv"):
        return delimited_columns(cfg, path, fmt)
    raise DataError(f"{path}: side tables must be CSV, TSV or Parquet, not {fmt}")
