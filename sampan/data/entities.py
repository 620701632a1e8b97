"""What a run knows about each user and item, as tables keyed by id: the feature tables a
bundle carries so that a serving request needs only ids.

* The **item table** holds, per item key, every raw column that has one value per item in
  the rows the run read (its category, its price, the columns a ``data.joins`` table keyed
  by item brings): a column whose value varies for one item (a price that changed, the
  time of day) is request context, not an item attribute, and stays out.
* The **user table** holds the same for the user key (the ``data.joins`` user columns), and
  the user's latest behaviour history: for every ``sequence`` list feature that shares a
  categorical feature's vocabulary (``hist_item_id`` sharing ``item_id``), the history of
  the user's latest row, followed by that row's own value when its label is positive (the
  event the history of a later row would have held).

The history columns are also what live events append to when serving
(:mod:`sampan.serving.feature_store`): ``histories`` names, per list column, the event
column it takes its values from and how many it keeps.

Everything here is Arrow and NumPy over whole columns; nothing loops over rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.data.joins import key_text
from sampan.data.lists import split_lists
from sampan.data.roles import LINE_COLUMN


@dataclass(frozen=True)
class History:
    """A live history: list column ``column`` takes the values of ``event`` (the raw
    column of the categorical feature it shares), keeping the last ``max_len``."""

    column: str
    event: str
    max_len: int

    def to_json(self) -> dict[str, Any]:
        return {"column": self.column, "event": self.event, "max_len": self.max_len}


def raw_columns(features: Any) -> dict[str, str]:
    """Categorical feature name -> its raw column (features read from one column as is)."""
    return {f.name: f.column or f.name for f in features.categorical
            if not f.cross and f.bucketize == "none"}


def histories(features: Any) -> list[History]:
    """The behaviour histories of a feature config: ``sequence`` lists (not flags) that
    share a categorical feature read from one column."""
    raw = raw_columns(features)
    return [History(f.column or f.name, raw[f.share], f.max_len) for f in features.lists
            if f.kind == "sequence" and f.share in raw and not f.flags]


def entity_keys(features: Any, item_feature: str | None,
                user_feature: str | None = None) -> tuple[str | None, str | None]:
    """``(user key, item key)`` raw columns: the named features' columns, else
    ``features.group`` for the user and the columns named ``user_id`` / ``item_id`` when
    they are features."""
    raw = raw_columns(features)
    cols = set(raw.values())
    item = raw.get(item_feature or "") or ("item_id" if "item_id" in cols else None)
    user = raw.get(user_feature or "") or features.group or (
        "user_id" if "user_id" in cols else None)
    return (user if user != item else None), item


_JOIN = "\x1f"  # joins a list's values into one comparable text (and splits them again)


def _one_per_key(table: pa.Table, key: str, candidates: list[str]) -> pa.Table:
    """``key`` + the ``candidates`` that hold one value (nulls aside) for every key. A list
    column (an item's genres read from Parquet or JSON) is compared as its joined text."""
    if not candidates:
        return table.group_by(key).aggregate([]).select([key])
    listed = [c for c in candidates if pa.types.is_list(table.schema.field(c).type)
              or pa.types.is_large_list(table.schema.field(c).type)]
    for c in listed:
        lists = table.column(c).cast(pa.list_(pa.string())).combine_chunks()
        # a null inside a list is an empty token (as training splits it), not a null list
        lists = pa.ListArray.from_arrays(lists.offsets, pc.fill_null(lists.values, ""),
                                         mask=pc.is_null(lists))
        table = table.set_column(table.column_names.index(c), c,
                                 pc.binary_join(lists, _JOIN))
    agg = table.group_by(key).aggregate([(c, "count_distinct") for c in candidates]
                                        + [(c, "max") for c in candidates])
    keep = [c for c in candidates
            if pc.max(agg.column(f"{c}_count_distinct")).as_py() in (None, 0, 1)]
    out = {c: agg.column(f"{c}_max") for c in keep}
    for c in (c for c in listed if c in out):
        text = out[c]
        out[c] = pc.if_else(pc.equal(text, ""), pa.scalar([], pa.list_(pa.string())),
                            pc.split_pattern(text, _JOIN))
    return pa.table({key: agg.column(key), **out})


def _latest_histories(table: pa.Table, key: str, hist: list[History], lists: dict[str, Any],
                      order: list[str], positive: pa.Array | None) -> pa.Table:
    """Per key, the histories of its latest row (by ``order`` columns, then file order),
    each followed by the row's event value when ``positive``."""
    n = table.num_rows
    sort = [(key, "ascending"), *[(c, "ascending") for c in order]]
    idx = pc.sort_indices(table.append_column("__row", pa.array(np.arange(n))),
                          sort_keys=[*sort, ("__row", "ascending")]).to_numpy()
    keys = pc.take(table.column(key), pa.array(idx)).combine_chunks()
    last = np.ones(n, bool)
    if n > 1:  # the last row of each key's run
        last[:-1] = pc.not_equal(keys.slice(0, n - 1), keys.slice(1)).to_numpy(
            zero_copy_only=False)
    rows = pa.array(idx[last])
    out = {key: pc.take(keys, pa.array(np.nonzero(last)[0]))}
    add = (pc.fill_null(pc.take(positive, rows), False).to_numpy(zero_copy_only=False)
           if positive is not None else np.zeros(len(rows), bool))
    for h in hist:
        seq = split_lists(pc.take(table.column(h.column).combine_chunks(), rows),
                          lists[h.column])
        event = pc.fill_null(pc.take(table.column(h.event).combine_chunks(), rows)
                             .cast(pa.string()), "")
        out[h.column] = _append(seq, event, add, h.max_len)
    return pa.table(out)


def _append(lists: pa.ListArray, values: pa.Array, where: np.ndarray,
            max_len: int) -> pa.ListArray:
    """The last ``max_len`` of ``lists[i] + [values[i]]`` where ``where[i]``, else of
    ``lists[i]``."""
    lists = lists.cast(pa.list_(pa.string()))
    flat = pc.list_flatten(lists)
    counts = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    new_counts = counts + where
    offsets = np.concatenate([[0], np.cumsum(new_counts)])
    mask = np.ones(int(offsets[-1]), bool)
    mask[offsets[1:][where] - 1] = False
    take = np.empty(len(mask), np.int64)
    take[mask] = np.arange(len(flat))
    take[~mask] = len(flat) + np.nonzero(where)[0]
    values = pa.concat_arrays([flat, values.cast(pa.string())])
    keep = np.minimum(new_counts, max_len)  # the most recent max_len of each
    start = offsets[1:] - keep
    rows = np.repeat(np.arange(len(keep)), keep)
    pos = start[rows] + np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
    return pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(keep)]).astype(np.int32)),
        pc.take(values, pa.array(take[pos])))


def entity_tables(table: pa.Table, features: Any, roles: Any, user: str | None,
                  item: str | None, order: list[str], exclude: list[str]) -> dict[str, Any]:
    """The item and user tables of the rows in ``table`` (validated raw columns).

    ``order``: columns that put a user's rows in time order (the time split's column);
    ``exclude``: columns that are neither user nor item attributes (the split column; the
    labels are left out on their own). A row is positive when its first label is at least
    its threshold (0.5 without one). Returns ``{"items": (table, info), "users": (table,
    info)}`` for the keys given."""
    spec = features.label_specs[0]
    label, threshold = spec.column or spec.name, spec.threshold
    exclude = [*exclude, *(s.column or s.name for s in features.label_specs)]
    lists = {f.column or f.name: f for f in features.lists if not f.flags}
    scalar = [c for c in roles.categorical + roles.numeric
              if c not in lists and c not in exclude and c != LINE_COLUMN]
    # a bag or text list is an attribute where it holds one value per key (an item's
    # genres); a sequence is the user's behaviour, kept as a history below
    scalar += [c for c, f in lists.items() if f.kind != "sequence"
               and c in table.column_names and c not in exclude]
    scalar = list(dict.fromkeys(scalar))
    hist = [h for h in histories(features) if h.column in table.column_names
            and h.event in table.column_names]
    out: dict[str, Any] = {}
    for name, key in (("items", item), ("users", user)):
        if key is None or key not in table.column_names:
            continue
        t = table.filter(pc.is_valid(table.column(key)))
        t = t.set_column(t.column_names.index(key), key, key_text(
            t.column(key).combine_chunks()))
        others = [c for c in scalar if c not in (user, item)]
        attrs = _one_per_key(t, key, others)
        info: dict[str, Any] = {"key": key, "columns": [c for c in attrs.column_names
                                                        if c != key]}
        if name == "users" and hist:
            positive = None
            if label in t.column_names:
                positive = pc.greater_equal(t.column(label).combine_chunks(),
                                            0.5 if threshold is None else threshold)
            # among a user's rows at the latest time, a positive one (a sampled negative
            # shares its time and history)
            latest = _latest_histories(t, key, hist, lists, [
                c for c in [*order, label] if c in t.column_names], positive)
            attrs = attrs.sort_by(key)  # the same keys, in the same (sorted) order
            for h in hist:
                attrs = attrs.append_column(h.column, latest.column(h.column))
            info["histories"] = [h.to_json() for h in hist]
        attrs = attrs.sort_by(key)
        info["rows"] = attrs.num_rows
        if info["columns"] or info.get("histories"):
            out[name] = (attrs, info)
    return out
