"""The feedback log: one row per served item, labelled when its join window closed.

Files: ``ROOT/YYYYMMDD/HH/part-*.parquet`` (a ``_SUCCESS`` file marks a closed hour), read
here in file order. Columns (beside the model's own features, as the model saw them):

==============  ==========================================================================
request_id      the response's id (every item of one response shares it)
position        the item's 0-based place in the response
item            the item's key (empty for ``/v1/predict`` records)
unit            the unit of assignment (by default the request's ``user_id``); null when the
                request had none, and then the request is its own unit
variant         the arm that served it
model_version   the arm's model version then
forced          true when the request forced its arm (QA): left out of the analysis
served_at       unix seconds
score           the served model's click probability
propensity      the probability that the logging policy puts this item first (exploration
                on); null without exploration
label           1 when a click arrived inside the join window, else 0
==============  ==========================================================================
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sampan.errors import DataError, MissingPathError

REQUIRED = ("request_id", "position", "unit", "variant", "forced", "served_at", "score",
            "label")


def read_log(path: str | Path, columns: list[str] | None = None,
             unshown: bool = False) -> pa.Table:
    """Every Parquet file under ``path`` (a folder, read recursively, or one file) as one
    table; the required columns are checked. Folders whose name starts with ``_`` or ``.``
    are skipped (as ``sampan stream`` does), except, with ``unshown``, ``_unshown``: the
    candidates scored but not shown when exploration was on (position -1)."""
    p = Path(path)
    if not p.exists():
        raise MissingPathError(f"feedback log {p} does not exist")

    def wanted(f: Path) -> bool:
        parts = f.relative_to(p).parts
        return not f.name.startswith(".") and all(
            not x.startswith((".", "_")) or (unshown and x == "_unshown") for x in parts[:-1])

    files = [p] if p.is_file() else sorted(f for f in p.rglob("*.parquet") if wanted(f))
    if not files:
        pending = p.is_dir() and (p / "_journal").exists()
        raise DataError(f"feedback log {p}: no .parquet files under it" + (
            " yet: a served request becomes a row when its feedback window closes "
            "(feedback.window_seconds after it was served, 300 s by default), and the "
            "joiner writes it at its next pass" if pending else ""))
    tables = [pq.read_table(f, columns=columns) for f in files]
    table = pa.concat_tables(tables, promote_options="default")
    missing = [c for c in REQUIRED if c not in table.column_names
               and (columns is None or c in columns)]
    if missing:
        raise DataError(f"feedback log {p}: column(s) {missing} missing; a feedback log has "
                        f"{list(REQUIRED)} (see sampan.experiment.log)")
    return table


# the log's own columns; every other column is a feature as the model saw it
LOG_COLUMNS = (*REQUIRED, "item", "model_version", "propensity")


def feature_columns(table: pa.Table) -> list[str]:
    """The columns that are the model's inputs (what a bundle scores)."""
    return [c for c in table.column_names if c not in LOG_COLUMNS]


def column(table: pa.Table, name: str, dtype: type | None = None) -> np.ndarray:
    """A column as NumPy (nulls as None in object columns)."""
    a = table.column(name).to_numpy(zero_copy_only=False)
    return a.astype(dtype) if dtype is not None else a


def write_log(table: pa.Table, root: str | Path, hour: str = "19700101/00",
              name: str = "part-0.parquet") -> Path:
    """Write ``table`` as one part of the log under ``root`` (tests and simulations; the
    server's joiner writes its own parts) and mark the hour complete."""
    d = Path(root) / hour
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, d / name)
    (d / "_SUCCESS").touch()
    return d / name
