"""Raw files -> a stream of typed pyarrow Tables, with bad rows counted and quarantined.

Every source yields tables holding only the columns the experiment needs, typed by role:
``float64`` for labels and numeric features, ``string`` for categorical ones. A row that
cannot be read (wrong field count, unparsable number, bad encoding, missing label) is
written to the rejects file with its file name, line number and reason; the
:class:`RejectLog` keeps the counts so that ``rows read = rows kept + rows rejected`` and,
for line formats, ``lines = header + rows read + blank lines``: every line is accounted for.

Records are one per line. Line numbers are physical, 1-based lines of the (decompressed)
file, header included. A quoted CSV field cannot span lines: a line that leaves a quote
open is rejected on its own (``unbalanced_quote``), and the lines after it are read as
usual. A line longer than ``data.block_size`` is rejected as one ``line_too_long`` row
without being held in memory. Parquet rows are numbered from 1.

The parts: :mod:`sampan.data.io` (one reader per format: ``paths``, ``delimited``, ``lines``,
``parquet``), :mod:`~sampan.data.rejects`, :mod:`~sampan.data.validate`,
:mod:`~sampan.data.roles` and :mod:`~sampan.data.joins` (side tables, which serving's feature
store uses too). This module joins them into :func:`read_source` and re-exports the public
names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from sampan.config import DataConfig
from sampan.data.io import file_columns, iter_source
from sampan.data.io.lines import CellError, records_table
from sampan.data.io.paths import StreamInput, detect_format, expand_paths, open_input
from sampan.data.joins import SideTable
from sampan.data.rejects import RejectLog
from sampan.data.roles import LINE_COLUMN, ColumnRoles
from sampan.data.validate import col_is_null, validate_table
from sampan.errors import DataError

# the public API of reading raw data, importable from here
__all__ = ["LINE_COLUMN", "CellError", "ColumnRoles", "DataError", "RejectLog", "SideTable",
           "StreamInput", "col_is_null", "detect_format", "expand_paths", "file_columns",
           "iter_source", "open_input", "read_inputs", "read_source", "records_table",
           "validate_table"]


def read_source(cfg: DataConfig, spec: str | list[str], roles: ColumnRoles,
                log: RejectLog) -> Iterator[pa.Table]:
    """:func:`iter_source` over the files of ``spec``, with ``data.joins`` side tables
    joined to every chunk (row order kept)."""
    yield from read_inputs(cfg, expand_paths(spec), roles, log)


def read_inputs(cfg: DataConfig, paths: list[Any], roles: ColumnRoles, log: RejectLog,
                sides: list[SideTable] | None = None) -> Iterator[pa.Table]:
    """:func:`read_source` over given inputs: files, or a stream's
    :class:`~sampan.data.io.paths.StreamInput` s. ``sides``: the side tables, read once by
    a caller that reads many inputs (default: read here)."""
    if sides is None:
        sides = [SideTable(j, roles) for j in cfg.joins]
    provided = {c for side in sides for c in side.columns}
    if sides:
        main_cols = set(file_columns(cfg, paths[0])) if paths and detect_format(
            paths[0], cfg.format) in ("csv", "tsv", "parquet") else set()
        clash = sorted(provided & main_cols)
        if clash:
            raise DataError(f"data.joins: column(s) {clash} are both in the main data and in a "
                            "side table; rename or drop one of them (data that already holds "
                            "the joined columns, such as a feedback log, needs no join: "
                            "--set 'data.joins=[]')")
        if set(roles.labels) & provided:
            raise DataError("data.joins: labels must come from the main data, not a side "
                            "table")
    keys = [side.join.by for side in sides if side.join.by not in provided]
    main = ColumnRoles(
        numeric=[c for c in roles.numeric if c not in provided],
        categorical=[c for c in roles.categorical if c not in provided]
        + [k for k in keys if k not in roles.all],
        required=[c for c in roles.required if c not in provided],
        labels=[c for c in roles.labels if c not in provided],
        lists=[c for c in roles.lists if c not in provided])
    for table in iter_source(cfg, paths, main, log):
        for side in sides:
            table = side.attach(table)
        yield table.select([*roles.all, LINE_COLUMN])


