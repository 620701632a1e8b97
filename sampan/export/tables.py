"""The feature tables of a bundle (``features/items.parquet``, ``features/users.parquet``):
what the run's rows say about each item and user (:mod:`sampan.data.entities`), written at
export so that the server joins them to requests that give only ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sampan.data.entities import entity_keys, entity_tables, raw_columns
from sampan.data.rejects import RejectLog
from sampan.data.sources import read_source

FILES = {"items": "features/items.parquet", "users": "features/users.parquet"}


def model_keys(cfg: Any, model: Any, schema: Any) -> tuple[str | None, str | None]:
    """The run's ``(user, item)`` key columns: a sequence model's target item, a two-tower
    model's id columns, else ``features.group`` / columns named user_id and item_id; with
    no item column found that way, the one other id feature a side table is joined by
    (MovieLens' ``movie_id``, joined to ``movies.dat``)."""
    item = getattr(cfg.model, "target", None)
    user = None
    if getattr(model, "task", "binary") == "retrieval":
        item = schema.sparse[model.item_column].name
        user = schema.sparse[model.user_column].name
    user_key, item_key = entity_keys(cfg.features, item, user)
    if item_key is None:
        ids = set(raw_columns(cfg.features).values())
        joined = {j.by for j in cfg.data.joins if j.by in ids and j.by != user_key}
        if len(joined) == 1:
            item_key = joined.pop()
    return user_key, item_key


def write_feature_tables(art: Any, model: Any, schema: Any, out: Path) -> dict[str, Any]:
    """Read the run's data files again (the same reader and side tables as training) and
    write its item and user tables under ``out``; returns the manifest entry (``skipped``
    says why when there are none)."""
    cfg = art.cfg
    user, item = model_keys(cfg, model, schema)
    if user is None and item is None:
        return {"skipped": "the run has no user or item key column"}
    if cfg.data.format == "synthetic" or cfg.data.train is None:
        return {"skipped": "the run did not read data files (synthetic data or a stream)"}
    pipe = art.pipeline
    roles = pipe.roles()
    split = cfg.data.split
    log = RejectLog(None)
    specs = [s for s in (cfg.data.train, cfg.data.valid, cfg.data.test) if s]
    try:
        parts = [t for s in specs for t in read_source(cfg.data, s, roles, log)]
    except FileNotFoundError as e:  # the data moved since training: the bundle still works
        return {"skipped": f"the run's data could not be read again ({e})"}
    if not parts:
        return {"skipped": "the run's data files hold no usable rows"}
    table = pa.concat_tables(parts, promote_options="permissive")
    order = [split.column] if split.method == "time" and split.column else []
    exclude = [split.column] if split.column else []
    found = entity_tables(table, cfg.features, roles, user, item, order, exclude)
    entry: dict[str, Any] = {}
    for name, (t, info) in found.items():
        path = out / FILES[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, path)
        entry[name] = {"file": FILES[name], **info}
    return entry or {"skipped": "no column holds one value per user or item"}
