"""``sampan data inspect``: guess a raw file's layout and summarise its columns."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from sampan.data.io.delimited import one_byte_delimiter
from sampan.data.sources import detect_format, open_input
from sampan.errors import DataError, MissingPathError


def _head_bytes(path: Path, limit: int = 8 << 20) -> bytes:
    with open_input(path) as f:
        data = f.read(limit)
    cut = data.rfind(b"\n")
    return data[: cut + 1] if cut > 0 else data


def _guess_delimiter(first_lines: list[str]) -> str:
    counts = {d: min(line.count(d) for line in first_lines)
              for d in ("\t", ",", "|", ";", " ", "::")}  # on a tie, the first
    best = max(counts, key=lambda d: counts[d])
    return best if counts[best] else ","


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _guess_header(lines: list[str], delimiter: str) -> bool:
    """Line 1 is a header when none of its fields is a number but some field below is."""
    if len(lines) < 2:
        return False
    first = lines[0].split(delimiter)
    rest = [line.split(delimiter) for line in lines[1:]]
    numeric_below = any(_is_number(v) for row in rest for v in row if v)
    return not any(_is_number(v) for v in first if v) and numeric_below


def read_head(path: Path, rows: int, delimiter: str | None = None,
              header: bool | None = None) -> tuple[pa.Table, dict[str, Any]]:
    """The first ``rows`` rows of a file with guessed layout, and what was guessed."""
    fmt = detect_format(path, "auto")
    if fmt == "parquet":
        pf = pq.ParquetFile(path)
        batches = []
        n = 0
        for b in pf.iter_batches(batch_size=min(rows, 65536)):
            batches.append(b)
            n += b.num_rows
            if n >= rows:
                break
        return pa.Table.from_batches(batches).slice(0, rows), {"format": "parquet"}
    data = _head_bytes(path)
    if fmt == "jsonl":
        t = pajson.read_json(io.BytesIO(data))
        return t.slice(0, rows), {"format": "jsonl"}
    text_lines = data[:65536].decode("utf-8", "replace").splitlines()[:20]
    if not text_lines:
        raise DataError(f"{path} is empty")
    delimiter = delimiter or _guess_delimiter(text_lines)
    header = _guess_header(text_lines, delimiter) if header is None else header
    data, split_on = one_byte_delimiter(data, delimiter)
    t = pacsv.read_csv(io.BytesIO(data),
                       read_options=pacsv.ReadOptions(autogenerate_column_names=not header),
                       parse_options=pacsv.ParseOptions(delimiter=split_on,
                                                        quote_char=len(delimiter) == 1 and '"',
                                                        invalid_row_handler=lambda r: "skip"))
    return t.slice(0, rows), {"format": "tsv" if delimiter == "\t" else "csv",
                              "delimiter": delimiter, "header": header}


def inspect_file(path: Path, rows: int = 100_000, delimiter: str | None = None,
                 header: bool | None = None, distinct_cap: int = 1_000_000) -> dict[str, Any]:
    """Per column: type, null rate, distinct count and most frequent values."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"{path} does not exist")
    t, info = read_head(path, rows, delimiter, header)
    cols = []
    for name in t.column_names:
        col = t.column(name).combine_chunks()
        nulls = col.null_count
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            nulls += int(pc.sum(pc.equal(col, "")).as_py() or 0)
        values = col
        while pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or \
                pa.types.is_fixed_size_list(values.type):
            values = pc.list_flatten(values)  # a list column: its elements are counted
        if not pa.types.is_nested(values.type):
            vc = pc.value_counts(values)
            distinct = len(vc)
            order = pc.sort_indices(vc.field("counts"), sort_keys=[("", "descending")]) \
                if len(vc) else pa.array([], pa.int64())
            top = vc.field("values").take(order[:3]).to_pylist()
        else:
            distinct, top = 0, [v.as_py() for v in col[:2]]
        cols.append({"name": name, "type": str(col.type), "null_rate": nulls / max(len(col), 1),
                     "distinct": min(distinct, distinct_cap),
                     "distinct_capped": distinct > distinct_cap, "top": top})
    sample = [list(r.values()) for r in t.slice(0, 5).to_pylist()]
    return {**info, "rows": t.num_rows, "columns": cols, "sample": sample}
