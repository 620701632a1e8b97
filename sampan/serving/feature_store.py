"""Feature stores: what the server knows about users and items, joined to requests by key.

Two kinds of state:

* **Tables**, one per key column (``user_id``, ``item_id``): the bundle's feature tables
  (:mod:`sampan.export.tables`: every item's category, every user's joined attributes),
  or the run's ``data.joins`` side tables for a bundle without them, or the tables the
  serve config names. :class:`MemoryTables` holds them in Arrow arrays;
  :class:`RedisTables` keeps one Redis hash per row (``<prefix>:<by>:<key>``).
* **Live histories** (:class:`LiveHistories`, :class:`RedisLiveHistories`): each user's
  behaviour histories (``hist_item_id``, ``hist_category_id``), started from the bundle's
  user table and appended to by events (``POST /v1/events``), most recent last, keeping the
  last ``max_len`` values of each, as the training data's histories were built. A
  user's history is forgotten ``ttl`` seconds after their last event, when a TTL is set.

:class:`FeatureStore` puts both behind the one call the predictor makes,
``columns(by, keys)``: the columns known for those keys, in key order, with nulls for keys
it does not hold (a cold user or item then goes through the pipeline as missing values,
and its ids map to OOV, exactly as such rows did in training).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.data.joins import KeyedTable, key_text
from sampan.errors import ConfigError

LIST = pa.list_(pa.string())


class MemoryTables:
    """Feature tables in memory, one per key column (``by``)."""

    def __init__(self, tables: list[KeyedTable]):
        self.tables: dict[str, KeyedTable] = {}
        for t in tables:
            if t.by in self.tables:
                raise ConfigError(f"two feature tables are keyed by {t.by!r}")
            self.tables[t.by] = t
            t.index.prepare()  # key lookups ready before requests

    @property
    def keys(self) -> list[str]:
        """The key columns (e.g. ``user_id``, ``item_id``) the store can join on."""
        return list(self.tables)

    def provides(self) -> dict[str, list[str]]:
        """The columns each key brings (``{"item_id": ["price", "brand"]}``)."""
        return {by: list(t.values) for by, t in self.tables.items()}

    def size(self, by: str) -> int:
        return len(self.tables[by].keys)

    def columns(self, by: str, keys: pa.Array) -> tuple[dict[str, pa.Array], pa.Array]:
        """``({column: values for keys}, found mask)`` of the table keyed by ``by``."""
        return self.tables[by].take(keys)

    def rows(self, by: str) -> tuple[pa.Array, dict[str, pa.Array]]:
        t = self.tables[by]
        return t.keys, t.values


# kept importable under its earlier name
MemoryFeatureStore = MemoryTables


class RedisTables:
    """The same tables in Redis: ``HSET <prefix>:<by>:<key> column value ...``.

    Values are stored as text (numbers as their shortest repr) and typed again by the
    predictor exactly as file text is; a missing value is an absent field. A list
    attribute (an item's genres) is stored as a JSON array and read back as a list (live
    histories are :class:`RedisLiveHistories`).
    """

    def __init__(self, url: str, columns: dict[str, list[str]], prefix: str = "sampan",
                 lists: dict[str, list[str]] | None = None):
        import redis

        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.prefix = prefix
        self.table_columns = columns  # by -> value columns
        self.lists = {by: set(cols) for by, cols in (lists or {}).items()}

    @classmethod
    def load(cls, url: str, source: MemoryTables, prefix: str = "sampan",
             batch: int = 5000) -> RedisTables:
        """Copy every table of ``source`` into Redis (pipelined) and return the store."""
        listed = {by: [c for c, v in t.values.items() if pa.types.is_list(v.type)
                       or pa.types.is_large_list(v.type)] for by, t in source.tables.items()}
        store = cls(url, {by: list(t.values) for by, t in source.tables.items()}, prefix,
                    listed)
        for by in source.keys:
            keys, values = source.rows(by)
            cols = {c: (values[c].cast(pa.string()).to_pylist() if c not in listed[by] else
                        [None if v is None else json.dumps(v)
                         for v in values[c].cast(LIST).to_pylist()])
                    for c in store.table_columns[by]}
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

    def provides(self) -> dict[str, list[str]]:
        return {by: list(cols) for by, cols in self.table_columns.items()}

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
        for c in self.lists.get(by, ()):
            out[c] = pa.array([None if v is None else json.loads(v)
                               for v in out[c].to_pylist()], LIST)
        return out, pa.array(found)


RedisFeatureStore = RedisTables


class FeatureStore:
    """Tables and live histories behind one ``columns(by, keys)`` call.

    ``live`` may be shared with another store (the retrieval bundle's): an event is then
    seen by both models.
    """

    RECENT = 4096  # single-key table lookups remembered for the request's warnings

    def __init__(self, tables: Any = None, live: Any = None):
        self.tables, self.live = tables, live
        # (key column, key) -> whether its table held it, at the last lookup of that key
        # alone (a request's user): the unknown-user warning reads it, not the table again
        self._recent: dict[tuple[str, str], bool] = {}
        self._recent_lock = threading.Lock()

    def in_table(self, by: str, value: Any) -> bool:
        """Whether the table keyed by ``by`` holds ``value``: as the last lookup of that key
        found it (the request's own, moments ago), or read now."""
        hit = self._recent.get((by, str(value)))
        if hit is not None:
            return hit
        _, found = self.tables.columns(by, pa.array([value]))
        return bool(found[0].as_py())

    @property
    def keys(self) -> list[str]:
        keys = list(self.tables.keys) if self.tables is not None else []
        if self.live is not None and self.live.key not in keys:
            keys.append(self.live.key)
        return keys

    def provides(self) -> dict[str, list[str]]:
        """The columns each key brings: a table's, and the live histories by the user."""
        out = self.tables.provides() if self.tables is not None else {}
        if self.live is not None:
            out[self.live.key] = [*out.get(self.live.key, []), *self.live.columns]
        return out

    def columns(self, by: str, keys: pa.Array) -> tuple[dict[str, pa.Array], pa.Array]:
        """``({column: values for keys}, found mask)``: each distinct key is looked up once
        (a ranking request repeats its user for every candidate: one Redis read, not one a
        candidate), then spread back to the keys' rows."""
        distinct = pc.unique(keys)
        if len(distinct) == len(keys):
            return self._columns(by, keys)
        out, found = self._columns(by, distinct)
        at = pc.index_in(keys, value_set=distinct, skip_nulls=False)
        return {c: pc.take(v, at) for c, v in out.items()}, pc.take(found, at)

    def _columns(self, by: str, keys: pa.Array) -> tuple[dict[str, pa.Array], pa.Array]:
        out: dict[str, pa.Array] = {}
        found = pa.array(np.zeros(len(keys), bool))
        if self.tables is not None and by in self.tables.keys:
            out, found = self.tables.columns(by, keys)
            if len(keys) == 1:
                self._remember(by, keys[0].as_py(), bool(found[0].as_py()))
        if self.live is not None and by == self.live.key:
            hist, seen = self.live.lookup(keys)
            out = {**{c: v for c, v in out.items() if c not in hist}, **hist}
            found = pc.or_(found, seen)
        return out, found

    def _remember(self, by: str, value: Any, found: bool) -> None:
        with self._recent_lock:
            self._recent.pop((by, str(value)), None)  # the newest last: the oldest goes
            self._recent[(by, str(value))] = found
            if len(self._recent) > self.RECENT:
                del self._recent[next(iter(self._recent))]


def bundle_tables(bundle: Any) -> list[KeyedTable]:
    """A bundle's feature tables (``manifest["feature_tables"]``), their attribute columns
    (histories are the live state's)."""
    import pyarrow.parquet as pq

    out = []
    for name, info in (bundle.manifest.get("feature_tables") or {}).items():
        if name == "skipped" or not isinstance(info, dict) or not info.get("columns"):
            continue
        key, cols = info["key"], list(info["columns"])
        t = pq.read_table(bundle.file(info["file"]), columns=[key, *cols])
        out.append(KeyedTable(key, t.column(key), {c: t.column(c) for c in cols},
                              f"bundle {bundle.path}: {info['file']}"))
    return out
