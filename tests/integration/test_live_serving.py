"""Live user state in serving: a DIN bundle of a small behaviour log, its feature tables,
events that append to users' histories (memory and a real redis-server), the TTL, and the
events route of a real server with its token, through the Python client."""

import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from sampan.client import Client, GrpcClient, ServingError
from sampan.config import load_serve_config
from sampan.errors import RequestError
from sampan.serving import Predictor
from sampan.serving.service import ConflictError, ServerState
from tests.conftest import Served, din_live_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return din_live_bundle(tmp_path_factory.mktemp("live"))


def histories(bundle):
    t = pq.read_table(bundle / "features" / "users.parquet").to_pydict()
    return {u: (h, c) for u, h, c in zip(t["user_id"], t["hist_item_id"],
                                         t["hist_category_id"], strict=True)}


def category(item):
    """Item ``i<n>`` has category ``c<n % 10>``; any other id has none (OOV)."""
    return f"c{int(item[1:]) % 10}" if item[:1] == "i" and item[1:].isdigit() else ""


def explicit(bundle, user, items, hist):
    """The candidates scored with the histories written out by hand."""
    return Predictor(bundle).predict([
        {"user_id": user, "item_id": i, "category_id": category(i),
         "hist_item_id": hist, "hist_category_id": [category(x) for x in hist]}
        for i in items])[:, 0]


CANDS = [f"i{i}" for i in range(0, 120, 7)]


def served(state, user):
    return state.rank_future({"user_id": user}, CANDS).future.result()[:, 0]


def test_events_append_like_training(bundle, tmp_path, capsys):
    users = histories(bundle)
    items = dict(zip(*pq.read_table(bundle / "features" / "items.parquet").to_pydict()
                     .values(), strict=True))
    assert all(items[i] == f"c{int(i[1:]) % 10}" for i in items)  # item i: category i%10
    state = ServerState(load_serve_config(raw={"bundle": str(bundle)}))
    try:
        user = next(u for u, (h, _) in users.items() if len(h) == 5)
        hist = list(users[user][0])
        # only the user id: the history comes from the bundle's user table
        assert np.abs(served(state, user) - explicit(bundle, user, CANDS, hist)).max() < 1e-6
        out = state.record_events([{"user_id": user, "item_id": "i33"},
                                   {"user_id": user, "item_id": "i41", "category_id": "c1"},
                                   {"user_id": "new-user", "item_id": 7}])
        assert out == {"accepted": 3, "users": 2, "warnings": [
            "item_id '7' not in the feature table keyed by item_id: category_id went into "
            "the history as unknown"]}  # items are i0, i1, ...: 7 is one no table holds
        hist = (hist + ["i33", "i41"])[-5:]  # the last max_len, most recent last
        assert np.abs(served(state, user) - explicit(bundle, user, CANDS, hist)).max() < 1e-6
        assert np.abs(served(state, "new-user") -
                      explicit(bundle, "new-user", CANDS, ["7"])).max() < 1e-6
        # an explicit history in the request wins over the live one
        f = state.rank_future({"user_id": user, "hist_item_id": [],
                               "hist_category_id": []}, CANDS).future
        assert np.abs(f.result()[:, 0] - explicit(bundle, user, CANDS, [])).max() < 1e-6
        # an item no table knows: its category is unknown (OOV), the histories stay aligned
        out = state.record_events([{"user_id": "new-user", "item_id": "never-seen"}])
        assert out["warnings"] == ["item_id 'never-seen' not in the feature table keyed by "
                                   "item_id: category_id went into the history as unknown"]
        got = state.live.lookup(__import__("pyarrow").array(["new-user"]))[0]
        assert got["hist_item_id"].to_pylist() == [["7", "never-seen"]]
        assert got["hist_category_id"].to_pylist() == [["", ""]]
        for bad, field in (([{"item_id": "i1"}], "user_id"),
                           ([{"user_id": "u1", "itemid": "i1"}], "itemid"),
                           ([{"user_id": "u1", "item_id": [1, 2]}], "item_id"),
                           ([{"user_id": "u1"}], "item_id"), ([], "events")):
            with pytest.raises(RequestError) as e:
                state.record_events(bad)
            assert e.value.field == field, (bad, str(e.value))
    finally:
        state.close()
    # per-worker memory cannot take events with --workers > 1
    multi = ServerState(load_serve_config(raw={"bundle": str(bundle), "workers": 2}))
    with pytest.raises(ConflictError, match="redis"):
        multi.record_events([{"user_id": "u1", "item_id": "i1"}])
    # ... which the first worker to start says, once for all of them
    from sampan.serving.workers import _events_note, _say_once

    note = _events_note(multi)
    assert note is not None and "409" in note and "feature_store.backend=redis" in note
    assert _events_note(state) is None  # one process: events are taken
    multi.close()
    for _ in range(3):
        _say_once(tmp_path / "events-note", note)
    assert capsys.readouterr().err.count("409") == 1


def test_ttl_forgets_a_quiet_user(bundle, monkeypatch):
    from types import SimpleNamespace

    import sampan.serving.live as live

    now = [time.time()]  # the store's clock, moved by the test (a loaded machine is slow)
    monkeypatch.setattr(live, "time", SimpleNamespace(time=lambda: now[0]))
    users = histories(bundle)
    old = next(u for u, (h, _) in users.items() if h)
    state = ServerState(load_serve_config(raw={"bundle": str(bundle), "feature_store": {
        "ttl_seconds": 0.5}}))
    try:
        assert np.abs(served(state, old) - explicit(bundle, old, CANDS, users[old][0])
                      ).max() < 1e-6
        state.record_events([{"user_id": "x5", "item_id": "i15"}])
        now[0] += 0.3
        state.record_events([{"user_id": "x6", "item_id": "i16"}])
        assert np.abs(served(state, "x6") - explicit(bundle, "x6", CANDS, ["i16"])).max() < 1e-6
        now[0] += 0.3  # x5's history and the bootstrapped ones have expired, x6's not yet
        for user, hist in (("x5", []), (old, []), ("x6", ["i16"])):
            assert np.abs(served(state, user) - explicit(bundle, user, CANDS, hist)
                          ).max() < 1e-6, user
        state.record_events([{"user_id": "x5", "item_id": "i25"}])  # starts again
        assert np.abs(served(state, "x5") - explicit(bundle, "x5", CANDS, ["i25"])).max() < 1e-6
    finally:
        state.close()


def test_redis_histories_are_shared_and_survive_a_restart(bundle, redis_url):
    users = histories(bundle)
    user = next(u for u, (h, _) in users.items() if len(h) >= 3)
    raw = {"bundle": str(bundle), "feature_store": {"backend": "redis", "url": redis_url}}
    mem = ServerState(load_serve_config(raw={"bundle": str(bundle)}))
    a = ServerState(load_serve_config(raw=raw))
    b = ServerState(load_serve_config(raw=raw))  # a second worker on the same Redis
    try:
        assert np.abs(served(a, user) - served(mem, user)).max() < 1e-6
        for st in (a, mem):
            st.record_events([{"user_id": user, "item_id": "i12"}])
        assert np.abs(served(b, user) - served(mem, user)).max() < 1e-6
        b.close()
        b = ServerState(load_serve_config(raw=raw))  # a restart: the event is kept
        assert np.abs(served(b, user) - served(mem, user)).max() < 1e-6
        hist = (list(users[user][0]) + ["i12"])[-5:]
        assert np.abs(served(b, user) - explicit(bundle, user, CANDS, hist)).max() < 1e-6
    finally:
        for st in (mem, a, b):
            st.close()


def test_events_route_token_and_clients(bundle):
    srv = Served([str(bundle)], env={"SAMPAN_EVENTS_TOKEN": "ev-token"})
    try:
        with Client(srv.url) as anon, Client(srv.url, events_token="ev-token") as c, \
                GrpcClient(srv.grpc, events_token="ev-token") as g, GrpcClient(srv.grpc) as ga:
            with pytest.raises(ServingError) as e:
                anon.events([{"user_id": "u1", "item_id": "i1"}])
            assert e.value.status == 401 and e.value.field == "authorization"
            with pytest.raises(ServingError) as e:
                ga.events([{"user_id": "u1", "item_id": "i1"}])
            assert e.value.status == "UNAUTHENTICATED"
            before = c.rank({"user_id": "fresh"}, CANDS, k=len(CANDS))
            assert c.events([{"user_id": "fresh", "item_id": "i3"}]).accepted == 1
            assert g.events([{"user_id": "fresh", "item_id": "i13"}]).users == 1
            after = c.rank({"user_id": "fresh"}, CANDS, k=len(CANDS))
            grpc_after = g.rank({"user_id": "fresh"}, CANDS, k=len(CANDS))
            # an item no table holds: said by both clients (its category goes in unknown)
            for client in (c, g):
                got = client.events([{"user_id": "other", "item_id": "nowhere"}])
                assert got.accepted == 1 and got.warnings == (
                    "item_id 'nowhere' not in the feature table keyed by item_id: "
                    "category_id went into the history as unknown",), got
            with pytest.raises(ServingError) as e:
                g.events([{"user_id": "fresh", "colour": "red"}])
            assert e.value.status == "INVALID_ARGUMENT" and e.value.field == "colour"
    finally:
        srv.stop()
    want = explicit(bundle, "fresh", CANDS, ["i3", "i13"])
    got = dict((i.item, i.score) for i in after.items)
    assert max(abs(got[c] - w) for c, w in zip(CANDS, want, strict=True)) < 1e-5
    assert before.ids != after.ids or [i.score for i in before.items] != [
        i.score for i in after.items]
    assert grpc_after.ids == after.ids


def test_eval_ranking_per_user_matches_plain_python(bundle):
    """`sampan eval RUN --ranking K` on raw rows: each user's rows ranked as one query."""
    import json

    from sampan.train.experiment import RunArtifacts
    from tests.integration.test_cli import sampan_here
    from tests.unit.test_metrics import _grouped_reference

    run = json.loads((bundle / "manifest.json").read_text())["run_dir"]
    samples = str(Path(run).parent / "samples.parquet")
    out = sampan_here("eval", run, "--data", samples, "--ranking", "3", check=True)
    got = json.loads(out.stdout)
    probs = RunArtifacts(run).predict(samples)[:, 0]
    t = pq.read_table(samples).to_pydict()
    want = _grouped_reference(probs.tolist(), t["label"], t["user_id"], 3)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def test_the_memory_store_holds_at_most_max_live_users(bundle):
    state = ServerState(load_serve_config(raw={"bundle": str(bundle), "feature_store": {
        "max_live_users": 3}}))
    try:
        for u in ("a", "b", "c", "a", "d"):  # "b" is then the least recently active
            state.record_events([{"user_id": u, "item_id": "i1"}])
        assert list(state.live._live) == ["c", "a", "d"]
        assert np.abs(served(state, "a") - explicit(bundle, "a", CANDS, ["i1", "i1"])
                      ).max() < 1e-6
        assert np.abs(served(state, "b") - explicit(bundle, "b", CANDS, [])).max() < 1e-6
    finally:
        state.close()
