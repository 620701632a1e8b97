"""Side tables (``data.joins``): read whole, indexed by key, attached to every chunk;
serving uses the same code for its feature store."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sampan.config import DataConfig
from sampan.data.hashing import ValueIndex, as_string
from sampan.data.io import file_columns, iter_source
from sampan.data.io.paths import expand_paths
from sampan.data.rejects import RejectLog
from sampan.data.roles import NUMBER_RE, ColumnRoles
from sampan.errors import DataError


class KeyedTable:
    """Columns indexed by a unique key column ``by``: a side table, or one of a bundle's
    feature tables. Keys are compared as text (:func:`key_text`)."""

    def __init__(self, by: str, keys: pa.Array, values: dict[str, pa.Array],
                 where: str = "a feature table"):
        keys = key_text(keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys)
        if len(pc.unique(keys)) != len(keys):
            counts = pc.value_counts(keys)
            dup = pc.filter(counts, pc.greater(counts.field("counts"), 1))[0]["values"]
            raise DataError(f"{where}: key {by!r} is not unique (e.g. {dup.as_py()!r})")
        self.by = by
        self.keys = keys
        self.index = ValueIndex(keys)
        self.values = {c: v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v
                       for c, v in values.items()}
        self.columns = list(self.values)

    def take(self, keys: pa.Array) -> tuple[dict[str, pa.Array], pa.Array]:
        """``({column: values for keys}, found mask)``; nulls where a key is absent."""
        idx = self.index.take_indices(key_text(keys))
        return {c: pc.take(self.values[c], idx) for c in self.columns}, pc.is_valid(idx)


class SideTable(KeyedTable):
    """One ``data.joins`` entry, read whole and indexed by its key."""

    def __init__(self, join: Any, roles: ColumnRoles):
        self.join = join
        key = join.key or join.by
        path = expand_paths(join.path)
        if join.format == "json_map":
            table = json_map(path, key, join.columns)
            names = table.column_names
        else:
            cfg = DataConfig(train=join.path, format=join.format, delimiter=join.delimiter,
                             header=join.header, columns=join.columns, encoding=join.encoding)
            names = file_columns(cfg, path[0])
        if key not in names:
            raise DataError(f"data.joins: key {key!r} is not a column of {join.path} ({names})")
        columns = [c for c in roles.all if c in names and c != key]
        if join.format != "json_map":
            side_roles = ColumnRoles(
                categorical=[key, *(c for c in columns if c not in roles.lists)],
                lists=[c for c in columns if c in roles.lists])
            log = RejectLog(None)
            parts = list(iter_source(cfg, path, side_roles, log))
            if log.rejected:
                raise DataError(f"data.joins: {join.path} has {log.rejected} unreadable rows "
                                f"{dict(log.reasons)}")
            table = pa.concat_tables(parts) if parts else pa.table(
                {c: pa.array([], pa.string()) for c in side_roles.all})
        # Numbers of a side table are checked like those of the main file, but a bad one
        # becomes missing (the row it belongs to is not the main file's to reject).
        values = {}
        for c in columns:
            col = table.column(c).combine_chunks()
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                values[c] = col.cast(pa.list_(pa.string()))  # a list feature's values
                continue
            col = pc.utf8_trim_whitespace(col.cast(pa.string()))
            if c in roles.numeric:
                ok = pc.fill_null(pc.match_substring_regex(col, NUMBER_RE), False)
                col = pc.if_else(ok, col, pa.scalar(None, pa.string())).cast(pa.float64())
            values[c] = col
        super().__init__(join.by, table.column(key), values,
                         f"data.joins: {join.path}")

    def attach(self, table: pa.Table) -> pa.Table:
        # a missing key matches nothing (not a side row with an empty key)
        values, _ = self.take(table.column(self.join.by).combine_chunks())
        for c in self.columns:
            table = table.append_column(c, values[c])
        return table


def key_text(keys: pa.Array) -> pa.Array:
    """Join keys compared as text: trimmed, and 1.0 written as 1 (numbers read as floats)."""
    if pa.types.is_floating(keys.type) or pa.types.is_integer(keys.type):
        return as_string(keys)
    text = pc.utf8_trim_whitespace(keys.cast(pa.string()))
    as_num = pc.match_substring_regex(text, r"^-?\d+\.0+$")
    return pc.if_else(pc.fill_null(as_num, False), pc.replace_substring_regex(
        text, r"\.0+$", ""), text)


def json_map(paths: list[str], key: str, columns: list[str] | None) -> pa.Table:
    """A JSON object ``{key: value or [values]}`` (gzip by the ``.gz`` suffix) as a table
    of two columns: the keys, and the values as lists of text."""
    import gzip
    import json

    if columns is not None and len(columns) != 2:
        raise DataError(f"data.joins: a json_map side table has two columns (the key and "
                        f"its values); columns {columns} names {len(columns)}")
    mapping: dict[str, Any] = {}
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            try:
                got = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"data.joins: {path} is not valid JSON ({e})") from e
        if not isinstance(got, dict):
            raise DataError(f"data.joins: {path} holds a JSON {type(got).__name__}; "
                            "format json_map expects one object {key: value or [values]}")
        mapping.update(got)
    names = columns or [key, f"{key}_value"]
    vals = pa.array(list(mapping.values()))
    if not (pa.types.is_list(vals.type) or pa.types.is_large_list(vals.type)):
        vals = pa.array([[v] if v is not None else None for v in vals.to_pylist()])
    return pa.table({names[0]: pa.array(list(mapping), pa.string()),
                     names[1]: vals.cast(pa.list_(pa.string()))})
