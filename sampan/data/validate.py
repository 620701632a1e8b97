"""Row validation: types, labels, required columns, encodings; bad rows go to the rejects log."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.data.rejects import RejectLog
from sampan.data.roles import LINE_COLUMN, NUMBER_RE, ColumnRoles
from sampan.errors import DataError


# ------------------------------------------------------------------------------ validation
def validate_table(table: pa.Table, roles: ColumnRoles, lines: np.ndarray, file: str,
              log: RejectLog, delimiter: str, raw: pa.Array | None = None) -> pa.Table:
    """Cast raw string/binary columns to their role types; reject the rows that fail. A
    rejected row's text is its ``raw`` text where given (a JSON line), else its columns
    joined by ``delimiter``."""
    n = table.num_rows
    log.read += n
    bad = np.zeros(n, dtype=bool)
    reasons: dict[int, tuple[str, str]] = {}

    def mark(rows: np.ndarray, reason: str, column: str) -> None:
        for r in rows[~bad[rows]].tolist():  # error path only: one entry per rejected row
            reasons[r] = (reason, column)
        bad[rows] = True

    strings: dict[str, pa.Array] = {}
    typed: dict[str, pa.Array] = {}  # numeric columns that arrive typed (Parquet)
    for c in roles.all:
        col = table.column(c).combine_chunks()
        if c in roles.numeric and pa.types.is_temporal(col.type):
            # timestamps / dates (Parquet) as seconds since the epoch
            col = (col.cast(pa.timestamp("s")) if not pa.types.is_timestamp(col.type)
                   else col.cast(pa.timestamp("s"), safe=False)).cast(pa.int64())
        if c in roles.numeric and (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
                                   or pa.types.is_boolean(col.type)):
            x = col.cast(pa.float64(), safe=False)  # integers past 2**53 round, as in text
            typed[c] = pc.if_else(pc.is_nan(x), pa.scalar(None, pa.float64()), x)  # NaN: missing
            strings[c] = x.cast(pa.string())  # for the text of rejected rows only
            inf = pc.fill_null(pc.is_inf(typed[c]), False).to_numpy(zero_copy_only=False)
            if inf.any():
                mark(np.nonzero(inf)[0], "unparsable_number", c)
            continue
        if c in roles.lists and (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            strings[c] = col.cast(pa.list_(pa.string()))  # already a list (JSON, Parquet)
            continue
        if pa.types.is_floating(col.type):  # a NaN category is a missing value
            col = pc.if_else(pc.is_nan(col), pa.scalar(None, col.type), col)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
                or pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)):
            try:
                col = col.cast(pa.string())
            except pa.ArrowNotImplementedError:
                raise DataError(f"{file}: column {c!r} holds {col.type} values; a categorical "
                                "column must hold single values (use a list feature for "
                                "lists)") from None
        if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
            try:
                col = col.cast(pa.string())
            except pa.ArrowInvalid:
                # Error path: only chunks holding invalid bytes get here. The rejects file
                # keeps the bytes, escaped, so the bad value can be found in the source.
                values = col.to_pylist()
                bad_rows = [i for i, v in enumerate(values) if v is not None and not is_utf8(v)]
                mark(np.array(bad_rows, dtype=np.int64), "bad_encoding", c)
                col = pa.array([None if v is None else v.decode("utf-8", "backslashreplace")
                                for v in values], pa.string())
        strings[c] = col

    for c in roles.numeric:
        if c in typed:
            continue
        try:  # fast path: the whole column casts
            vals = strings[c].cast(pa.float64())
        except pa.ArrowInvalid:  # find the bad cells (and accept " 1" after ", ")
            col = pc.utf8_trim_whitespace(strings[c])
            # an empty cell (a reader's "price=") is a missing value, as an empty CSV field
            col = strings[c] = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
            ok = pc.fill_null(pc.match_substring_regex(col, NUMBER_RE), True).to_numpy(
                zero_copy_only=False)
            if not ok.all():
                mark(np.nonzero(~ok)[0], "unparsable_number", c)
            vals = pc.if_else(pa.array(ok), col, pa.scalar(None, pa.string())).cast(pa.float64())
        # 1e400, "inf" and "nan" cast but are not usable numbers
        nan = pc.fill_null(pc.is_nan(vals), False).to_numpy(zero_copy_only=False)
        if nan.any():
            mark(np.nonzero(nan)[0], "unparsable_number", c)
        typed[c] = vals
        inf = pc.fill_null(pc.is_inf(vals), False).to_numpy(zero_copy_only=False)
        if inf.any():
            mark(np.nonzero(inf)[0], "unparsable_number", c)
    for c in roles.required:
        nulls = col_is_null(typed.get(c, strings[c]))
        if nulls.any():
            mark(np.nonzero(nulls)[0], "missing_value", c)
    for c in roles.labels:
        y = typed[c]
        out = pc.fill_null(pc.or_(pc.less(y, 0.0), pc.greater(y, 1.0)), False)
        out = out.to_numpy(zero_copy_only=False)
        if out.any():
            mark(np.nonzero(out)[0], "label_out_of_range", c)

    if bad.any():
        for r in sorted(reasons):
            reason, column = reasons[r]
            if raw is not None:
                text = raw[r].as_py()
            else:
                cells = [strings[c][r].as_py() for c in roles.all]
                text = delimiter.join("" if v is None else str(v) for v in cells)
            log.reject(file, int(lines[r]), reason, column, text,
                       value=strings[column][r].as_py() if column in strings else None)
        keep = pa.array(~bad)
        strings = {c: pc.filter(a, keep) for c, a in strings.items()}
        typed = {c: pc.filter(a, keep) for c, a in typed.items()}
        lines = lines[~bad]
    cols = {c: typed[c] if c in typed else strings[c] for c in roles.all}
    cols[LINE_COLUMN] = pa.array(np.asarray(lines, dtype=np.int64))
    out = pa.table(cols)
    log.kept += out.num_rows
    return out


def col_is_null(col: pa.Array) -> np.ndarray:
    return pc.is_null(col).to_numpy(zero_copy_only=False)


def is_utf8(v: bytes) -> bool:
    try:
        v.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
