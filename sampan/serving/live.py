"""Users' live behaviour histories: started from the bundle's user table, appended to by
events (``POST /v1/events``, gRPC ``Events``), read by every request of the user.

Each history is a ``sequence`` list feature that shares a categorical feature's vocabulary
(``hist_item_id`` sharing ``item_id``, ``hist_category_id`` sharing ``category_id``): an
event appends its ``item_id`` to ``hist_item_id`` and its ``category_id`` (given, or taken
from the item table) to ``hist_category_id``, most recent last, keeping the last
``max_len`` values, the way the training data's histories were built
(:mod:`sampan.data.behaviour`). The values stay raw text, so a request encodes them with
the bundle's own pipeline exactly as training did (an unseen item maps to OOV). A value no
table knows is kept as an empty (OOV) entry, so the histories stay aligned.

* :class:`LiveHistories`: in this process's memory (one server process).
* :class:`RedisLiveHistories`: in Redis, shared by every worker and server and kept
  across restarts; ``EXPIRE`` gives the per-user TTL.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.data.entities import History
from sampan.data.joins import KeyedTable, key_text
from sampan.errors import ConflictError, RequestError

LIST = pa.list_(pa.string())


class LiveHistories:
    """Users' behaviour histories in this process's memory.

    The histories loaded at start (:meth:`bootstrap`) stay in Arrow arrays and are looked
    up in bulk; a user who has had events since is held in a dict on top of them (only
    such users cost Python objects), at most ``max_users`` of them: beyond that the least
    recently active is forgotten, back to their bootstrapped history. Not shared between
    processes: with ``--workers N``, use the Redis backend.
    """

    shared = False

    def __init__(self, key: str, histories: list[History], ttl: float | None = None,
                 max_users: int = 1_000_000):
        self.key = key
        self.histories = {h.column: h for h in histories}
        self.ttl = ttl
        self.max_users = max_users  # users with events held; the least recent go first
        self._base: KeyedTable | None = None
        self._base_time = time.time()
        self._live: dict[str, tuple[float, dict[str, list[str]]]] = {}
        self._lock = threading.Lock()
        self._appends = 0

    @property
    def columns(self) -> list[str]:
        return list(self.histories)

    @property
    def event_values(self) -> list[str]:
        """What an event gives besides the user: the values the histories append
        (``item_id``, ``category_id``)."""
        return list(dict.fromkeys(h.event for h in self.histories.values()))

    def _expired(self, last: float, now: float) -> bool:
        """Whether a history last written at ``last`` is past the TTL at ``now``."""
        return bool(self.ttl) and last + self.ttl < now

    def extend(self, histories: list[History]) -> None:
        """Hold these histories too (a reloaded bundle may read more, or longer, ones)."""
        for h in histories:
            old = self.histories.get(h.column)
            if old is None or old.max_len < h.max_len:
                self.histories[h.column] = h

    def bootstrap(self, keys: pa.Array, lists: dict[str, pa.Array]) -> int:
        """Start from these users' histories (the bundle's user table); returns the count."""
        values = {c: lists[c].cast(LIST) for c in self.histories if c in lists}
        self._base = KeyedTable(self.key, keys, values, "the bundle's user table")
        self._base.index.prepare()
        self._base_time = time.time()
        return len(keys)

    def append(self, users: list[str], events: dict[str, list[str]]) -> None:
        """Append event ``i`` (its value for each history column) to user ``users[i]``."""
        now = time.time()
        cols = self.columns
        with self._lock:
            for i, u in enumerate(users):  # one dict update per event: the write path
                entry = self._live.get(u)
                if entry is None or self._expired(entry[0], now):
                    entry = (now, self._start(u, now, entry is not None))
                hist = entry[1]
                for c in cols:
                    h = hist.setdefault(c, [])
                    h.append(events[c][i])
                    del h[:-self.histories[c].max_len]
                self._live.pop(u, None)  # re-inserted last: the dict is in recency order
                self._live[u] = (now, hist)
            while len(self._live) > self.max_users:  # back to their bootstrapped history
                del self._live[next(iter(self._live))]
            self._appends += len(users)
            if self.ttl and self._appends > 4096:
                self._appends = 0
                self._live = {u: e for u, e in self._live.items()
                              if not self._expired(e[0], now)}

    def _start(self, user: str, now: float, expired: bool) -> dict[str, list[str]]:
        if expired or self._base is None or self._expired(self._base_time, now):
            return {}
        values, found = self._base.take(pa.array([user]))
        if not found[0].as_py():
            return {}
        return {c: values[c][0].as_py() or [] for c in values}

    def lookup(self, keys: pa.Array) -> tuple[dict[str, pa.Array], pa.Array]:
        """``({history column: list<string> per key}, found)``; null for an unknown user."""
        texts = key_text(keys)
        n = len(texts)
        now = time.time()
        if self._base is not None and not self._expired(self._base_time, now):
            out, found = self._base.take(texts)
        else:
            out, found = {c: pa.nulls(n, LIST) for c in self.columns}, pa.array(np.zeros(n, bool))
        for c in self.columns:
            if c not in out:
                out[c] = pa.nulls(n, LIST)
        live = self._live
        if not live:
            return out, found
        rows = {}
        for i, k in enumerate(texts.to_pylist()):  # per request key: a dict lookup
            e = live.get(k) if k is not None else None
            if e is not None:
                rows[i] = {} if self._expired(e[0], now) else e[1]
        if not rows:
            return out, found
        idx = list(rows)
        mask = np.zeros(n, bool)
        mask[idx] = True
        take = np.arange(n)  # row i of [base; live rows]: a live user's comes from below
        take[idx] = n + np.arange(len(idx))
        take = pa.array(take)
        for c in self.columns:
            given = pa.array([rows[i].get(c, []) for i in idx], LIST)
            out[c] = pc.take(pa.concat_arrays([out[c].cast(LIST), given]), take)
        found = pc.or_(found, pa.array(mask))
        return out, found


class RedisLiveHistories:
    """Users' histories in Redis, shared by every worker and server: one list per user
    and history column (``<prefix>:hist:<key>:<user>:<column>``), appended with ``RPUSH``
    and trimmed with ``LTRIM`` in one transaction, with ``PEXPIRE`` ``ttl`` when set."""

    shared = True

    def __init__(self, url: str, key: str, histories: list[History], ttl: float | None = None,
                 prefix: str = "sampan"):
        import redis

        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.key, self.ttl, self.prefix = key, ttl, prefix
        self.histories = {h.column: h for h in histories}

    columns = LiveHistories.columns
    event_values = LiveHistories.event_values
    extend = LiveHistories.extend

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000)) if self.ttl else 0

    def _name(self, user: str, column: str) -> str:
        return f"{self.prefix}:hist:{self.key}:{user}:{column}"

    def bootstrap(self, keys: pa.Array, lists: dict[str, pa.Array], batch: int = 2000) -> int:
        """Give users without a history in Redis the bundle's (one-time load at start);
        returns how many were filled."""
        cols = [c for c in self.columns if c in lists]
        users = key_text(keys).to_pylist()
        values = {c: lists[c].cast(LIST).to_pylist() for c in cols}
        filled = 0
        pipe = self.client.pipeline(transaction=False)
        for i, u in enumerate(users):  # one-time load, not a request path
            names = [self._name(u, c) for c in cols]
            hist = [(values[c][i] or [])[-self.histories[c].max_len:] for c in cols]
            if not any(hist):
                continue
            # a user whose lists exist already (events since) is left as it is
            pipe.execute_command("EVAL", self._fill, len(names), *names, self._ttl_ms,
                                 *[len(h) for h in hist], *[x for h in hist for x in h])
            if (i + 1) % batch == 0:
                filled += sum(r == 1 for r in pipe.execute() if isinstance(r, int))
        filled += sum(r == 1 for r in pipe.execute() if isinstance(r, int))
        return filled

    # KEYS: the user's lists; ARGV: the TTL in ms (0: none), each list's length, then every
    # value in order. Fills nothing when any of the lists exists.
    _fill = """
    for _, k in ipairs(KEYS) do
      if redis.call('EXISTS', k) == 1 then return 0 end
    end
    local ttl = tonumber(ARGV[1])
    local at = #KEYS + 2
    for i, k in ipairs(KEYS) do
      local n = tonumber(ARGV[i + 1])
      for j = at, at + n - 1 do redis.call('RPUSH', k, ARGV[j]) end
      if n > 0 and ttl > 0 then redis.call('PEXPIRE', k, ttl) end
      at = at + n
    end
    return 1
    """

    def append(self, users: list[str], events: dict[str, list[str]]) -> None:
        pipe = self.client.pipeline(transaction=True)
        for i, u in enumerate(users):
            for c, h in self.histories.items():
                name = self._name(u, c)
                pipe.rpush(name, events[c][i])
                pipe.ltrim(name, -h.max_len, -1)
                if self.ttl:
                    pipe.pexpire(name, self._ttl_ms)
        pipe.execute()

    def lookup(self, keys: pa.Array) -> tuple[dict[str, pa.Array], pa.Array]:
        texts = key_text(keys).to_pylist()
        cols = self.columns
        pipe = self.client.pipeline(transaction=False)
        for k in texts:
            for c in cols:
                pipe.lrange(self._name(k, c), 0, -1)
        got = pipe.execute() if texts else []
        w = len(cols)
        found = [any(got[i * w + j] for j in range(w)) for i in range(len(texts))]
        out = {c: pa.array([got[i * w + j] if found[i] else None for i in range(len(texts))],
                           LIST) for j, c in enumerate(cols)}
        return out, pa.array(found, pa.bool_())


def append_events(live: Any, events: list[dict[str, Any]], tables: list[Any],
                  max_records: int) -> dict[str, Any]:
    """Append behaviour events to users' live histories: each event gives the user
    key and the values of what it did (``item_id``; ``category_id`` and other history
    values are taken from ``tables`` when not given, and are unknown (OOV) when no
    table has them). Returns ``{"accepted": events, "users": distinct users}``."""
    from sampan.data.io.lines import CellError, records_table
    from sampan.data.roles import ColumnRoles
    from sampan.serving.predictor import check_objects

    if live is None:
        raise ConflictError("no served model reads behaviour histories (sequence "
                           "features sharing an item vocabulary), so there is nothing "
                           "for events to update", "events")
    check_objects(events, "event", max_records)
    hist = list(live.histories.values())
    fields = [live.key, *live.event_values]
    for i, e in enumerate(events):
        unknown = [k for k in e if k not in fields]
        if unknown:
            raise RequestError(f"event {i} has unknown field(s) {unknown}; an event "
                               f"gives {fields}", unknown[0], i)
    try:
        table = records_table(events, ColumnRoles(categorical=fields), scalars=True)
    except CellError as e:
        raise RequestError(f"event {e.record}: {e.column!r} {e.problem}", e.column,
                           e.record) from None
    users = key_text(table.column(live.key).combine_chunks())
    if users.null_count:
        i = users.to_pylist().index(None)
        raise RequestError(f"event {i} has no {live.key!r}", live.key, i)
    values = {c: table.column(c).combine_chunks() for c in fields[1:]}
    given = np.zeros(len(events), bool)
    for v in values.values():
        given |= v.is_valid().to_numpy(zero_copy_only=False)
    if not given.all():
        i = int(np.argmin(given))
        raise RequestError(f"event {i} gives none of {fields[1:]}: say what the user did "
                           f"(e.g. {{{live.key!r}: ..., {fields[1]!r}: ...}})", fields[1], i)
    values, notes = _derive(values, tables)
    out = {h.column: pc.fill_null(values[h.event], "").to_pylist() for h in hist}
    live.append(users.to_pylist(), out)
    return {"accepted": len(events), "users": len(pc.unique(users)), "warnings": notes}

def _derive(values: dict[str, Any], tables: list[Any]) -> tuple[dict[str, Any], list[str]]:
    """Fill event values not given (``category_id``) from a feature table keyed by a
    value that is (the item table by ``item_id``); also a warning for each value (an
    item) that such a table was asked for and does not hold: what it would have brought
    goes into the history as unknown (OOV)."""
    notes: list[str] = []
    for t in tables:
        for by in t.keys:
            if by not in values or not values[by].null_count < len(values[by]):
                continue
            missing = [c for c, v in values.items() if c != by and v.null_count]
            if not missing:
                return values, notes
            got, found = t.columns(by, values[by])
            for c in missing:
                if c in got:
                    values[c] = pc.coalesce(values[c], got[c].cast(pa.string()))
            asked = pc.and_(values[by].is_valid(), pc.invert(found))
            absent = pc.unique(pc.filter(values[by], asked)).to_pylist()
            brought = [c for c in missing if c in got]
            if absent and brought:
                shown = ", ".join(repr(str(v)) for v in absent[:5])
                more = f" and {len(absent) - 5:,} more" if len(absent) > 5 else ""
                notes.append(f"{by} {shown}{more} not in the feature table keyed by {by}: "
                             f"{', '.join(brought)} went into the history as unknown")
    return values, notes


def live_spec(bundle: Any, with_table: bool = True
              ) -> tuple[str, list[History], pa.Table | None] | None:
    """``(user key, histories, the bundle's user histories or None)`` of a bundle whose
    model reads behaviour histories (the table read only ``with_table``); None when it
    reads none."""
    import pyarrow.parquet as pq

    from sampan.data.entities import entity_keys, histories

    users = (bundle.manifest.get("feature_tables") or {}).get("users")
    if isinstance(users, dict) and users.get("histories"):
        hist = [History(**h) for h in users["histories"]]
        t = pq.read_table(bundle.file(users["file"]), columns=[
            users["key"], *[h.column for h in hist]]) if with_table else None
        return users["key"], hist, t
    feats = bundle.pipeline().features
    hist = histories(feats)
    user, _ = entity_keys(feats, None)
    return (user, hist, None) if hist and user else None
