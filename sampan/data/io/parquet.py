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
    start = 1
    for batch in pf.iter_batches(batch_size=65536, columns=roles.all):
        table = pa.Table.from_batches([batch])
        lines = np.arange(start, start + table.num_rows)
        start += table.num_rows
        out = validate_table(table, roles, lines, str(path), log, ",")
        log.check_early()
        if out.num_rows:
            yield out
