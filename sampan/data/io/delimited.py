"""Delimited text (CSV / TSV): block parsing with every line accounted for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from sampan.config import DataConfig
from sampan.data.io.paths import first_line, open_input
from sampan.data.rejects import RejectLog
from sampan.data.roles import ColumnRoles
from sampan.data.threads import prefetch
from sampan.data.validate import validate_table
from sampan.errors import DataError


# ------------------------------------------------------------------------------ text files
def delimiter_of(cfg: DataConfig, fmt: str) -> str:
    return cfg.delimiter or ("\t" if fmt == "tsv" else ",")


# what a delimiter of several characters becomes before parsing: the first of the ASCII
# separators (unit, record, group, file) that the block does not hold
SEPARATORS = ("\x1f", "\x1e", "\x1d", "\x1c")


def one_byte_delimiter(data: bytes, delimiter: str, encoding: str = "utf-8"
                       ) -> tuple[bytes, str]:
    """Arrow splits on one character: a delimiter of several (MovieLens-1M's ``::``) is
    replaced in the whole block by an ASCII separator the block does not hold (a block
    holding all four is refused rather than split in the wrong place). A block in another
    encoding than UTF-8 is first decoded (a multi-byte encoding may hold the delimiter's
    bytes inside a character) and comes back as UTF-8."""
    if len(delimiter) == 1:
        return data, delimiter
    if encoding.lower().replace("-", "").replace("_", "") != "utf8":
        try:
            data = data.decode(encoding).encode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"the data is not valid {encoding}: {e}") from None
    sep = next((s for s in SEPARATORS if s.encode() not in data), None)
    if sep is None:
        raise DataError(f"the data holds every ASCII separator (0x1c to 0x1f), so the "
                        f"delimiter {delimiter!r} (several characters) cannot be read; "
                        "convert the file to a one-character delimiter")
    return data.replace(delimiter.encode("utf-8"), sep.encode()), sep


def delimited_columns(cfg: DataConfig, path: Path, fmt: str) -> list[str]:
    """The column names of a CSV / TSV file, the one resolution every reader uses: the
    header (renamed by ``data.columns``, which must then name as many), or ``data.columns``
    when there is no header."""
    if cfg.header:
        names = read_header(path, delimiter_of(cfg, fmt), cfg.encoding)
        if cfg.columns is not None:
            if len(cfg.columns) != len(names):
                raise DataError(f"{path}: data.columns names {len(cfg.columns)} columns but the "
                                f"header has {len(names)}: {names}")
            names = list(cfg.columns)
        return names
    if not cfg.columns:
        raise DataError(f"{path}: data.header is false, so data.columns must list the "
                        "column names in file order")
    return list(cfg.columns)


def iter_delimited(cfg: DataConfig, path: Path, fmt: str, roles: ColumnRoles,
                   log: RejectLog) -> Iterator[pa.Table]:
    """CSV / TSV in newline-aligned blocks, each parsed on its own (by all cores) while the
    previous one is validated. Independent blocks keep memory flat however large the file
    (Arrow's streaming CSV reader grows with the input); records must be one per line."""
    delimiter = delimiter_of(cfg, fmt)
    names = delimited_columns(cfg, path, fmt)
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
        data, split_on = one_byte_delimiter(block, delimiter, encoding)

        def on_invalid(row: Any) -> str:
            bad.append((row.number, row.text.replace(split_on, delimiter),
                        f"expected {row.expected_columns} fields, got {row.actual_columns}"))
            # a file that is clearly misread stops here instead of filling the rejects file
            if len(bad) >= 1000 and log.kept == 0 and log.early:
                misread[:] = bad
                return "error"
            return "skip"

        try:
            return pacsv.read_csv(
                pa.BufferReader(data),
                read_options=pacsv.ReadOptions(column_names=names, use_threads=threads,
                                               encoding="utf8" if data is not block
                                               else encoding, block_size=arrow_block),
                parse_options=pacsv.ParseOptions(
                    delimiter=split_on,
                    quote_char=False if fmt == "tsv" or len(delimiter) > 1 else '"',
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
        line = first_line(path)
        for k, (block, n_lines, too_long) in enumerate(raw_blocks(path, cfg.block_size)):
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


def raw_blocks(path: Path, block_size: int
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


def read_header(path: Path, delimiter: str, encoding: str) -> list[str]:
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
