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
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from sampan.config import DataConfig
from sampan.data.threads import prefetch
from sampan.errors import DataError

LINE_COLUMN = "_line"  # source line number of each kept row, carried next to the data
_NUMBER_RE = r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$"


@dataclass
class ColumnRoles:
    """Which raw columns are read, and as what type."""

    numeric: list[str] = field(default_factory=list)  # labels and numeric features: float64
    categorical: list[str] = field(default_factory=list)  # string
    required: list[str] = field(default_factory=list)  # rows missing these are rejected
    labels: list[str] = field(default_factory=list)  # must lie in [0, 1]
    lists: list[str] = field(default_factory=list)  # delimited strings or list columns

    @property
    def all(self) -> list[str]:
        seen: dict[str, None] = {}
        for c in self.numeric + self.categorical + self.lists:
            seen.setdefault(c, None)
        return list(seen)


class RejectLog:
    """Counts rows read / kept / rejected by reason and writes rejected rows as JSON lines."""

    def __init__(self, path: Path | None):
        self.path = path
        self.read = 0
        self.kept = 0
        self.blank = 0  # blank lines: no record, not counted in read
        self.reasons: Counter[str] = Counter()
        self.examples: list[dict[str, Any]] = []  # the first few rejects, also without a file
        self._fh: IO[str] | None = None

    @property
    def rejected(self) -> int:
        return sum(self.reasons.values())

    def reject(self, file: str, line: int | None, reason: str, column: str | None,
               text: str) -> None:
        self.reasons[reason] += 1
        rec = {"file": file, "line": line, "reason": reason, "column": column, "text": text}
        if len(self.examples) < 10:
            self.examples.append(rec)
        if self.path is None:
            return
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def check(self, max_bad_fraction: float) -> None:
        """Fail when the share of rejected rows is above ``max_bad_fraction``."""
        if self.read and self.rejected / self.read > max_bad_fraction:
            where = f"; see {self.path}" if self.path else ""
            first = ""
            if self.examples:
                e = self.examples[0]
                col = f", column {e['column']!r}" if e["column"] else ""
                first = (f". First: {e['file']} line {e['line']}{col}: "
                         f"{e['reason'].replace('_', ' ')} in {e['text'][:120]!r}")
            raise DataError(
                f"{self.rejected} of {self.read} rows ({self.rejected / self.read:.2%}) were "
                f"rejected, above data.max_bad_fraction={max_bad_fraction:g}. Reasons: "
                f"{dict(self.reasons)}{first}{where}"
            )

    def check_early(self) -> None:
        """Stop at once when the input is clearly misread (nothing kept of 1,000+ rows)
        instead of quarantining a whole file."""
        if self.read >= 1000 and self.kept == 0:
            raise DataError(
                f"the first {self.read:,} rows were all rejected {dict(self.reasons)}: check "
                f"data.format, data.delimiter, data.header and data.columns"
                + (f"; see {self.path}" if self.path else ""))

    def describe(self) -> str:
        """``read N rows, kept K, rejected R {reasons} -> rejects file[, B blank lines]``."""
        return (f"read {self.read:,} rows, kept {self.kept:,}, rejected {self.rejected:,}"
                + (f" {dict(self.reasons)} -> {self.path}" if self.rejected else "")
                + (f"; {self.blank:,} blank lines skipped" if self.blank else ""))

    def summary(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "rejected": self.rejected,
                "reasons": dict(self.reasons), "blank_lines": self.blank}


def expand_paths(spec: str | list[str]) -> list[Path]:
    """Files named by a path, a glob, a directory, or a list of those; sorted, must exist."""
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[Path] = []
    for item in items:
        p = Path(os.path.expanduser(item))
        if p.is_dir():
            # skip hidden files and markers such as Spark's _SUCCESS
            out.extend(sorted(q for q in p.iterdir()
                              if q.is_file() and not q.name.startswith((".", "_"))))
        elif any(ch in item for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(item)))
            if not matches:
                raise DataError(f"no file matches {item!r}")
            out.extend(matches)
        elif p.exists():
            out.append(p)
        else:
            raise DataError(f"data file {item!r} does not exist")
    return out


_COMPRESSION = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2",
                ".lz4": "lz4"}


def open_input(path: Path) -> Any:
    """A binary input stream of ``path``, decompressed by its extension."""
    return pa.input_stream(str(path), compression=_COMPRESSION.get(Path(path).suffix.lower()))


def detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    for ext in (".gz", ".zst", ".zstd", ".bz2"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    if name.endswith(".parquet") or name.endswith(".pq"):
        return "parquet"
    if name.endswith(".tsv") or name.endswith(".txt") or name.endswith(".data"):
        return "tsv"
    if name.endswith(".jsonl") or name.endswith(".ndjson") or name.endswith(".json"):
        return "jsonl"
    if name.endswith(".libsvm") or name.endswith(".libfm") or name.endswith(".svm"):
        return "libsvm"
    return "csv"


def iter_source(cfg: DataConfig, paths: list[Path], roles: ColumnRoles,
                log: RejectLog) -> Iterator[pa.Table]:
    """Typed, validated tables from ``paths`` (read in chunks; memory stays bounded)."""
    for path in paths:
        fmt = detect_format(path, cfg.format)
        if fmt == "parquet":
            yield from _iter_parquet(cfg, path, roles, log)
        elif fmt in ("csv", "tsv"):
            yield from _iter_text(cfg, path, fmt, roles, log)
        elif fmt in ("jsonl", "libsvm", "slot"):
            yield from _iter_line_format(cfg, path, fmt, roles, log)
        else:
            raise DataError(f"{path}: format {fmt!r} cannot be read from a file")


def read_source(cfg: DataConfig, spec: str | list[str], roles: ColumnRoles,
                log: RejectLog) -> Iterator[pa.Table]:
    """:func:`iter_source` over the files of ``spec``, with ``data.joins`` side tables
    joined to every chunk (row order kept)."""
    sides = [SideTable(j, roles) for j in cfg.joins]
    provided = {c for side in sides for c in side.columns}
    if sides:
        paths = expand_paths(spec)
        main_cols = set(_file_columns(cfg, paths[0])) if paths and detect_format(
            paths[0], cfg.format) in ("csv", "tsv", "parquet") else set()
        clash = sorted(provided & main_cols)
        if clash:
            raise DataError(f"data.joins: column(s) {clash} are both in the main data and in a "
                            "side table; rename or drop one of them")
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
    for table in iter_source(cfg, expand_paths(spec), main, log):
        for side in sides:
            table = side.attach(table)
        yield table.select([*roles.all, LINE_COLUMN])


class SideTable:
    """One ``data.joins`` entry, read whole and indexed by its key."""

    def __init__(self, join: Any, roles: ColumnRoles):
        self.join = join
        key = join.key or join.by
        path = expand_paths(join.path)
        cfg = DataConfig(train=join.path, format=join.format, delimiter=join.delimiter,
                         header=join.header, columns=join.columns, encoding=join.encoding)
        names = _file_columns(cfg, path[0])
        if key not in names:
            raise DataError(f"data.joins: key {key!r} is not a column of {join.path} ({names})")
        self.columns = [c for c in roles.all if c in names and c != key]
        side_roles = ColumnRoles(categorical=[key, *self.columns])
        log = RejectLog(None)
        parts = list(iter_source(cfg, path, side_roles, log))
        if log.rejected:
            raise DataError(f"data.joins: {join.path} has {log.rejected} unreadable rows "
                            f"{dict(log.reasons)}")
        table = pa.concat_tables(parts) if parts else pa.table(
            {c: pa.array([], pa.string()) for c in side_roles.all})
        keys = _key_text(table.column(key).combine_chunks())
        if len(pc.unique(keys)) != len(keys):
            counts = pc.value_counts(keys)
            dup = pc.filter(counts, pc.greater(counts.field("counts"), 1))[0]["values"]
            raise DataError(f"data.joins: key {key!r} of {join.path} is not unique "
                            f"(e.g. {dup.as_py()!r})")
        from sampan.data.transforms import ValueIndex

        self.keys = _key_text(keys)
        self.index = ValueIndex(self.keys)
        # Numbers of a side table are checked like those of the main file, but a bad one
        # becomes missing (the row it belongs to is not the main file's to reject).
        self.values = {}
        for c in self.columns:
            col = pc.utf8_trim_whitespace(table.column(c).combine_chunks())
            if c in roles.numeric:
                ok = pc.fill_null(pc.match_substring_regex(col, _NUMBER_RE), False)
                col = pc.if_else(ok, col, pa.scalar(None, pa.string())).cast(pa.float64())
            self.values[c] = col

    def attach(self, table: pa.Table) -> pa.Table:
        # a missing key matches nothing (not a side row with an empty key)
        idx = self.index.take_indices(_key_text(table.column(self.join.by).combine_chunks()))
        for c in self.columns:
            table = table.append_column(c, pc.take(self.values[c], idx))
        return table


def _key_text(keys: pa.Array) -> pa.Array:
    """Join keys compared as text: trimmed, and 1.0 written as 1 (numbers read as floats)."""
    if pa.types.is_floating(keys.type) or pa.types.is_integer(keys.type):
        from sampan.data.transforms import _as_string

        return _as_string(keys)
    text = pc.utf8_trim_whitespace(keys.cast(pa.string()))
    as_num = pc.match_substring_regex(text, r"^-?\d+\.0+$")
    return pc.if_else(pc.fill_null(as_num, False), pc.replace_substring_regex(
        text, r"\.0+$", ""), text)


def _file_columns(cfg: DataConfig, path: Path) -> list[str]:
    fmt = detect_format(path, cfg.format)
    if fmt == "parquet":
        return pq.ParquetFile(path).schema_arrow.names
    if fmt in ("csv", "tsv"):
        if cfg.header:
            names = _read_header(path, cfg.delimiter or ("\t" if fmt == "tsv" else ","),
                                 cfg.encoding)
            return list(cfg.columns) if cfg.columns else names
        if not cfg.columns:
            raise DataError(f"{path}: header is false, so columns must name the columns")
        return list(cfg.columns)
    raise DataError(f"{path}: side tables must be CSV, TSV or Parquet, not {fmt}")


# ------------------------------------------------------- line formats: jsonl, libsvm, slot
def _iter_lines(path: Path, block_size: int
                ) -> Iterator[tuple[pa.Array, int, bytes | None]]:
    """Blocks of whole lines as a binary array, with the 1-based number of the first line,
    and ``None``; or an empty array, the line's number and the first bytes of a line
    longer than ``block_size`` (see :func:`_raw_blocks`). Splitting runs in Arrow (no
    per-line Python)."""
    line_no = 1
    for block, n_lines, too_long in _raw_blocks(path, block_size):
        if too_long is not None:
            yield pa.array([], pa.binary()), line_no, too_long
        else:
            yield _lines_of(block[:-1] if block.endswith(b"\n") else block), line_no, None
        line_no += n_lines


def _lines_of(block: bytes) -> pa.Array:
    lines = pc.list_flatten(pc.split_pattern(pa.array([block], pa.binary()), b"\n"))
    return pc.replace_substring_regex(lines, b"\r$", b"")  # CRLF files


def _iter_line_format(cfg: DataConfig, path: Path, fmt: str, roles: ColumnRoles,
                      log: RejectLog) -> Iterator[pa.Table]:
    seen: set[str] = set()  # JSON keys met in this file
    yield from _line_format_blocks(cfg, path, fmt, roles, log, seen)
    if fmt == "jsonl" and seen:
        _missing_columns(roles, sorted(seen), str(path))


def _line_format_blocks(cfg: DataConfig, path: Path, fmt: str, roles: ColumnRoles,
                        log: RejectLog, seen: set[str]) -> Iterator[pa.Table]:
    for raw, first, too_long in _iter_lines(path, cfg.block_size):
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
            table, lines = _parse_jsonl(text, lines, roles, str(path), log, seen)
        elif fmt == "libsvm":
            table = _parse_libsvm(text, cfg, roles)
        else:
            table = _parse_slots(text, roles)
        out = validate_table(table, roles, lines, str(path), log, " ")
        log.check_early()
        if out.num_rows:
            yield out


def _decode(raw: pa.Array) -> tuple[pa.Array, np.ndarray]:
    try:
        return raw.cast(pa.string()), np.ones(len(raw), dtype=bool)
    except pa.ArrowInvalid:
        ok = np.array([v is None or _is_utf8(v) for v in raw.to_pylist()])
        fixed = pc.if_else(pa.array(ok), raw, pa.scalar(b"", pa.binary()))
        return fixed.cast(pa.string()), ok


def _missing_columns(roles: ColumnRoles, have: list[str], path: str) -> None:
    missing = [c for c in roles.all if c not in have]
    if missing:
        raise DataError(f"{path}: column(s) {missing} not found; the records have {have}")


def _parse_jsonl(text: pa.Array, lines: np.ndarray, roles: ColumnRoles, path: str,
                 log: RejectLog, seen: set[str]) -> tuple[pa.Table, np.ndarray]:
    """Arrow's JSON reader for regular blocks. A block it cannot take (a line that is not a
    JSON object, or a field whose type changes between lines) is parsed line by line instead:
    bad lines are rejected and values become strings, validated like CSV text."""
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
            return _with_columns(pa.table({}), roles), lines
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
            return _with_columns(table, roles), lines
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
    return records_table(rows, roles), lines[good]


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
    which JSON's ``\\ud800`` escape can carry) and, with ``scalars``, for an array or object
    where a single value is expected (a request's categorical feature), instead of turning
    it into text that no vocabulary holds."""
    cols = {}
    for c in roles.all:
        values = [r.get(c) for r in records]
        as_list = c in roles.lists and any(isinstance(v, list) for v in values)
        if scalars:
            for i, v in enumerate(values):
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


def _tokens(text: pa.Array) -> tuple[pa.Array, np.ndarray]:
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
    flat, rows = _tokens(text)
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


def _parse_slots(text: pa.Array, roles: ColumnRoles) -> pa.Table:
    """PaddleRec slot text: ``click:0 dense_feature:0.1 ... 1:737395 2:210498 ...``.

    A column named like a slot is that slot's (first) value, or all its values when the
    column is a list feature; ``<slot>_<i>`` is the i-th value of a repeated slot
    (``dense_feature_1`` .. ``dense_feature_13``). Missing slots are missing values."""
    n = len(text)
    flat, rows = _tokens(text)
    parts = pc.split_pattern(flat, ":", max_splits=1)
    slot = pc.list_element(parts, 0)
    value = _second(parts, default="")
    present = set(pc.unique(slot).to_pylist())
    cols: dict[str, pa.Array] = {}
    for c in roles.all:
        name, k = c, 0
        if c not in present:
            head, _, tail = c.rpartition("_")
            if head in present and tail.isdigit() and int(tail) >= 1:
                name, k = head, int(tail) - 1
            else:
                cols[c] = pa.nulls(n, pa.string())
                continue
        mask = pc.equal(slot, name).to_numpy(zero_copy_only=False)
        srows, svals = rows[mask], pc.filter(value, pa.array(mask))
        cols[c] = _list_per_row(srows, svals, n) if c in roles.lists and c == name \
            else _nth_per_row(srows, svals, k, n)
    return pa.table(cols)


# ------------------------------------------------------------------------------ text files
def _iter_text(cfg: DataConfig, path: Path, fmt: str, roles: ColumnRoles,
               log: RejectLog) -> Iterator[pa.Table]:
    """CSV / TSV in newline-aligned blocks, each parsed on its own (by all cores) while the
    previous one is validated. Independent blocks keep memory flat however large the file
    (Arrow's streaming CSV reader grows with the input); records must be one per line."""
    delimiter = cfg.delimiter or ("\t" if fmt == "tsv" else ",")
    if cfg.header:
        names = _read_header(path, delimiter, cfg.encoding)
        if cfg.columns is not None:
            if len(cfg.columns) != len(names):
                raise DataError(f"{path}: data.columns names {len(cfg.columns)} columns but the "
                                f"header has {len(names)}: {names}")
            names = list(cfg.columns)
    else:
        if not cfg.columns:
            raise DataError(f"{path}: data.header is false, so data.columns must list the "
                            "column names in file order")
        names = list(cfg.columns)
    missing = [c for c in roles.all if c not in names]
    if missing:
        raise DataError(f"{path}: column(s) {missing} not found; the file has {names}")
    encoding = "utf8" if cfg.encoding.lower().replace("-", "") == "utf8" else cfg.encoding
    conv_opts = pacsv.ConvertOptions(
        include_columns=roles.all, column_types={c: pa.binary() for c in roles.all},
        null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=True,
    )

    misread: list[tuple[int, str, str]] = []  # the rows seen when a file is clearly misread

    def parse(block: bytes, threads: bool, bad: list[tuple[int, str, str]],
              arrow_block: int = 1 << 20) -> pa.Table:
        def on_invalid(row: Any) -> str:
            bad.append((row.number, row.text,
                        f"expected {row.expected_columns} fields, got {row.actual_columns}"))
            # a file that is clearly misread stops here instead of filling the rejects file
            if len(bad) >= 1000 and log.kept == 0:
                misread[:] = bad
                return "error"
            return "skip"

        try:
            return pacsv.read_csv(
                pa.BufferReader(block),
                read_options=pacsv.ReadOptions(column_names=names, use_threads=threads,
                                               encoding=encoding, block_size=arrow_block),
                parse_options=pacsv.ParseOptions(
                    delimiter=delimiter, quote_char=False if fmt == "tsv" else '"',
                    ignore_empty_lines=True, invalid_row_handler=on_invalid),
                convert_options=conv_opts)
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e) or arrow_block > len(block):
                raise
            # a line longer than Arrow's parallel chunk: the whole block as one chunk
            bad.clear()
            return parse(block, threads, bad, len(block) + 1)

    def parse_lines(block: bytes, first: int, n_lines: int
                    ) -> tuple[list[pa.Table], list[np.ndarray], list[Bad], int]:
        """``block`` (whole lines; its first is physical line ``first``) -> tables, the
        physical line of each of their rows, the rejected lines and the blank-line count.
        Every line is accounted for: rows + rejected + blank = lines."""
        bad: list[tuple[int, str, str]] = []
        table = parse(block, True, bad)
        if bad:  # row numbers need the serial parser: re-parse this block
            bad.clear()
            table = parse(block, False, bad)
        nonblank = None
        # a quote left open on the last line takes its newline into the value (elsewhere
        # it takes lines, and the counts differ)
        open_end = table.num_rows > 0 and _newline_in_row(table, table.num_rows - 1)
        if table.num_rows + len(bad) != n_lines or open_end:  # blank lines, or quotes
            nonblank = first + np.flatnonzero(~_blank_lines(block, n_lines))
            swallowed = open_end or table.num_rows + len(bad) != len(nonblank) or any(
                b[0] is None or "\n" in b[1] for b in bad)
            if swallowed and n_lines > 1:  # halve until each part reads line by line
                cut = _line_offset(block, n_lines // 2)
                a = parse_lines(block[:cut], first, n_lines // 2)
                z = parse_lines(block[cut:], first + n_lines // 2, n_lines - n_lines // 2)
                return a[0] + z[0], a[1] + z[1], a[2] + z[2], a[3] + z[3]
        if nonblank is None:  # every line is a record: Arrow's numbers are lines
            rejected = [(first + b[0] - 1, b[1], b[2], _bad_reason(b[1])) for b in bad]
            s = np.asarray([b[0] for b in bad], dtype=np.int64) - 1
            lines = np.delete(np.arange(first, first + n_lines), s)
            return [table], [lines], rejected, 0
        # Arrow numbers the non-blank lines; a line it still could not split (an unclosed
        # quote at the end of a one-line part) is rejected whole
        if table.num_rows + len(bad) != len(nonblank) or open_end:
            text = block.decode("utf-8", "backslashreplace").rstrip("\r\n")
            if "\r" in text and not open_end:  # Arrow ends a record at a lone \r too
                return [], [], [(first, text, "a carriage return inside the line",
                                 "bad_line_break")], 0
            return [], [], [(first, text, "a quoted field is not closed on its line",
                             "unbalanced_quote")], 0
        rejected = [(int(nonblank[b[0] - 1]), b[1], b[2], _bad_reason(b[1])) for b in bad]
        lines = np.delete(nonblank, np.asarray([b[0] - 1 for b in bad], dtype=np.int64))
        return [table], [lines], rejected, n_lines - len(nonblank)

    def blocks() -> Iterator[tuple[list[pa.Table], list[np.ndarray], list[Bad], int]]:
        line = 1
        for k, (block, n_lines, too_long) in enumerate(_raw_blocks(path, cfg.block_size)):
            if too_long is not None:
                yield [], [], [(line, too_long.decode("utf-8", "backslashreplace"),
                                f"the line is longer than data.block_size="
                                f"{cfg.block_size:,} bytes", "line_too_long")], 0
                line += 1
                continue
            if k == 0 and cfg.header:  # the header line is no record
                cut = block.find(b"\n") + 1 or len(block)
                block, line, n_lines = block[cut:], line + 1, n_lines - 1
            if not n_lines:
                continue
            try:
                got = parse_lines(block, line, n_lines)
            except pa.ArrowInvalid as e:
                if misread:  # report what was seen; check_early then stops the run
                    yield [], [], [(line + b[0] - 1 if b[0] else line, b[1], b[2],
                                    _bad_reason(b[1])) for b in misread], 0
                    return
                raise DataError(f"{path}: cannot read as {fmt.upper()} near line {line}: "
                                f"{e}") from None
            yield got
            line += n_lines

    for tables, lines_of, bad, blank in prefetch(blocks(), name="sampan-read"):
        log.blank += blank
        for line, text, why, reason in bad:
            log.read += 1
            log.reject(str(path), line, reason, None, f"{why}: {text}"[:10_000])
        log.check_early()
        for table, lines in zip(tables, lines_of, strict=True):
            if table.num_rows == 0:
                continue
            out = validate_table(table, roles, lines, str(path), log, delimiter)
            log.check_early()
            if out.num_rows:
                yield out


Bad = tuple[int, str, str, str]  # physical line, its text, what is wrong, reason


def _bad_reason(text: str) -> str:
    """A line Arrow rejected: an odd number of quotes means a quoted field left open."""
    return "unbalanced_quote" if text.count('"') % 2 else "wrong_field_count"


def _newline_in_row(table: pa.Table, row: int) -> bool:
    """Whether a value of row ``row`` holds a newline (a quoted field left open)."""
    one = table.slice(row, 1)
    return any(v is not None and b"\n" in v for c in one.columns for v in c.to_pylist()
               if isinstance(v, bytes))


def _newlines(block: bytes) -> np.ndarray:
    return np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)


def _blank_lines(block: bytes, n_lines: int) -> np.ndarray:
    """Which of the block's lines are empty (or only a carriage return)."""
    ends = _newlines(block)
    if len(ends) < n_lines:  # the last line has no newline
        ends = np.append(ends, len(block))
    starts = np.concatenate([[0], ends[:-1] + 1])
    length = ends - starts
    arr = np.frombuffer(block, dtype=np.uint8)
    cr = np.zeros(len(ends), dtype=bool)
    one = np.flatnonzero(length == 1)
    cr[one] = arr[starts[one]] == 13
    return (length == 0) | cr


def _line_offset(block: bytes, k: int) -> int:
    """Byte offset where line ``k`` (0-based) of the block starts."""
    return int(_newlines(block)[k - 1]) + 1


def _raw_blocks(path: Path, block_size: int
                ) -> Iterator[tuple[bytes, int, bytes | None]]:
    """Newline-aligned blocks of a (decompressed) file, the number of lines in each, and
    ``None``; or, for a line longer than ``block_size``, ``(b"", 1, its first 200
    bytes)``: the line is skipped (never held whole in memory) and reported as one bad
    line."""
    rest = b""
    with open_input(path) as f:
        while True:
            chunk = f.read(block_size)
            data = rest + chunk
            if not chunk:
                if data:
                    yield data, data.count(b"\n") + (not data.endswith(b"\n")), None
                return
            cut = data.rfind(b"\n")
            if cut >= 0:
                block, rest = data[: cut + 1], data[cut + 1:]
                yield block, block.count(b"\n"), None
                continue
            if len(data) <= block_size:
                rest = data
                continue
            head, rest = data[:200], b""
            while True:  # drop the rest of the line
                chunk = f.read(block_size)
                nl = chunk.find(b"\n")
                if nl >= 0 or not chunk:
                    rest = chunk[nl + 1:] if nl >= 0 else b""
                    break
            yield b"", 1, head


def _read_header(path: Path, delimiter: str, encoding: str) -> list[str]:
    with open_input(path) as f:
        head = f.read(1 << 16)
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    if encoding.lower().replace("-", "").replace("_", "") == "utf8":
        encoding = "utf-8-sig"  # a byte-order mark is not part of the first column's name
    try:
        text = line.decode(encoding)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: header is not valid {encoding}: {e}") from None
    return [c.strip().strip('"') for c in text.split(delimiter)]


# --------------------------------------------------------------------------------- parquet
def _iter_parquet(cfg: DataConfig, path: Path, roles: ColumnRoles,
                  log: RejectLog) -> Iterator[pa.Table]:
    pf = pq.ParquetFile(path)
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


# ------------------------------------------------------------------------------ validation
def validate_table(table: pa.Table, roles: ColumnRoles, lines: np.ndarray, file: str,
              log: RejectLog, delimiter: str) -> pa.Table:
    """Cast raw string/binary columns to their role types; reject the rows that fail."""
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
                bad_rows = [i for i, v in enumerate(values) if v is not None and not _is_utf8(v)]
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
            col = strings[c] = pc.utf8_trim_whitespace(strings[c])
            ok = pc.fill_null(pc.match_substring_regex(col, _NUMBER_RE), True).to_numpy(
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
            cells = [strings[c][r].as_py() for c in roles.all]
            text = delimiter.join("" if v is None else str(v) for v in cells)
            log.reject(file, int(lines[r]), reason, column, text)
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


def _is_utf8(v: bytes) -> bool:
    try:
        v.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
