"""The item and user tables a bundle carries, against plain Python over the same rows."""

import random

import pyarrow as pa
import pytest

from sampan.config import FeaturesConfig
from sampan.data.entities import entity_keys, entity_tables, histories
from sampan.data.roles import ColumnRoles

FEATURES = FeaturesConfig.model_validate({
    "label": "label", "group": "user_id",
    "categorical": ["user_id", "item_id", "category_id", "brand", "hour"],
    "numeric": ["price"],
    "lists": [{"name": "hist_item_id", "share": "item_id", "max_len": 4},
              {"name": "hist_category_id", "share": "category_id", "max_len": 4},
              {"name": "tags", "kind": "bag", "max_len": 3}]})
ROLES = ColumnRoles(numeric=["label", "price", "ts"],
                    categorical=["user_id", "item_id", "category_id", "brand", "hour"],
                    lists=["hist_item_id", "hist_category_id", "tags"])


def rows(seed: int, n: int = 400) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = rng.randrange(30)
        u = rng.randrange(25)
        h = [str(rng.randrange(30)) for _ in range(rng.randrange(6))]
        out.append({"user_id": f"u{u}", "item_id": str(i), "category_id": f"c{i % 7}",
                    "brand": f"b{i % 5}" if i % 9 else None,  # missing for some items
                    "price": float(i) if rng.random() < 0.8 else float(i) + 0.5,  # varies
                    "hour": str(rng.randrange(24)), "ts": float(rng.randrange(50)),
                    "label": float(rng.random() < 0.4),
                    "hist_item_id": h, "hist_category_id": [f"c{int(x) % 7}" for x in h],
                    # a bag that is an item attribute (empty for some items)
                    "tags": [f"t{k}" for k in range(i % 3)]})
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tables_match_plain_python(seed):
    data = rows(seed)
    table = pa.Table.from_pylist(data)
    user, item = entity_keys(FEATURES, None)
    assert (user, item) == ("user_id", "item_id")
    out = entity_tables(table, FEATURES, ROLES, user, item, ["ts"], ["ts"])
    items, info = out["items"]
    # one value per item (nulls aside): category, brand and the tags bag; price varies,
    # hour is context
    assert info["columns"] == ["category_id", "brand", "tags"]
    got = {r["item_id"]: (r["category_id"], r["brand"], r["tags"])
           for r in items.to_pylist()}
    want = {}
    for r in data:
        c, b, t = want.get(r["item_id"], (None, None, None))
        want[r["item_id"]] = (r["category_id"], r["brand"] or b, r["tags"])
    assert got == want
    users, info = out["users"]
    assert info["columns"] == [] and [h["column"] for h in info["histories"]] == [
        "hist_item_id", "hist_category_id"]
    latest = {}
    for n, r in enumerate(data):  # the latest (ts, then positive, then file order) row
        k = (r["ts"], r["label"], n)
        if r["user_id"] not in latest or k > latest[r["user_id"]][0]:
            latest[r["user_id"]] = (k, r)
    got = {r["user_id"]: (r["hist_item_id"], r["hist_category_id"]) for r in users.to_pylist()}
    assert set(got) == set(latest)
    for u, (_, r) in latest.items():
        extra = r["label"] == 1.0
        assert got[u] == ((r["hist_item_id"] + [r["item_id"]] * extra)[-4:],
                          (r["hist_category_id"] + [r["category_id"]] * extra)[-4:]), u


def test_histories_are_shared_sequences_only():
    assert [(h.column, h.event, h.max_len) for h in histories(FEATURES)] == [
        ("hist_item_id", "item_id", 4), ("hist_category_id", "category_id", 4)]
    # a named item feature wins over item_id; no user without group or user_id
    f = FeaturesConfig.model_validate({"label": "y", "categorical": ["a", "b"]})
    assert entity_keys(f, "b") == (None, "b")
    assert entity_keys(f, None) == (None, None)
