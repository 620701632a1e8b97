"""Feature stores: user / item attribute tables looked up by key at request time.

The tables are the run's side tables (``data.joins`` of its config: the same files, parsing
options and key normalisation as in training) unless the server config names others. A
store answers ``columns(keys)``: the table's columns for those keys, in key order, with
nulls for keys it does not hold (a cold user or item then goes through the pipeline as
missing values, and its ids map to OOV, exactly as such rows did in training).

* :class:`MemoryFeatureStore` holds the tables in Arrow arrays (the default).
* :class:`RedisFeatureStore` keeps one Redis hash per row (``<prefix>:<table>:<key>``),
  filled from the same tables with :meth:`RedisFeatureStore.load`.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sampan.data.joins import SideTable, key_text
from sampan.data.roles import ColumnRoles
from sampan.errors import ConfigError


class MemoryFeatureStore:
    """Side tables in memory, one per join key column (``by``)."""

    def __init__(self, joins: list[Any], roles: ColumnRoles):
        self.tables: dict[str, SideTable] = {}
        for j in joins:
            if j.by in self.tables:
                raise ConfigError(f"two feature tables are keyed by {j.by!r}")
            self.tables[j.by] = SideTable(j, roles)
            self.tables[j.by].index.prepare()  # key lookups ready before requests

    @property
    def keys(self) -> list[str]:
        """The key columns (e.g. ``user_id``, ``item_id``) the store can join on."""
        return list(self.tables)

    def size(self, by: str) -> int:
        return len(self.tables[by].keys)

    def columns(self, by: str, keys: pa.Array) -> tuple[dict[str, pa.Array], pa.Array]:
        """``({column: values for keys}, found mask)`` of the table keyed by ``by``."""
        t = self.tables[by]
        idx = t.index.take_indices(key_text(keys))
        return {c: pc.take(t.values[c], idx) for c in t.columns}, pc.is_valid(idx)

    def rows(self, by: str) -> tuple[pa.Array, dict[str, pa.Array]]:
        t = self.tables[by]
        return t.keys, t.values


class RedisFeatureStore:
    """The same tables in Redis: ``HSET <prefix>:<by>:<key> column value ...``.

    Values are stored as text (numbers as their shortest repr) and typed again by the
    predictor exactly as file text is; a missing value is an absent field.
    """

    def __init__(self, url: str, columns: dict[str, list[str]], prefix: str = "sampan"):
        import redis

        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.prefix = prefix
        self.table_columns = columns  # by -> value columns

    @classmethod
    def load(cls, url: str, source: MemoryFeatureStore, prefix: str = "sampan",
             batch: int = 5000) -> RedisFeatureStore:
        """Copy every table of ``source`` into Redis (pipelined) and return the store."""
        store = cls(url, {by: list(t.columns) for by, t in source.tables.items()}, prefix)
        for by in source.keys:
            keys, values = source.rows(by)
            cols = {c: v.cast(pa.string()).to_pylist() for c, v in values.items()}
            ks = keys.to_pylist()
            # MULTI/EXEC per chunk: a reader never sees a row between its DEL and HSET
            pipe = store.client.pipeline(transaction=True)
            for i, k in enumerate(ks):  # one-time load, not a request path
                name = f"{prefix}:{by}:{k}"
                pipe.delete(name)
                fields = {c: cols[c][i] for c in cols if cols[c][i] is not None}
                if fields:
                    pipe.hset(name, mapping=fields)
                else:
                    pipe.hset(name, "__row__", "1")
                if (i + 1) % batch == 0:
                    pipe.execute()
            pipe.execute()
        return store

    @property
    def keys(self) -> list[str]:
        return list(self.table_columns)

    def size(self, by: str) -> int:
        return sum(1 for _ in self.client.scan_iter(f"{self.prefix}:{by}:*", count=1000))

    def columns(self, by: str, keys: pa.Array) -> tuple[dict[str, pa.Array], pa.Array]:
        cols = self.table_columns[by]
        texts = key_text(keys).to_pylist()
        pipe = self.client.pipeline(transaction=False)
        for k in texts:
            pipe.hmget(f"{self.prefix}:{by}:{k}", ["__row__", *cols])
        rows = pipe.execute() if texts else []
        found = [k is not None and any(v is not None for v in r) for k, r in
                 zip(texts, rows, strict=True)]
        out = {c: pa.array([r[j + 1] if f else None for r, f in zip(rows, found, strict=True)],
                           pa.string()) for j, c in enumerate(cols)}
        return out, pa.array(found)
