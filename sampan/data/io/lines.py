"""Line formats (JSON lines, libSVM, PaddleRec slots) and request records."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.config import DataConfig
from sampan.data.io.delimited import raw_blocks
from sampan.data.io.paths import StreamInput, first_line
from sampan.data.rejects import RejectLog
from sampan.data.roles import ColumnRoles
from sampan.data.validate import is_utf8, validate_table
from sampan.errors import DataError


# ------------------------------------------------------- line formats: jsonl, libsvm, slot
def iter_lines(path: Path, block_size: int
                ) -> Iterator[tuple[pa.Array, int, bytes | None]]:
    """Blocks of whole lines as a binary array, with the 1-based number of the first line,
    and ``None``; or an empty array, the line's number and the first bytes of a line
    longer than ``block_size`` (see :func:`raw_blocks`). Splitting runs in Arrow (no
    per-line Python)."""
    line_no = first_line(path)
    for block, n_lines, too_long in raw_blocks(path, block_size):
        if too_long is not None:
            yield pa.array([], pa.binary()), line_no, too_long
        else:
            yield _lines_of(block[:-1] if block.endswith(b"\n") else block), line_no, None
        line_no += n_lines


def _lines_of(block: bytes) -> pa.Array:
    lines = pc.list_flatten(pc.split_pattern(pa.array([block], pa.binary()), b"\n"))
    return pc.replace_substring_regex(lines, b"\r$", b"")  # CRLF files


def iter_line_format(cfg: DataConfig, path: Path, fmt: str, roles: ColumnRoles,
                      log: RejectLog) -> Iterator[pa.Table]:
    seen: set[str] = set()  # JSON keys met in this file
    yield from _line_format_blocks(cfg, path, fmt, roles, log, seen)
    # a file must have every column somewhere; a run of stream messages may lack optional
    # ones (its rows are validated one by one all the same)
    if fmt == "jsonl" and seen and not (isinstance(path, StreamInput) and path.data):
        _missing_columns(roles, sorted(seen), str(path))


def _line_format_blocks(cfg: DataConfig, path: Path, fmt: str, roles: ColumnRoles,
                        log: RejectLog, seen: set[str]) -> Iterator[pa.Table]:
    for raw, first, too_long in iter_lines(path, cfg.block_size):
        if too_long is not None:
            log.read += 1
            log.reject(str(path), first, "line_too_long", None,
                       f"the line is longer than data.block_size={cfg.block_size:,} bytes: "
                       + too_long.decode("utf-8", "backslashreplace"))
            continue
        lines = np.arange(first, first + len(raw))
        text, ok = _decode(raw)
        # blank (or whitespace-only) lines carry no record
        keep = pc.not_equal(pc.binary_length(pc.utf8_trim_whitespace(text)), 0).to_numpy(
            zero_copy_only=False) | ~ok
        log.blank += int((~keep).sum())
        for r in np.nonzero(~ok & keep)[0].tolist():  # error path: undecodable lines
            log.read += 1
            log.reject(str(path), int(lines[r]), "bad_encoding", None,
                       raw[r].as_py().decode("utf-8", "backslashreplace"))
        keep &= ok
        text, lines = pc.filter(text, pa.array(keep)), lines[keep]
        if fmt == "jsonl":
            table, lines, text = _parse_jsonl(text, lines, roles, str(path), log, seen)
        elif fmt == "libsvm":
            table = _parse_libsvm(text, cfg, roles)
        else:
            table = _parse_slots(text, cfg, roles)
        # a rejected row is written as its line was given
        out = validate_table(table, roles, lines, str(path), log, " ", raw=text)
        log.check_early()
        if out.num_rows:
            yield out


def _decode(raw: pa.Array) -> tuple[pa.Array, np.ndarray]:
    try:
        return raw.cast(pa.string()), np.ones(len(raw), dtype=bool)
    except pa.ArrowInvalid:
        ok = np.array([v is None or is_utf8(v) for v in raw.to_pylist()])
        fixed = pc.if_else(pa.array(ok), raw, pa.scalar(b"", pa.binary()))
        return fixed.cast(pa.string()), ok


def _missing_columns(roles: ColumnRoles, have: list[str], path: str) -> None:
    missing = [c for c in roles.all if c not in have]
    if missing:
        raise DataError(f"{path}: column(s) {missing} not found; the records have {have}")


def _parse_jsonl(text: pa.Array, lines: np.ndarray, roles: ColumnRoles, path: str,
                 log: RejectLog, seen: set[str]) -> tuple[pa.Table, np.ndarray, pa.Array]:
    """Arrow's JSON reader for regular blocks. A block it cannot take (a line that is not a
    JSON object, or a field whose type changes between lines) is parsed line by line instead:
    bad lines are rejected and values become strings, validated like CSV text. Returns the
    records, their line numbers and their lines' text."""
    import json as _json

    import pyarrow.json as pajson

    # only lines that open an object reach Arrow's reader (pyarrow 26 crashes the process
    # on a file of bare ``null`` lines); the others cannot be records
    obj = pc.starts_with(pc.utf8_ltrim_whitespace(text), "{").to_numpy(zero_copy_only=False)
    if not obj.all():
        for i in np.flatnonzero(~obj).tolist():  # error path only
            log.read += 1
            log.reject(path, int(lines[i]), "bad_json", None, text[i].as_py())
        text, lines = pc.filter(text, pa.array(obj)), lines[obj]
        if not len(text):
            return _with_columns(pa.table({}), roles), lines, text
    one = pa.LargeListArray.from_arrays(pa.array([0, len(text)], pa.int64()),
                                        text.cast(pa.large_string()))
    buf = pc.binary_join(one, pa.scalar("\n", pa.large_string()))[0].as_buffer()
    try:
        table = pajson.read_json(pa.BufferReader(buf))
        # pyarrow 26 builds invalid list arrays from lists holding nulls ([null, false]):
        # checked in full (about 2 % of the parse time), and such a block goes slow
        table.validate(full=True)
        if table.num_rows == len(lines):  # else some line held 0 or 2+ objects: go slow
            seen.update(table.column_names)
            return _with_columns(table, roles), lines, text
    except pa.ArrowInvalid:
        pass
    rows: list[dict] = []
    good = np.zeros(len(text), dtype=bool)
    for i, line in enumerate(text.to_pylist()):  # error path only
        try:
            rec = _json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            log.read += 1
            log.reject(path, int(lines[i]), "bad_json", None, line)
            continue
        if not _encodes(list(rec.values())) or not _encodes(list(rec)):
            log.read += 1  # a \ud800 escape: valid JSON, but no text a table can hold
            log.reject(path, int(lines[i]), "bad_unicode", None, line)
            continue
        good[i] = True
        rows.append(rec)

    seen.update(k for r in rows for k in r)
    return records_table(rows, roles), lines[good], pc.filter(text, pa.array(good))


def _json_text(v: Any) -> str:
    """A JSON value as text, spelt as Arrow's JSON reader + cast would spell it."""
    import json as _json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return _json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def _json_cell(v: Any, as_list: bool) -> Any:
    if v is None:
        return None
    if as_list:
        return [_json_text(x) for x in v] if isinstance(v, list) else [_json_text(v)]
    return _json_text(v)


class CellError(ValueError):
    """A value of record ``record`` for ``column`` that a table cannot hold; ``problem``
    says what is wrong with it ("is a JSON object; expected ...")."""

    def __init__(self, problem: str, column: str, record: int):
        super().__init__(f"record {record}: feature {column!r} {problem}")
        self.problem, self.column, self.record = problem, column, record


def records_table(records: list[dict[str, Any]], roles: ColumnRoles,
                  scalars: bool = False) -> pa.Table:
    """Records (JSON objects) -> a table of text columns that :func:`validate_table` types
    exactly as it types CSV text. Absent keys are nulls. A list feature given as delimited
    strings stays text (the pipeline splits it, as for CSV); given as JSON arrays (or mixed)
    it becomes a list column.

    Raises :class:`CellError` for a string that is not valid Unicode (a lone surrogate,
    which JSON's ``\\ud800`` escape can carry) and, with ``scalars`` (a request's values),
    for an array or object where a single value is expected (a categorical feature),
    instead of turning it into text that no vocabulary holds, and for a string given for a
    numeric feature (a JSON number is expected)."""
    cols = {}
    for c in roles.all:
        values = [r.get(c) for r in records]
        as_list = c in roles.lists and any(isinstance(v, list) for v in values)
        if scalars:
            for i, v in enumerate(values):
                if isinstance(v, str) and c in roles.numeric:
                    raise CellError(f"is a string ({_json_text(v)[:40]!r}); expected a "
                                    "number or null", c, i)
                if isinstance(v, dict) or (isinstance(v, list) and not as_list) or (
                        as_list and isinstance(v, list) and any(
                            isinstance(x, (dict, list)) for x in v)):
                    raise CellError(f"is a JSON "
                                    f"{'object' if isinstance(v, dict) else 'array'}; "
                                    f"expected a string, number or null"
                                    + (" (or an array of them)" if c in roles.lists else ""),
                                    c, i)
        try:
            cols[c] = pa.array([_json_cell(v, as_list) for v in values],
                               pa.list_(pa.string()) if as_list else pa.string())
        except UnicodeEncodeError:
            i = next(i for i, v in enumerate(values) if not _encodes(v))
            raise CellError("holds a string that is not valid Unicode (a lone surrogate "
                            "such as \\ud800)", c, i) from None
    return pa.table(cols)


def _encodes(v: Any) -> bool:
    """Whether ``v`` (a JSON value) encodes as UTF-8."""
    try:
        _json_text(v).encode("utf-8") if not isinstance(v, list) else [
            _json_text(x).encode("utf-8") for x in v]
    except UnicodeEncodeError:
        return False
    return True


def _with_columns(table: pa.Table, roles: ColumnRoles) -> pa.Table:
    """``table`` with every needed column, absent ones (an optional key no line of this
    block has) as nulls."""
    for c in roles.all:
        if c not in table.column_names:
            typ = pa.list_(pa.string()) if c in roles.lists else pa.string()
            table = table.append_column(c, pa.nulls(table.num_rows, typ))
    return table.select(roles.all)


def tokens(text: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Space-separated tokens of each line (empty tokens dropped) and their row indices."""
    lists = pc.split_pattern_regex(pc.utf8_trim_whitespace(text), r"\s+")
    flat = pc.list_flatten(lists)
    rows = pc.list_parent_indices(lists).to_numpy()
    keep = pc.not_equal(flat, "").to_numpy(zero_copy_only=False)
    return pc.filter(flat, pa.array(keep)), rows[keep]


def _nth_per_row(rows: np.ndarray, values: pa.Array, n: int, nrows: int) -> pa.Array:
    """The n-th (0-based) value of each row (null where a row has fewer)."""
    pos = np.arange(len(rows)) - np.searchsorted(rows, rows, side="left")
    sel = np.nonzero(pos == n)[0]
    idx = np.full(nrows, -1, dtype=np.int64)
    idx[rows[sel]] = sel
    return pc.take(values, pa.array(idx, mask=idx < 0))


def _list_per_row(rows: np.ndarray, values: pa.Array, nrows: int) -> pa.Array:
    counts = np.bincount(rows, minlength=nrows)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _second(parts: pa.Array, default: str) -> pa.Array:
    """Second element of each ``[key, value]`` split, ``default`` where there is none."""
    has = pc.greater(pc.list_value_length(parts), 1)
    padded = pc.if_else(has, parts, pa.scalar(["", default], pa.list_(pa.string())))
    return pc.list_element(padded, 1)


def _parse_libsvm(text: pa.Array, cfg: DataConfig, roles: ColumnRoles) -> pa.Table:
    """``label idx:val idx:val ...``. The label (``-1`` read as 0) is ``columns[0]``
    (default ``label``); ``features`` / ``values`` hold every idx / val of the row as lists;
    ``columns[1:]`` name the features by position (Frappe: user, item, daytime, ...)."""
    names = cfg.columns or ["label"]
    n = len(text)
    flat, rows = tokens(text)
    first = np.concatenate([[True], rows[1:] != rows[:-1]]) if len(rows) else np.array([], bool)
    label = pc.filter(flat, pa.array(first))  # the first token of each non-empty line
    label = pc.if_else(pc.starts_with(label, "-"), "0", pc.replace_substring(label, "+", ""))
    where = np.full(n, -1, dtype=np.int64)
    where[rows[first]] = np.arange(int(first.sum()))
    cols: dict[str, pa.Array] = {names[0]: pc.take(label, pa.array(where, mask=where < 0))}
    feat, frows = pc.filter(flat, pa.array(~first)), rows[~first]
    parts = pc.split_pattern(feat, ":", max_splits=1)
    idx = pc.list_element(parts, 0)
    val = _second(parts, default="1")  # "idx" alone means value 1
    cols["features"] = _list_per_row(frows, idx, n)
    cols["values"] = _list_per_row(frows, val, n)
    for k, name in enumerate(names[1:]):
        cols[name] = _nth_per_row(frows, idx, k, n)
    _missing_columns(roles, list(cols), "libsvm input")
    return pa.table({c: cols[c] for c in roles.all})


def _parse_slots(text: pa.Array, cfg: DataConfig, roles: ColumnRoles) -> pa.Table:
    """PaddleRec slot text: ``click:0 dense_feature:0.1 ... 1:737395 2:210498 ...``.

    A column named like a slot is that slot's (first) value, or all its values when the
    column is a list feature; a scalar column ``<slot>_<i>`` is the i-th value of a repeated
    slot (``dense_feature_1`` .. ``dense_feature_13``). Missing slots, and slots with an
    empty value (``3:``), are missing values.

    ``cfg.delimiter`` separates the tokens (default: whitespace); ``cfg.columns`` names
    values that come first on every line, by position, before the ``slot:value`` tokens
    (Ali-CCP's ``sample_id,click,conversion,...``)."""
    n = len(text)
    positional = cfg.columns or []
    if cfg.delimiter is None:
        lists = pc.split_pattern_regex(pc.utf8_trim_whitespace(text), r"\s+")
    else:
        lists = pc.split_pattern(text, cfg.delimiter)
    flat = pc.utf8_trim_whitespace(pc.list_flatten(lists))
    rows = pc.list_parent_indices(lists).to_numpy()
    pos = np.arange(len(rows)) - np.searchsorted(rows, rows, side="left")
    cols: dict[str, pa.Array] = {}
    for k, c in enumerate(positional):
        if c in roles.all:
            at = pos == k
            val = pc.filter(flat, pa.array(at))
            cols[c] = _nth_per_row(rows[at], pc.if_else(pc.equal(val, ""), None, val), 0, n)
    tail = pos >= len(positional)
    parts = pc.split_pattern(pc.filter(flat, pa.array(tail)), ":", max_splits=1)
    slot = pc.list_element(parts, 0)
    value = _second(parts, default="")
    keep = pc.not_equal(value, "").to_numpy(zero_copy_only=False)  # "3:" and bare tokens
    slot, value, rows = pc.filter(slot, pa.array(keep)), pc.filter(value, pa.array(keep)), \
        rows[tail][keep]
    present = set(pc.unique(slot).to_pylist())
    for c in roles.all:
        if c in cols:
            continue
        name, k = c, 0
        if c not in present:
            head, _, tail_ = c.rpartition("_")
            # a list column is its own slot: ESMM's field "127_14" is not value 14 of "127"
            if c not in roles.lists and head in present and tail_.isdigit() \
                    and int(tail_) >= 1:
                name, k = head, int(tail_) - 1
            else:  # a slot no line of the block has
                cols[c] = _list_per_row(np.array([], np.int64), pa.array([], pa.string()), n) \
                    if c in roles.lists else pa.nulls(n, pa.string())
                continue
        mask = pc.equal(slot, name).to_numpy(zero_copy_only=False)
        srows, svals = rows[mask], pc.filter(value, pa.array(mask))
        cols[c] = _list_per_row(srows, svals, n) if c in roles.lists and c == name \
            else _nth_per_row(srows, svals, k, n)
    return pa.table(cols)
