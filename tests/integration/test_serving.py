"""The real server: `sampan serve` in its own process (uvicorn + gRPC), every route, reload
under concurrent traffic with zero failed requests, Prometheus output; and the Redis feature
store against a real redis-server."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from rich.console import Console

from sampan.config import load_config
from sampan.export import export_run
from sampan.serving import Predictor
from sampan.train.experiment import run_experiment
from tests import web
from tests.conftest import Served, free_port

TOKEN = "test-token"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """Two bundles (DeepFM and DCNv2) of a run with user and item side tables."""
    root = tmp_path_factory.mktemp("serve")
    rng = np.random.default_rng(0)
    users = root / "users.csv"
    users.write_text("user_id,age,city\n" + "".join(
        f"u{u},{rng.integers(18, 70)},c{u % 4}\n" for u in range(40)))
    items = root / "items.csv"
    items.write_text("item_id,price,brand\n" + "".join(
        f"i{i},{rng.random() * 50:.2f},b{i % 6}\n" for i in range(60)))
    events = root / "events.csv"
    u, i = rng.integers(0, 40, 4000), rng.integers(0, 60, 4000)
    y = (rng.random(4000) < np.where((u + i) % 3 == 0, 0.7, 0.2)).astype(int)
    events.write_text("label,user_id,item_id\n" + "".join(
        f"{a},u{b},i{c}\n" for a, b, c in zip(y, u, i, strict=True)))
    out = []
    for name in ("deepfm", "dcn_v2"):
        cfg = load_config(raw={
            "output_dir": str(root), "data": {"train": str(events), "joins": [
                {"path": str(users), "by": "user_id"}, {"path": str(items), "by": "item_id"}]},
            "features": {"categorical": ["user_id", "item_id", "city", "brand"],
                         "numeric": [{"name": "age", "standardize": True},
                                     {"name": "price", "log1p": True}]},
            "model": {"name": name, "embedding_dim": 8},
            "train": {"epochs": 2, "batch_size": 256, "progress": False,
                      "tensorboard": False}})
        run = run_experiment(cfg, run_dir=root / f"run-{name}",
                             console=Console(quiet=True))["run_dir"]
        out.append(export_run(run, root / f"bundle-{name}"))
    # a two-tower run on the positives, for /v1/recommend
    cfg = load_config(raw={
        "output_dir": str(root), "data": {"train": str(events), "joins": [
            {"path": str(users), "by": "user_id"}, {"path": str(items), "by": "item_id"}],
            "split": {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}},
        "features": {"categorical": ["user_id", "item_id", "city", "brand"],
                     "numeric": [{"name": "age", "standardize": True},
                                 {"name": "price", "log1p": True}]},
        "model": {"name": "two_tower", "item_features": ["item_id", "brand", "price"],
                  "embedding_dim": 8, "k": 10},
        "train": {"epochs": 2, "batch_size": 128, "progress": False, "tensorboard": False}})
    run = run_experiment(cfg, run_dir=root / "run-two_tower", console=Console(quiet=True))
    out.append(export_run(run["run_dir"], root / "bundle-two_tower"))
    return out


@pytest.fixture(scope="module")
def server(bundles, tmp_path_factory):
    srv = Served([str(bundles[0]), "--set", "max_body_bytes=200000",
                  "--set", f"retrieval_bundle={bundles[2]}", "--set", "max_wait_ms=1"],
                 env={"SAMPAN_ADMIN_TOKEN": TOKEN})
    yield srv.url, int(srv.grpc.rsplit(":", 1)[1])
    srv.stop()


def rank(url, user="u3", candidates=("i1", "i2", "i3", "i4", "i59", "never"), k=3):
    return web.post(f"{url}/v1/rank", json={"context": {"user_id": user},
                                              "candidates": list(candidates), "k": k})


def test_routes(server, bundles):
    url, _ = server
    assert web.get(f"{url}/healthz").json() == {"status": "ok"}
    ready = web.get(f"{url}/readyz").json()
    assert ready["model"] == "deepfm" and ready["labels"] == ["label"]
    # predict: the user's and item's attributes are joined from the feature store
    r = web.post(f"{url}/v1/predict", json={"records": [
        {"user_id": "u1", "item_id": "i2"}, {"user_id": "u5", "item_id": "i7"}]})
    assert r.status_code == 200, r.text
    got = np.array(r.json()["probabilities"])
    local = Predictor(bundles[0])
    want = local.predict([{"user_id": "u1", "item_id": "i2", "age": None, "city": None,
                           "price": None, "brand": None}])
    assert got.shape == (2, 1) and not np.allclose(got[0], want[0])  # joined, not missing
    # rank: top-k of the candidates, best first, scores equal to predict's
    r = rank(url)
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    assert len(items) == 3 and items[0]["score"] >= items[1]["score"] >= items[2]["score"]
    each = web.post(f"{url}/v1/predict", json={"records": [
        {"user_id": "u3", "item_id": c} for c in ("i1", "i2", "i3", "i4", "i59", "never")]})
    scores = dict(zip(("i1", "i2", "i3", "i4", "i59", "never"),
                      np.array(each.json()["probabilities"])[:, 0], strict=True))
    best = sorted(scores, key=lambda c: -scores[c])[:3]
    assert [it["item"] for it in items] == best
    assert all(abs(it["score"] - scores[it["item"]]) < 1e-6 for it in items)
    # a candidate named twice is ranked once
    twice = rank(url, candidates=(best[0], "i1", best[0], "i2", "i3", "i4"), k=6).json()
    assert sorted(it["item"] for it in twice["items"]) == ["i1", "i2", "i3", "i4"]


def test_request_errors(server):
    url, _ = server
    r = web.post(f"{url}/v1/predict", json={"records": [{"user_id": "u1", "colour": 1}]})
    assert r.status_code == 400 and r.json()["field"] == "colour"
    assert "for model 'deepfm'" in r.json()["error"]  # errors name the model
    r = web.post(f"{url}/v1/predict", json={"records": [{"user_id": "u1"}]})
    assert r.status_code == 400 and r.json()["field"] == "item_id"
    r = web.post(f"{url}/v1/predict", json={"records": [
        {"user_id": "u1", "item_id": "i1", "age": "old"}]})
    assert r.status_code == 400 and r.json()["field"] == "age"
    assert "is a string ('old'); expected a number" in r.json()["error"]
    # a JSON number is expected, as the OpenAPI document says: "42" is refused too
    r = web.post(f"{url}/v1/predict", json={"records": [
        {"user_id": "u1", "item_id": "i1", "age": "42"}]})
    assert r.status_code == 400 and r.json()["field"] == "age"
    r = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u1"}, "candidates": []})
    assert r.status_code == 422 and r.json()["field"] == "candidates"
    r = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u1"},
                                           "candidates": ["i1"], "k": 0})
    assert r.status_code == 422 and r.json()["field"] == "k"
    r = web.post(f"{url}/v1/predict", json={"records": [
        {"user_id": "u1", "item_id": "i1"}] * 20000})
    assert r.status_code == 413 and r.json()["field"] == "body"
    r = web.post(f"{url}/v1/admin/reload", json={"bundle": "/nowhere"})
    assert r.status_code == 401
    r = web.post(f"{url}/v1/admin/reload", json={"bundle": "  "},
                 headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and r.json()["field"] == "bundle"
    assert "the path is empty" in r.json()["error"]
    r = web.get(f"{url}/v1/predict")  # the wrong method: JSON, and what is allowed
    assert r.status_code == 405 and r.json()["field"] == "path"
    assert "POST" in r.headers["allow"]


def test_grpc(server, bundles):
    import grpc
    from google.protobuf.struct_pb2 import Struct

    from sampan.serving.grpc_server import stubs

    url, gport = server
    pb, svc = stubs()
    with grpc.insecure_channel(f"127.0.0.1:{gport}") as ch:
        stub = svc.ScoringStub(ch)
        rec = Struct()
        rec.update({"user_id": "u1", "item_id": "i2"})
        p = stub.Predict(pb.PredictRequest(records=[rec]))
        http = web.post(f"{url}/v1/predict", json={"records": [
            {"user_id": "u1", "item_id": "i2"}]}).json()
        assert abs(p.probabilities[0].values[0] - http["probabilities"][0][0]) < 1e-6
        ctx = Struct()
        ctx.update({"user_id": "u3"})
        r = stub.Rank(pb.RankRequest(context=ctx, candidates=["i1", "i2", "i3", "i4", "i59",
                                                                "never"], k=3))
        assert [i.item for i in r.items] == [i["item"] for i in rank(url).json()["items"]]
        # a context key no model reads is ignored, and said
        extra = Struct()
        extra.update({"user_id": "u3", "colour": 2})
        r2 = stub.Rank(pb.RankRequest(context=extra, candidates=["i1", "i2", "i3", "i4",
                                                                 "i59", "never"], k=3))
        assert [(i.item, i.score) for i in r2.items] == [(i.item, i.score) for i in r.items]
        assert list(r2.warnings) == ["context feature 'colour' is read by no served model "
                                     "(model 'deepfm'); it was ignored"]
        assert len(p.request_id) == 32 and p.variant == r.variant == "default"
        assert r.request_id != r2.request_id
        with pytest.raises(grpc.RpcError) as e:  # no feedback log on this server
            stub.Feedback(pb.FeedbackRequest(events=[pb.FeedbackEvent(
                request_id=r.request_id, item="i1", type="click")]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "feedback.dir" in e.value.details()



def test_reload_under_traffic_and_metrics(server, bundles):
    import grpc
    from google.protobuf.struct_pb2 import Struct

    from sampan.serving.grpc_server import stubs

    url, gport = server
    stop = threading.Event()
    failures, done = [], []
    pb, svc = stubs()

    def http_client():
        with httpx.Client() as c:
            while not stop.is_set():
                r = c.post(f"{url}/v1/rank", json={"context": {"user_id": "u7"},
                                                   "candidates": ["i1", "i2", "i3"], "k": 2})
                (done if r.status_code == 200 else failures).append(r.status_code)

    def grpc_client():
        with grpc.insecure_channel(f"127.0.0.1:{gport}") as ch:
            stub = svc.ScoringStub(ch)
            rec = Struct()
            rec.update({"user_id": "u1", "item_id": "i2"})
            while not stop.is_set():
                try:
                    stub.Predict(pb.PredictRequest(records=[rec]))
                    done.append("grpc")
                except grpc.RpcError as e:
                    failures.append(str(e))

    threads = [threading.Thread(target=http_client) for _ in range(4)] + \
        [threading.Thread(target=grpc_client) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = web.post(f"{url}/v1/admin/reload", json={"bundle": str(bundles[1])}, headers=auth,
                 timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "dcn_v2", r.text
    time.sleep(0.5)
    r = web.post(f"{url}/v1/admin/reload", json={"bundle": str(bundles[0])}, headers=auth,
                 timeout=60)
    assert r.status_code == 200
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    assert not failures and len(done) > 50
    text = web.get(f"{url}/metrics").text
    assert 'sampan_requests_total{route="/v1/rank",status="200"}' in text
    assert 'sampan_requests_total{route="/v1/admin/reload",status="200"} 2.0' in text
    assert 'sampan_model_info{bundle=' in text and 'model="deepfm"' in text
    assert 'model="dcn_v2"' not in text  # the old model's series is removed
    assert "sampan_batch_rows_count" in text and "sampan_request_seconds_bucket" in text
    batches = float(next(line.split()[-1] for line in text.splitlines()
                         if line.startswith("sampan_batch_requests_sum")))
    calls = float(next(line.split()[-1] for line in text.splitlines()
                       if line.startswith("sampan_batch_requests_count")))
    assert batches >= calls  # requests per model call, at least one


def test_redis_feature_store_matches_memory(bundles, redis_url):
    from sampan.config import load_serve_config
    from sampan.serving.rest import ServerState

    mem = ServerState(load_serve_config(raw={"bundle": str(bundles[0])}))
    red = ServerState(load_serve_config(raw={"bundle": str(bundles[0]), "feature_store": {
        "backend": "redis", "url": redis_url}}))
    try:
        # the bundle's own feature tables (the run's side tables, as it read them)
        assert type(red.store.tables).__name__ == "RedisTables"
        assert red.store.tables.size("user_id") == 40
        assert red.store.tables.size("item_id") == 60
        cands = ["i1", "i2", "i3", "i4", "i59", "never"]
        for user in ("u0", "u3", "unknown-user"):
            a = mem.rank_future({"user_id": user}, cands).future.result()
            b = red.rank_future({"user_id": user}, cands).future.result()
            np.testing.assert_allclose(a, b, atol=1e-6)
        # the user, repeated for every candidate, is read once; each candidate once
        def hmgets() -> int:
            return red.store.tables.client.info("commandstats").get(
                "cmdstat_hmget", {}).get("calls", 0)

        before = hmgets()
        red.rank_future({"user_id": "u3"}, cands + ["i7"] * 5).future.result()
        assert hmgets() - before == 1 + len(cands) + 1
        # the reply's warnings read what the request's lookup found: no read of their own
        for user, warned in (("u3", False), ("unknown-user", True)):
            red.rank_future({"user_id": user}, cands).future.result()
            before = hmgets()
            notes = red.context_warnings({"user_id": user})
            assert hmgets() == before
            assert any("'unknown-user' is not in the feature table" in n
                       for n in notes) == warned, notes
        before = hmgets()  # a user no request looked up is read
        assert any("'u-new' is not" in n for n in red.context_warnings({"user_id": "u-new"}))
        assert hmgets() - before == 1
    finally:
        mem.close()
        red.close()


def test_a_redis_store_that_is_down_is_named_not_the_bundle(bundles):
    import socket

    from sampan.config import load_serve_config
    from sampan.serving.rest import ServerState
    from sampan.serving.service import ServingBundleError

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    with pytest.raises(ServingBundleError) as e:
        ServerState(load_serve_config(raw={"bundle": str(bundles[0]), "feature_store": {
            "backend": "redis", "url": url}}))
    assert e.value.field == "feature_store"
    assert f"cannot reach the Redis feature store at {url} (feature_store.url)" in str(e.value)
    assert "bundle" not in str(e.value).split(":")[0]


def test_list_attributes_of_items_served_from_memory_and_redis(tmp_path, redis_url):
    """An item's bag (tags read from Parquet as lists) is in the bundle's item table, and a
    request with only ids is scored with it, from memory and from Redis alike."""
    import pyarrow as pa

    from sampan.config import load_serve_config
    from sampan.serving.rest import ServerState

    rng = np.random.default_rng(1)
    tags = {f"i{i}": [f"t{k}" for k in range(i % 4)] for i in range(30)}
    pq.write_table(pa.table({"item_id": list(tags), "tags": list(tags.values())}),
                   tmp_path / "items.parquet")
    u, i = rng.integers(0, 20, 3000), rng.integers(0, 30, 3000)
    y = (rng.random(3000) < np.where(i % 4 >= 2, 0.7, 0.2)).astype(float)
    pq.write_table(pa.table({"user_id": [f"u{a}" for a in u], "item_id": [f"i{b}" for b in i],
                             "label": y}), tmp_path / "events.parquet")
    cfg = load_config(raw={
        "output_dir": str(tmp_path), "data": {"train": str(tmp_path / "events.parquet"),
                                              "joins": [{"path": str(tmp_path / "items.parquet"),
                                                         "by": "item_id"}]},
        "features": {"categorical": ["user_id", "item_id"],
                     "lists": [{"name": "tags", "kind": "bag", "max_len": 4}]},
        "model": {"name": "fm", "embedding_dim": 8},
        "train": {"epochs": 1, "progress": False, "tensorboard": False}})
    run = run_experiment(cfg, run_dir=tmp_path / "run", console=Console(quiet=True))
    bundle = export_run(run["run_dir"], tmp_path / "bundle")
    items = pq.read_table(bundle / "features" / "items.parquet").to_pydict()
    assert dict(zip(items["item_id"], items["tags"], strict=True)) == tags
    mem = ServerState(load_serve_config(raw={"bundle": str(bundle)}))
    red = ServerState(load_serve_config(raw={"bundle": str(bundle), "feature_store": {
        "backend": "redis", "url": redis_url, "prefix": "lists"}}))
    try:
        got, _ = red.store.tables.columns("item_id", pa.array(["i3", "i0", "nope"]))
        assert got["tags"].to_pylist() == [["t0", "t1", "t2"], [], None]
        cands = [f"i{k}" for k in range(30)]
        a = mem.rank_future({"user_id": "u1"}, cands).future.result()
        b = red.rank_future({"user_id": "u1"}, cands).future.result()
        np.testing.assert_allclose(a, b, atol=1e-6)
        # what the tags say is scored: the same model with each item's tags given by hand
        want = Predictor(bundle).predict([{"user_id": "u1", "item_id": c, "tags": tags[c]}
                                          for c in cands])[:, 0]
        np.testing.assert_allclose(np.asarray(a).ravel(), want, atol=1e-6)
    finally:
        mem.close()
        red.close()


def test_recommend(server, bundles):
    """ANN candidates from the two-tower bundle, ranked by the served model."""
    import faiss

    from sampan.batch import Batch
    from sampan.train.experiment import RunArtifacts

    url, _ = server
    r = web.post(f"{url}/v1/recommend", json={"context": {"user_id": "u3"}, "n": 20,
                                                "k": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["retrieved"] == 20 and len(body["items"]) == 5
    # the 20 retrieved: brute force over the exported item vectors with the user vector of
    # the PyTorch model (from the run, not the bundle's ONNX user tower)
    manifest = json.loads((bundles[2] / "manifest.json").read_text())
    art = RunArtifacts(manifest["run_dir"])
    train = art.store.split("train")
    users = art.pipeline.categorical[0]
    assert users.spec.name == "user_id"
    uid = 2 + users.vocab_.to_pylist().index("u3")
    row = int(np.flatnonzero(train.sparse[:, 0] == uid)[0])
    b = train.take(np.array([row]))
    with torch.no_grad():
        u = art.model.eval().user_vectors(Batch(dense=torch.from_numpy(b.dense),
                                                sparse=torch.from_numpy(b.sparse)))[0].numpy()
    index = faiss.read_index(str(bundles[2] / "items.faiss"))
    vecs = index.reconstruct_n(0, index.ntotal)
    names = pq.read_table(bundles[2] / "items.parquet").column("item").to_pylist()
    brute = [names[i] for i in np.argsort(-(vecs @ u), kind="stable")[:20]]
    ranked = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u3"},
                                                "candidates": brute, "k": 5}).json()
    assert [i["item"] for i in body["items"]] == [i["item"] for i in ranked["items"]]
    assert all(abs(i["retrieval_score"] - float(vecs[names.index(i["item"])] @ u)) < 1e-4
               for i in body["items"])
    # one context for both models: a key neither reads is ignored and said, not an error
    r = web.post(f"{url}/v1/recommend", json={"context": {"user_id": "u3", "colour": 1},
                                                "n": 20, "k": 5})
    assert r.status_code == 200 and r.json()["items"] == body["items"]
    assert r.json()["warnings"] == ["context feature 'colour' is read by no served model "
                                    "(model 'deepfm' and retrieval model 'two_tower'); it "
                                    "was ignored"]


def test_reload_reaches_every_worker(bundles):
    """`--workers 2`: a reload taken by one worker is served by both within a second (the
    ranking bundle and the retrieval bundle), a bad bundle reaches neither, and a worker
    that uvicorn starts again serves the current bundles and drops the dead one's model
    gauge from /metrics."""
    import signal

    port = free_port()
    env = {**os.environ, "SAMPAN_ADMIN_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sampan.cli", "serve", str(bundles[0]), "--port", str(port),
         "--workers", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    url = f"http://127.0.0.1:{port}"

    def ready():  # a new connection each time, so either worker may answer
        try:
            r = web.get(f"{url}/readyz", timeout=5)
            return r.json() if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def answers(n=60):
        got = [ready() for _ in range(n)]
        return [g for g in got if g is not None]

    try:
        seen: dict[int, str] = {}
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"server exited: {proc.stdout.read()}")
            g = ready()
            if g is not None:
                seen[g["worker"]] = g["model"]
            if len(seen) == 2:
                break
            time.sleep(0.05)
        assert len(seen) == 2 and set(seen.values()) == {"deepfm"}, seen
        # /metrics adds up every worker's counts, whichever worker answers
        for _ in range(40):  # a new connection each: both workers take some
            assert web.post(f"{url}/v1/predict", json={"records": [
                {"user_id": "u1", "item_id": "i2"}]}).status_code == 200
        for _ in range(4):
            text = web.get(f"{url}/metrics").text
            assert 'sampan_requests_total{route="/v1/predict",status="200"} 40.0' in text
        assert sum(line.startswith("sampan_model_info{") and line.endswith(" 1.0")
                   for line in text.splitlines()) == 2  # one per worker (pid label)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = web.post(f"{url}/v1/admin/reload", json={"bundle": str(bundles[1])},
                     headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["generation"] == 1 and r.json()["workers"] == 2
        deadline = time.time() + 10
        while time.time() < deadline:
            got = answers(20)
            if {g["model"] for g in got} == {"dcn_v2"} and len({g["worker"] for g in got}) == 2:
                break
            time.sleep(0.2)
        got = answers()
        assert {g["model"] for g in got} == {"dcn_v2"}, got
        assert {g["worker"] for g in got} == set(seen)
        # a bundle that does not load is refused by the worker that takes the request and
        # never published: every worker keeps serving dcn_v2
        r = web.post(f"{url}/v1/admin/reload", json={"bundle": str(bundles[0]) + "-nope"},
                     headers=auth, timeout=60)  # no bundle there: 404
        assert r.status_code == 404 and r.json()["field"] == "bundle"
        r = web.post(f"{url}/v1/admin/reload", json={"bundle": str(bundles[1]),
                                                       "retrieval_bundle": str(bundles[0])},
                     headers=auth, timeout=60)  # a ranking bundle is no retrieval bundle
        assert r.status_code == 400 and r.json()["field"] == "retrieval_bundle", r.text
        assert web.post(f"{url}/v1/admin/reload", json={}, headers=auth).status_code == 422
        time.sleep(1.0)
        assert {g["model"] for g in answers()} == {"dcn_v2"}
        # a retrieval bundle reloaded into a server started without one: /v1/recommend
        # then works on every worker
        rec = {"context": {"user_id": "u3"}, "n": 10, "k": 3}
        assert web.post(f"{url}/v1/recommend", json=rec).json()["field"] == \
            "retrieval_bundle"
        r = web.post(f"{url}/v1/admin/reload", json={"retrieval_bundle": str(bundles[2])},
                     headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["generation"] == 2, r.text
        assert "model" not in r.json() and "retrieval_version" in r.json()
        time.sleep(1.5)
        codes = [web.post(f"{url}/v1/recommend", json=rec).status_code for _ in range(30)]
        assert codes == [200] * 30, codes
        assert {g["model"] for g in answers()} == {"dcn_v2"}  # the ranking side unchanged
        # a bundle exported again to the same directory and reloaded reaches every worker
        same = bundles[0].parent / "bundle-in-place"
        for source, model in ((bundles[0], "deepfm"), (bundles[1], "dcn_v2")):
            shutil.rmtree(same, ignore_errors=True)
            shutil.copytree(source, same)
            r = web.post(f"{url}/v1/admin/reload", json={"bundle": str(same)},
                         headers=auth, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == model, r.text
            time.sleep(1.5)
            assert {g["model"] for g in answers()} == {model}
        # uvicorn replaces a worker that dies; the new one reads the shared file
        os.kill(next(iter(seen)), signal.SIGKILL)
        deadline = time.time() + 30
        fresh = None
        while time.time() < deadline and fresh is None:
            fresh = next((g for g in answers(10) if g["worker"] not in seen), None)
            time.sleep(0.2)
        assert fresh is not None, "uvicorn did not start a new worker"
        assert fresh["model"] == "dcn_v2"
        codes = [web.post(f"{url}/v1/recommend", json=rec).status_code for _ in range(20)]
        assert codes == [200] * 20, codes
        # the dead worker's model gauge is gone; its request counts stay in the totals
        dead = next(iter(seen))
        text = web.get(f"{url}/metrics").text
        info = [line for line in text.splitlines() if line.startswith("sampan_model_info{")]
        assert not [line for line in info if f'pid="{dead}"' in line], info
        assert sum(line.endswith(" 1.0") for line in info) == 2, info
        assert any(f'pid="{fresh["worker"]}"' in line for line in info), info
        assert 'sampan_requests_total{route="/v1/predict",status="200"} 40.0' in text
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_hostile_http_requests(server):
    """Issue 13: each of these crashed the server (plain-text 500, dropped connection) or
    was accepted before. Every reply is now JSON, the connection stays open, and /metrics
    counts them."""
    url, _ = server
    raw = {"content-type": "application/json"}
    with httpx.Client() as c:
        def post(path, body, **headers):
            return c.post(f"{url}{path}", content=body, headers={**raw, **headers})

        # a chunked body (no Content-Length) is cut off at max_body_bytes (200000 here)
        def chunks():
            for _ in range(100):  # 1 MB in all
                yield b" " * 10_000
        r = c.post(f"{url}/v1/predict", content=chunks(), headers=raw)
        assert r.status_code == 413 and r.json()["field"] == "body", r.text
        # a lone surrogate anywhere a string goes: value, key, rank candidate and context
        r = post("/v1/predict", b'{"records": [{"user_id": "\\ud800", "item_id": "i1"}]}')
        assert r.status_code == 400 and r.json()["field"] == "user_id", r.text
        assert "not valid Unicode" in r.json()["error"]
        r = post("/v1/predict", b'{"records": [{"\\udfff": "u1", "item_id": "i1"}]}')
        assert r.status_code == 400 and r.json()["field"] == "\udfff", r.text
        r = post("/v1/rank", b'{"context": {"user_id": "u1"}, "candidates": ["i1", "\\ud800"]}')
        assert r.status_code == 400 and r.json() == {
            "error": r.json()["error"], "field": "candidates", "record": 1}, r.text
        r = post("/v1/rank", b'{"context": {"user_id": "\\ud800x"}, "candidates": ["i1"]}')
        assert r.status_code == 400 and r.json()["field"] == "user_id", r.text
        auth = {"authorization": f"Bearer {TOKEN}"}
        for path in (b'"/tmp/\\ud800"', b'"/tmp/a\\u0000b"'):
            r = post("/v1/admin/reload", b'{"bundle": ' + path + b"}", **auth)
            assert r.status_code == 422 and r.json()["field"] == "bundle", r.text
        # a categorical given as an array or an object is refused, not turned into OOV
        for v in ('["u1"]', '{"id": "u1"}'):
            r = post("/v1/predict", b'{"records": [{"user_id": ' + v.encode() +
                     b', "item_id": "i1"}]}')
            assert r.status_code == 400 and r.json()["field"] == "user_id", r.text
            assert "expected a string, number or null" in r.json()["error"]
        # NaN is no JSON number: refused as the body is read, whatever feature it is for
        r = post("/v1/predict", b'{"records": [{"user_id": "u1", "item_id": "i1", '
                                b'"age": NaN}]}')
        assert r.status_code == 422 and r.json()["field"] == "body", r.text
        assert "holds NaN" in r.json()["error"]
        # malformed JSON says what and where
        r = post("/v1/predict", b'{"records": [{"user_id": ')
        assert r.status_code == 422 and r.json()["field"] == "body"
        assert r.json()["error"] == ("the request body is not valid JSON: Expecting value "
                                     "at character 25 (counting from 0)")
        # the admin token needs its scheme
        r = post("/v1/admin/reload", b'{"bundle": "/nowhere"}', authorization=TOKEN)
        assert r.status_code == 401 and "Bearer" in r.json()["error"]
        # the API description works (it was a 500: a forward reference in a route)
        assert c.get(f"{url}/openapi.json").status_code == 200
        assert c.get(f"{url}/docs").status_code == 200
        assert c.get(f"{url}/healthz").json() == {"status": "ok"}
    text = web.get(f"{url}/metrics").text
    assert 'sampan_requests_total{route="/v1/predict",status="413"}' in text
    assert 'sampan_requests_total{route="/v1/rank",status="400"} ' in text


def test_hostile_grpc_requests(server):
    """NaN, garbage bytes, an object where a value goes and k=-1: INVALID_ARGUMENT naming
    the field (they were UNKNOWN, INTERNAL and OK before), counted in /metrics."""
    import grpc
    from google.protobuf.struct_pb2 import Struct

    from sampan.serving.grpc_server import stubs

    url, gport = server
    pb, svc = stubs()

    def refused(call):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        return e.value.details()

    with grpc.insecure_channel(f"127.0.0.1:{gport}") as ch:
        stub = svc.ScoringStub(ch)
        rec = Struct()
        rec.update({"user_id": "u1", "item_id": "i2", "age": float("nan")})
        assert "age" in refused(lambda: stub.Predict(pb.PredictRequest(records=[rec])))
        rec = Struct()  # a categorical's NaN too (it was taken as the category "nan")
        rec.update({"user_id": float("inf"), "item_id": "i2"})
        assert "user_id: inf is not a finite number" in refused(
            lambda: stub.Predict(pb.PredictRequest(records=[rec])))
        rec = Struct()
        rec.update({"user_id": {"id": "u1"}, "item_id": "i2"})
        assert "user_id" in refused(lambda: stub.Predict(pb.PredictRequest(records=[rec])))
        garbage = ch.unary_unary("/sampan.v1.Scoring/Predict")
        assert "not a valid PredictRequest" in refused(lambda: garbage(b"\xff\xff\xff\x0f!"))
        ctx = Struct()
        ctx.update({"user_id": "u3"})
        assert "k must be at least 1" in refused(
            lambda: stub.Rank(pb.RankRequest(context=ctx, candidates=["i1"], k=-1)))
        assert len(stub.Rank(pb.RankRequest(context=ctx, candidates=["i1"])).items) == 1
    text = web.get(f"{url}/metrics").text
    assert 'sampan_requests_total{route="grpc/Predict",status="INVALID_ARGUMENT"} 4.0' in text
    assert 'sampan_requests_total{route="grpc/Rank",status="OK"}' in text


def test_unexpected_error_is_a_counted_json_500(bundles, capfd):
    """A bug inside a route (injected here) is a JSON 500 on a connection that stays open,
    counted in /metrics, with its traceback in the server's log; gRPC says INTERNAL."""
    import asyncio

    import grpc
    import uvicorn
    from google.protobuf.struct_pb2 import Struct

    from sampan.config import load_serve_config
    from sampan.serving.grpc_server import start_grpc, stubs
    from sampan.serving.rest import ServerState, create_app

    state = ServerState(load_serve_config(raw={"bundle": str(bundles[0])}))

    def broken(records, variant=None):
        raise KeyError("injected fault")

    state.predict_future = broken
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    gserver = start_grpc(state, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        with httpx.Client() as c:
            r = c.post(f"{url}/v1/predict", json={"records": [{"user_id": "u1"}]})
            assert r.status_code == 500 and "KeyError" in r.json()["error"], r.text
            assert c.get(f"{url}/healthz").status_code == 200  # the same connection
            assert 'route="/v1/predict",status="500"} 1.0' in c.get(f"{url}/metrics").text
        pb, svc = stubs()
        with grpc.insecure_channel(f"127.0.0.1:{gserver.port}") as ch:
            rec = Struct()
            rec.update({"user_id": "u1"})
            with pytest.raises(grpc.RpcError) as e:
                svc.ScoringStub(ch).Predict(pb.PredictRequest(records=[rec]))
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "KeyError" in e.value.details()
        assert "injected fault" in capfd.readouterr().err  # the traceback is logged
    finally:
        gserver.stop(grace=0)
        server.should_exit = True
        thread.join(timeout=10)
        state.close()


def test_an_onnx_server_runs_without_torch(bundles):
    """Serving an ONNX bundle (HTTP and gRPC, feature store, ranking) never loads torch:
    the bundle reader, the pipeline and the predictor are torch-free (about 150 MB of RSS
    instead of 330 MB)."""
    from benchmarks.serve_load import start_server

    proc, url = start_server(bundles[0], "--grpc-port", str(free_port()))
    try:
        assert rank(url).status_code == 200
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the server process loaded torch"
        assert "onnxruntime" in maps  # it did load its runtime: the check sees libraries
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_openapi_documents_every_route_with_examples(server):
    from sampan.serving.service import ROUTES

    url, _ = server
    r = web.get(f"{url}/openapi.json")
    assert r.status_code == 200
    spec = r.json()
    schemas = spec["components"]["schemas"]

    def examples(node):
        """The examples a schema (or the schema it refers to) carries."""
        if "$ref" in node:
            node = schemas[node["$ref"].rsplit("/", 1)[1]]
        return node.get("examples") or []

    for route in ROUTES:
        (method, op), = spec["paths"][route].items()
        ok = op["responses"]["200"]["content"]
        media = next(iter(ok.values()))
        assert media.get("example") is not None or examples(media["schema"]), route
        if method == "post" and route != "/v1/admin/rollback":
            body = op["requestBody"]["content"]["application/json"]["schema"]
            assert examples(body), route
            assert "400" in op["responses"] or route.startswith("/v1/admin"), route
    assert web.get(f"{url}/docs").status_code == 200


def test_feedback_log_joins_served_items_with_their_events(bundles, tmp_path):
    """Every response carries request_id and variant; the items it returned are logged with
    the features the model saw; POST /v1/feedback's clicks label them when the window
    closes; the log is what `sampan experiment report` reads."""
    from sampan.experiment.log import read_log
    from sampan.experiment.report import analyze

    log_dir = tmp_path / "feedback"
    srv = Served([str(bundles[0]), "--set", f"feedback.dir={log_dir}", "--set",
                  "feedback.window_seconds=1", "--set", "feedback.flush_seconds=0.2",
                  "--set", "max_wait_ms=1"])
    try:
        r = rank(srv.url, user="u3", k=3)
        assert r.status_code == 200 and r.headers["x-sampan-variant"] == "default"
        body = r.json()
        assert body["variant"] == "default" and len(body["request_id"]) == 32
        p = web.post(f"{srv.url}/v1/predict", json={"records": [
            {"user_id": "u1", "item_id": "i2"}, {"user_id": "u5", "item_id": "i7"}]}).json()
        assert p["request_id"] != body["request_id"]
        top = body["items"][0]["item"]
        ok = web.post(f"{srv.url}/v1/feedback", json={"events": [
            {"request_id": body["request_id"], "item": top, "type": "click"},
            {"request_id": body["request_id"], "item": top, "type": "click"},  # a repeat
            {"request_id": p["request_id"], "item": 1, "type": "click"}]})
        assert ok.status_code == 200 and ok.json() == {"accepted": 3}
        import grpc

        from sampan.serving.grpc_server import stubs

        pb, svc = stubs()
        with grpc.insecure_channel(srv.grpc) as ch:  # the same over gRPC: a conversion
            got = svc.ScoringStub(ch).Feedback(pb.FeedbackRequest(events=[pb.FeedbackEvent(
                request_id=body["request_id"], item=top, type="conversion")]))
            assert got.accepted == 1
        bad = web.post(f"{srv.url}/v1/feedback", json={"events": [
            {"request_id": body["request_id"], "item": top, "type": "like"}]})
        assert bad.status_code == 400 and "'like'" in bad.json()["error"]
        assert bad.json()["field"] == "type"
        rows: list = []
        for _ in range(100):  # the window (1 s), a flush and a joiner pass
            time.sleep(0.1)
            if any(log_dir.rglob("part-*.parquet")):
                rows = read_log(log_dir).to_pylist()
                if len(rows) == 5:
                    break
        assert len(rows) == 5, rows
        by = {(r["request_id"], r["item"] or str(r["position"])): r for r in rows}
        clicked = by[(body["request_id"], top)]
        assert clicked["label"] == 1 and clicked["position"] == 0 and clicked["unit"] == "u3"
        assert clicked["conversion"] == 1 and clicked["click"] == 1
        assert clicked["score"] == pytest.approx(body["items"][0]["score"])
        assert clicked["age"] is not None and clicked["brand"] is not None  # joined features
        assert by[(p["request_id"], "1")]["label"] == 1 and by[(p["request_id"], "1")][
            "unit"] == "u5"
        assert sum(r["label"] for r in rows) == 2
        assert {r["model_version"] for r in rows} == {body["model_version"]}
        report = analyze(read_log(log_dir))
        assert report["arms"]["default"]["clicks"] == 2
        assert report["arms"]["default"]["impressions"] == 5
        # its counts, for a dashboard and for a person
        metrics = web.get(f"{srv.url}/metrics").text
        assert 'sampan_feedback_rows_total{outcome="written"} 5.0' in metrics
        assert 'sampan_feedback_rows_total{outcome="duplicate"} 1.0' in metrics
        assert 'sampan_feedback_journal_total{kind="served"} 5.0' in metrics
        assert 'sampan_feedback_pending{what="items"} 0.0' in metrics
        fb = web.get(f"{srv.url}/readyz").json()["feedback"]
        assert fb["journal"]["served"] == 5 and fb["joiner"]["written"] == 5
        # the Python clients carry the request id and arm, and send feedback
        from sampan.client import Client, GrpcClient, ServingError

        with Client(srv.url) as c, GrpcClient(srv.grpc) as g:
            for client in (c, g):
                r = client.rank({"user_id": "u7"}, ["i1", "i2", "i3"], k=2)
                assert len(r.request_id) == 32 and r.variant == "default"
                assert client.feedback([{"request_id": r.request_id, "item": r.ids[0],
                                         "type": "click"}]) == 1
                p = client.predict([{"user_id": "u7", "item_id": "i1"}])
                assert p.request_id and p.request_id != r.request_id
                # an event without its request id: the same refusal from both clients
                with pytest.raises(ServingError, match=r"events.0.request_id") as e:
                    client.feedback([{"user_id": "u7", "item_id": "i1"}])
                assert e.value.field.startswith("events.0.")
    finally:
        srv.stop()


def test_feedback_without_a_log_is_refused(server):
    url, _ = server
    r = web.post(f"{url}/v1/feedback", json={"events": [
        {"request_id": "x", "item": "i1", "type": "click"}]})
    assert r.status_code == 409 and "feedback.dir" in r.json()["error"]


def test_an_experiment_keeps_each_user_in_one_arm(bundles, tmp_path):
    """--variant arms: each user's arm is the salted hash's, the same on every request,
    after a restart and in every one of 2 workers; a forced request is marked; a weight
    change moves users one way only; the feedback log and report see the arms."""
    from sampan.experiment.log import read_log
    from sampan.experiment.report import report
    from sampan.serving.variants import Allocation

    log_dir = tmp_path / "feedback"
    args = ["--variant", f"control={bundles[0]}:50", "--variant", f"candidate={bundles[1]}:50",
            "--experiment", "exp1", "--set", f"feedback.dir={log_dir}", "--set",
            "feedback.window_seconds=1", "--set", "feedback.flush_seconds=0.2"]
    users = [f"u{i}" for i in range(40)] + [f"new{i}" for i in range(60)]
    want = Allocation.from_weights([("control", 50), ("candidate", 50)])

    def arms(url, who=users):
        out = {}
        for u in who:
            r = rank(url, user=u, k=2)
            assert r.status_code == 200, r.text
            assert r.headers["x-sampan-variant"] == r.json()["variant"]
            out[u] = r.json()["variant"]
        return out

    srv = Served(args, env={"SAMPAN_ADMIN_TOKEN": TOKEN}, grpc=False)
    try:
        first = arms(srv.url)
        assert first == {u: want.arm_of("exp1", u) for u in users}
        assert arms(srv.url) == first  # sticky
        versions = {rank(srv.url, user=u).json()["model_version"] for u in users[:20]}
        assert len(versions) == 2  # two bundles, two versions
        ready = web.get(f"{srv.url}/readyz").json()["experiment"]
        assert ready["buckets"] == {"control": 5000, "candidate": 5000}
        # QA: a forced arm, by header or body; marked, counted
        u = next(x for x in users if first[x] == "control")
        r = web.post(f"{srv.url}/v1/rank", json={"context": {"user_id": u},
                                                   "candidates": ["i1", "i2"]},
                     headers={"X-Sampan-Variant": "candidate"})
        assert r.json()["variant"] == "candidate"
        for name in ("nope", ""):  # an empty name is no arm either, not "no variant"
            bad = web.post(f"{srv.url}/v1/rank", json={"context": {"user_id": u},
                                                         "candidates": ["i1"], "variant": name})
            assert bad.status_code == 400 and bad.json()["field"] == "variant"
        metrics = web.get(f"{srv.url}/metrics").text
        assert 'sampan_variant_requests_total{forced="true",variant="candidate"} 1.0' in metrics
        # 50/50 -> 20/80: 3,000 buckets move from control to candidate, none back
        h = {"Authorization": f"Bearer {TOKEN}"}
        assert web.post(f"{srv.url}/v1/admin/weights", json={"weights": {
            "control": 20}}, headers=h).status_code == 400  # every arm must be named
        w = web.post(f"{srv.url}/v1/admin/weights", json={"weights": {
            "control": 20, "candidate": 80}}, headers=h)
        assert w.status_code == 200 and w.json()["moved_buckets"] == 3000
        after = arms(srv.url)
        assert all(after[x] == "candidate" for x in users if first[x] == "candidate")
        assert sum(after[x] != first[x] for x in users) > 0
        rows: list = []
        for _ in range(100):
            time.sleep(0.1)
            if any(log_dir.rglob("part-*.parquet")):
                rows = read_log(log_dir).to_pylist()
                if len({r["request_id"] for r in rows}) >= 3 * len(users):
                    break
        forced = [r for r in rows if r["forced"]]
        assert len(forced) == 2 and {r["variant"] for r in forced} == {"candidate"}
        assert {r["variant"] for r in rows} == {"control", "candidate"}
    finally:
        out = srv.stop()
    assert "is kept over the weights given" not in out
    # a restart with 2 workers: the changed weights are read back, every worker agrees
    srv = Served([*args, "--workers", "2"], grpc=False)
    try:
        assert arms(srv.url) == after
        # the parent joins: the workers' /metrics read its saved counts (none lost)
        metrics = web.get(f"{srv.url}/metrics").text
        written = re.search(r'sampan_feedback_rows_total\{outcome="written"\} (\S+)', metrics)
        assert written is not None and float(written.group(1)) >= len(rows), metrics
    finally:
        out = " ".join(srv.stop().split())
    assert "(weights changed while serving) is kept over the weights given (control 50%, " \
        "candidate 50%)" in out, out
    rep = report(log_dir, tmp_path / "rep")  # shares from the saved experiment.json
    assert rep["srm"]["shares_given"] and rep["srm"]["shares"]["candidate"] == 0.8


def test_exploration_logs_propensities_that_ope_reads(bundles, tmp_path):
    """explore: epsilon puts a random candidate first with probability epsilon; every scored
    candidate is logged with its probability of going first (the unshown ones beside the
    log), and `sampan experiment ope` evaluates another bundle on that traffic."""
    from typer.testing import CliRunner

    from sampan.cli import app
    from sampan.experiment.log import read_log

    log_dir = tmp_path / "feedback"
    srv = Served([str(bundles[0]), "--set", f"feedback.dir={log_dir}", "--set",
                  "feedback.window_seconds=1", "--set", "feedback.flush_seconds=0.2",
                  "--set", "explore={method: epsilon, epsilon: 0.5}"], grpc=False)
    cands = ["i1", "i2", "i3", "i4", "i5", "i6"]
    rng = np.random.default_rng(0)
    best: dict[str, str] = {}  # the greedy first item of each user (one predict each)
    try:
        greedy = 0
        for n in range(240):
            user = f"u{n % 40}"
            body = rank(srv.url, user=user, candidates=cands, k=3).json()
            if user not in best:
                scores = np.array(web.post(f"{srv.url}/v1/predict", json={"records": [
                    {"user_id": user, "item_id": c} for c in cands]}).json()[
                    "probabilities"])[:, 0]
                best[user] = cands[int(scores.argmax())]
            greedy += body["items"][0]["item"] == best[user]
            if rng.random() < 0.3:
                web.post(f"{srv.url}/v1/feedback", json={"events": [{
                    "request_id": body["request_id"], "item": body["items"][0]["item"],
                    "type": "click"}]})
        # first = the best with probability 1 - 0.5 + 0.5 / 6 = 0.583 (240 draws: +-0.1)
        assert 0.48 < greedy / 240 < 0.69
        rows: list = []
        for _ in range(100):
            time.sleep(0.1)
            if any((log_dir / "_unshown").rglob("part-*.parquet")):
                rows = read_log(log_dir, unshown=True).to_pylist()
                if sum(r["item"] is not None for r in rows) >= 240 * 6:  # rank's rows
                    break
    finally:
        srv.stop()
    ranked = [r for r in rows if r["item"] is not None]
    by_req: dict = {}
    for r in ranked:
        by_req.setdefault(r["request_id"], []).append(r)
    assert len(by_req) == 240 and all(len(v) == 6 for v in by_req.values())
    for v in by_req.values():
        assert sum(r["propensity"] for r in v) == pytest.approx(1.0)
        assert sorted(r["position"] for r in v) == [-1, -1, -1, 0, 1, 2]
        best = max(v, key=lambda r: r["score"])
        assert best["propensity"] == pytest.approx(0.5 + 0.5 / 6)
    shown = read_log(log_dir)  # the report's view: shown items only
    assert {r["position"] for r in shown.to_pylist() if r["item"] is not None} == {0, 1, 2}
    out = tmp_path / "ope.json"
    r = CliRunner().invoke(app, ["experiment", "ope", str(log_dir), "--candidate",
                                 str(bundles[1]), "--resamples", "200", "--out", str(out)])
    assert r.exit_code == 0, r.output
    est = json.loads(out.read_text())
    assert est["requests"] == 240 and est["max_weight"] <= 1 / (0.5 / 6) + 1e-9
    assert 0.15 < est["logged_ctr"] < 0.45  # the clicks posted: 30 % of first items


def test_a_killed_server_loses_at_most_one_flush_interval_of_served_rows(bundles, tmp_path):
    """kill -9 of `sampan serve` under traffic: every item it answered before the last
    flush interval is in its journal; a joiner started afterwards writes each saved row
    once, the rows the killed server's own joiner wrote included."""
    from collections import Counter

    from sampan.experiment.log import read_log
    from sampan.serving.feedback import JOURNAL, Joiner

    flush = 0.2
    log_dir = tmp_path / "feedback"
    srv = Served([str(bundles[0]), "--set", f"feedback.dir={log_dir}", "--set",
                  f"feedback.flush_seconds={flush}", "--set", "feedback.window_seconds=0.5",
                  "--set", "max_wait_ms=1"], grpc=False)
    answered: list[tuple[str, int, float]] = []  # request id, items, when it came back
    stop = threading.Event()

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                try:
                    r = c.post(f"{srv.url}/v1/rank", json={
                        "context": {"user_id": f"u{rng.integers(40)}"},
                        "candidates": [f"i{i}" for i in rng.integers(0, 60, 8)], "k": 3})
                except httpx.HTTPError:
                    return  # the server is gone
                if r.status_code == 200:
                    answered.append((r.json()["request_id"], len(r.json()["items"]),
                                     time.time()))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(2.5)  # long enough for the server's joiner to write some rows itself
    srv.proc.kill()
    srv.proc.wait()
    killed = time.time()
    stop.set()
    for t in threads:
        t.join()
    srv.output()
    saved: Counter = Counter()
    for path in (log_dir / JOURNAL).glob("*.jsonl"):
        for line in path.read_bytes().split(b"\n"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the empty tail, or a line cut by the kill
            if rec.get("k") == "r":  # a response: its items
                saved[rec["request_id"]] += len(rec["items"]["item"])
    lost = [(rid, n, t) for rid, n, t in answered if saved[rid] < n]
    items = sum(n for _, n, _ in answered)
    print(f"answered {len(answered)} requests ({items} items); saved {sum(saved.values())} "
          f"items; lost {sum(n for _, n, _ in lost)} items of {len(lost)} requests, the "
          f"oldest {killed - min((t for *_, t in lost), default=killed):.2f} s before the "
          "kill")
    assert len(answered) > 100
    # what was answered before the last flush interval (and a margin for the scheduler on
    # a loaded machine) is on disk
    assert all(t >= killed - flush - 0.5 for _, _, t in lost), lost[:3]
    assert sum(saved.values()) >= items - sum(n for _, n, _ in lost)
    # the joiner of a restarted server writes the rest; nothing twice
    Joiner(log_dir, window_seconds=0.5, flush_seconds=flush).step(now=time.time() + 5)
    rows = read_log(log_dir).to_pylist()
    keys = [(r["request_id"], r["item"]) for r in rows]
    assert len(keys) == len(set(keys)) == sum(saved.values())


def test_a_bundle_without_feature_tables_keeps_the_arms(bundles, tmp_path):
    """A version trained where the rows carried the side tables' features (a stream from
    the feedback log) and exported without tables or joins, as `sampan stream` publishes:
    swapped into an arm, requests keep their features from the arm's tables."""
    import csv

    from sampan.config import load_serve_config
    from sampan.serving.service import ServerState

    root = bundles[0].parent
    users = {r["user_id"]: r for r in csv.DictReader(open(root / "users.csv"))}
    items = {r["item_id"]: r for r in csv.DictReader(open(root / "items.csv"))}
    rows = list(csv.DictReader(open(root / "events.csv")))[:1500]
    inline = tmp_path / "logged.csv"
    with open(inline, "w", newline="") as f:
        w = csv.DictWriter(f, ["label", "user_id", "item_id", "age", "city", "price",
                               "brand"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, **users[r["user_id"]], **items[r["item_id"]]})
    cfg = load_config(raw={
        "output_dir": str(tmp_path), "data": {"train": str(inline)},
        "features": {"categorical": ["user_id", "item_id", "city", "brand"],
                     "numeric": [{"name": "age", "standardize": True},
                                 {"name": "price", "log1p": True}]},
        "model": {"name": "deepfm", "embedding_dim": 8},
        "train": {"epochs": 1, "batch_size": 256, "progress": False, "tensorboard": False}})
    run = run_experiment(cfg, run_dir=tmp_path / "run", console=Console(quiet=True))["run_dir"]
    version = export_run(run, tmp_path / "v000001", feature_tables=False)
    state = ServerState(load_serve_config(raw={"bundle": str(bundles[0])}))
    try:
        state.load(str(version))
        predictor, store = state.current()
        assert predictor.bundle.path == version.resolve() and store.tables is not None
        got = state.rank_future({"user_id": "u3"}, ["i1", "i2"]).future.result()[:, 0]
        want = Predictor(version).predict([
            {"user_id": "u3", "item_id": i, "age": float(users["u3"]["age"]),
             "city": users["u3"]["city"], "price": float(items[i]["price"]),
             "brand": items[i]["brand"]} for i in ("i1", "i2")])[:, 0]
        np.testing.assert_allclose(got, want, atol=1e-6)
    finally:
        state.close()


def test_bodies_that_are_not_plain_json_are_refused_by_name(server):
    """Issue 45 items 4, 6 and 7: valid JSON that a client should not send gets an answer
    that says what is wrong with it, not 'not valid JSON' or a silent guess."""
    url, _ = server

    def post(body: bytes, content_type: str | None = "application/json"):
        headers = {"content-type": content_type} if content_type else {}
        return web.post(f"{url}/v1/rank", content=body, headers=headers)

    ok = b'{"context": {"user_id": "u3"}, "candidates": ["i1", "i2"], "k": 1}'
    assert post(ok).status_code == 200
    refused = [
        (b'{"context": {"user_id": "u3", "user_id": "u4"}, "candidates": ["i1"]}', 422,
         "repeats the key 'user_id'"),
        (b'{"context": {"user_id": NaN}, "candidates": ["i1"]}', 422, "holds NaN"),
        (b'{"context": {"age": -Infinity}, "candidates": ["i1"]}', 422, "holds -Infinity"),
        (b'{"context": {"user_id": 1e400}, "candidates": ["i1"]}', 422,
         "the number 1e400, which is too large"),
        (b"[" * 30000 + b"]" * 30000, 422, "nests arrays or objects more than 64 deep"),
        (b'{"context": {"user_id": ' + b"9" * 5000 + b'}, "candidates": ["i1"]}', 422,
         "an integer of more than 4,300 digits"),
        (b"\xef\xbb\xbf" + ok, 422, "byte-order mark"),
        (ok.decode().encode("utf-16"), 422, "byte-order mark"),
    ]
    for body, status, words in refused:
        r = post(body)
        assert (r.status_code, r.json()["field"]) == (status, "body"), (body[:40], r.text)
        assert words in r.json()["error"], r.text
    for content_type, words in ((None, "the request had no content-type"),
                                ("text/plain", "got content-type 'text/plain'"),
                                ("application/x-www-form-urlencoded", "x-www-form"),
                                ("application/json; charset=latin-1", "charset 'latin-1'")):
        r = post(ok, content_type)
        assert r.status_code == 415 and words in r.json()["error"], r.text
    # a candidate that is neither a string nor an integer, named by its position
    r = post(b'{"context": {"user_id": "u3"}, "candidates": [true, "i2"]}')
    assert r.status_code == 422 and r.json()["field"] == "candidates.0", r.text
    r = post(b'{"context": {"user_id": "u3"}, "candidates": ["i1", 2.5]}')
    assert r.status_code == 422 and r.json()["field"] == "candidates.1", r.text


def test_thousands_of_unread_context_keys_get_a_few_warnings(server):
    url, _ = server
    context = {"user_id": "u3", **{f"junk{i}": i for i in range(5000)}}
    r = web.post(f"{url}/v1/rank", json={"context": context, "candidates": ["i1"]})
    assert r.status_code == 200, r.text
    warnings = r.json()["warnings"]
    assert len(warnings) == 21 and "'junk0' is read by no served model" in warnings[0]
    assert warnings[-1].startswith("... and 4,980 more context features")
    r = web.post(f"{url}/v1/admin/reload", json={"bundle": "/nowhere/" + "x" * 100_000},
                 headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and len(r.text) < 3000, r.text[:300]


def test_recommend_warns_about_a_user_the_retrieval_model_never_saw(server):
    """Issue 45 item 15: an unknown user got recommendations with no warning."""
    url, gport = server
    r = web.post(f"{url}/v1/recommend", json={"context": {"user_id": "u999"}, "n": 10,
                                                "k": 3})
    assert r.status_code == 200, r.text
    assert any("user_id 'u999' is unknown to the retrieval model" in w
               for w in r.json()["warnings"]), r.json()["warnings"]
    assert len(r.json()["items"]) == 3  # still answered: the candidates of an unseen user
    known = web.post(f"{url}/v1/recommend", json={"context": {"user_id": "u3"}, "n": 10})
    assert not any("unknown" in w for w in known.json()["warnings"])
    import grpc
    from google.protobuf.struct_pb2 import Struct

    from sampan.serving.grpc_server import stubs

    pb, svc = stubs()
    ctx = Struct()
    ctx.update({"user_id": "u999"})
    with grpc.insecure_channel(f"127.0.0.1:{gport}") as ch:
        reply = svc.ScoringStub(ch).Recommend(pb.RecommendRequest(context=ctx, n=10, k=3))
    assert any("'u999' is unknown" in w for w in reply.warnings)
    # ranking: a user its user table does not hold is said too (its features are missing)
    r = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u999"},
                                         "candidates": ["i1", "i2"]})
    assert r.status_code == 200 and r.json()["warnings"] == [
        "user_id 'u999' is not in the feature table keyed by user_id: its features (city, "
        "age) were scored as missing values"], r.json()
    # ... unless the request gives them (a new user's own attributes): only what it lacks
    r = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u999", "city": "c1"},
                                         "candidates": ["i1", "i2"]})
    assert r.json()["warnings"] == [
        "user_id 'u999' is not in the feature table keyed by user_id: its features (age) "
        "were scored as missing values"], r.json()
    r = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u999", "city": "c1",
                                                     "age": 30}, "candidates": ["i1", "i2"]})
    assert r.json()["warnings"] == [], r.json()
    r = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u3"},
                                         "candidates": ["i1", "i2"]})
    assert r.json()["warnings"] == []
    # a misspelt user key: the error names it and the key it is nearest, and asks only for
    # what the feature store cannot bring
    r = web.post(f"{url}/v1/recommend", json={"context": {"userid": "u3"}, "k": 3})
    assert r.status_code in (400, 422), r.text
    assert "it gave 'userid' (did you mean 'user_id'?)" in r.json()["error"], r.json()
    assert "every request needs ['user_id']" in r.json()["error"], r.json()
    r = web.post(f"{url}/v1/rank", json={"context": {"userid": "u3"}, "candidates": ["i1"]})
    assert "did you mean 'user_id'?" in r.json()["error"], r.json()
    # counts that change the reply are said: a candidate named twice, n below k
    r = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u3"},
                                         "candidates": ["i1", "i2", "i1", "i3", "i3", "i1"]})
    assert sorted(i["item"] for i in r.json()["items"]) == ["i1", "i2", "i3"]
    assert r.json()["warnings"] == [
        "candidate 'i1' was given 3 times and 1 more: each candidate is ranked once, at "
        "its first place"]
    r = web.post(f"{url}/v1/recommend", json={"context": {"user_id": "u3"}, "n": 2, "k": 5})
    assert len(r.json()["items"]) <= 2 and "n 2 is smaller than k 5: at most 2 items come " \
        "back" in r.json()["warnings"][0]
    with grpc.insecure_channel(f"127.0.0.1:{gport}") as ch:
        reply = svc.ScoringStub(ch).Recommend(pb.RecommendRequest(context=ctx, n=3))
    assert any("n 3 is smaller than k 10" in w for w in reply.warnings)


def _held_request(url: str, path: str, length: int):
    """A POST whose body is announced (Content-Length) and not yet sent: the server holds
    it in flight until :func:`_finish` sends the body."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {length}\r\n\r\n".encode())
    return s


def _finish(s, body: bytes) -> int:
    s.sendall(body)
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += s.recv(65536)
    s.close()
    return int(reply.split(b" ", 2)[1])


def test_work_in_flight_is_bounded_with_503_and_counted(bundles):
    """Issue 45 item 1: past max_inflight requests, or max_inflight_bytes of bodies, a
    request is refused at once with 503 and Retry-After (its body unread) and counted in
    /metrics; a worker with nothing in flight takes any request the body limit allows."""
    srv = Served([str(bundles[0]), "--set", "max_inflight=2", "--set",
                  "max_inflight_bytes=1000", "--set", "max_wait_ms=1"])
    ok = {"records": [{"user_id": "u1", "item_id": "i2"}]}
    try:
        big = json.dumps({"records": [{"user_id": "u1", "item_id": "i2"}] * 100}).encode()
        assert len(big) > 1000  # alone, over max_inflight_bytes: taken all the same
        assert web.post(f"{srv.url}/v1/predict", content=big, headers={
            "content-type": "application/json"}).status_code == 200
        body = json.dumps(ok).encode()
        held = _held_request(srv.url, "/v1/predict", 800)
        time.sleep(0.3)
        r = web.post(f"{srv.url}/v1/predict", content=b" " * 300 + body,
                     headers={"content-type": "application/json"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["field"] == "max_inflight_bytes"
        assert "max_inflight_bytes: 1000 body bytes" in r.json()["error"]
        assert web.post(f"{srv.url}/v1/predict", json=ok).status_code == 200  # fits
        second = _held_request(srv.url, "/v1/rank", 10)
        time.sleep(0.3)
        r = web.post(f"{srv.url}/v1/predict", json=ok)
        assert r.status_code == 503 and r.json()["field"] == "max_inflight"
        assert web.get(f"{srv.url}/healthz").status_code == 200  # not a scoring route
        assert _finish(held, body + b" " * (800 - len(body))) == 200
        assert _finish(second, b"{}" + b" " * 8) == 422
        assert web.post(f"{srv.url}/v1/predict", json=ok).status_code == 200
        metrics = web.get(f"{srv.url}/metrics").text
        assert 'sampan_overloaded_total{limit="max_inflight_bytes",route="/v1/predict"} 1.0' \
            in metrics
        assert 'sampan_overloaded_total{limit="max_inflight",route="/v1/predict"} 1.0' \
            in metrics
        assert 'sampan_requests_total{route="/v1/predict",status="503"} 2.0' in metrics
    finally:
        srv.stop()


def test_grpc_takes_messages_as_large_as_rest_and_counts_unknown_methods(bundles):
    """Issue 45 item 8: gRPC refused a 5 MB Predict (its default 4 MiB cap) that REST took;
    a call to a method the service lacks was not counted. Messages are now held to REST's
    max_body_bytes (default 8 MiB)."""
    import grpc
    from google.protobuf.struct_pb2 import Struct

    from sampan.serving.grpc_server import stubs

    srv = Served([str(bundles[0]), "--set", "max_wait_ms=1"])
    pb, svc = stubs()
    rec = Struct()
    rec.update({"user_id": "u1", "item_id": "i2", "city": "c" * 600})
    try:
        with grpc.insecure_channel(srv.grpc, options=[
                ("grpc.max_send_message_length", -1)]) as ch:
            request = pb.PredictRequest(records=[rec] * 7000)
            assert 4 << 20 < request.ByteSize() < 8 << 20
            reply = svc.ScoringStub(ch).Predict(request)
            assert len(reply.probabilities) == 7000
            with pytest.raises(grpc.RpcError) as e:  # past max_body_bytes, as REST's 413
                svc.ScoringStub(ch).Predict(pb.PredictRequest(records=[rec] * 14000))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            missing = ch.unary_unary("/sampan.v1.Scoring/Nope")
            with pytest.raises(grpc.RpcError) as e:
                missing(b"")
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        metrics = web.get(f"{srv.url}/metrics").text
        assert 'sampan_requests_total{route="grpc/other",status="UNIMPLEMENTED"} 1.0' \
            in metrics
    finally:
        srv.stop()


def test_openapi_examples_are_the_bundles_and_codes_are_complete(server):
    """Issue 45 item 3: the document's examples used user_id / item_id whatever the bundle
    read, and left out status codes the server returns. Each example is now sent as it is
    and answered 200."""
    url, _ = server
    doc = web.get(f"{url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    routes = {"PredictRequest": "/v1/predict", "RankRequest": "/v1/rank",
              "RecommendRequest": "/v1/recommend"}  # events: no live history here
    record = schemas["PredictRequest"]["examples"][0]["records"][0]
    # what a record must give: the user and the item (their tables bring age, city, price
    # and brand), typed as the server takes them
    assert set(record) == {"user_id", "item_id"}
    items = schemas["PredictRequest"]["properties"]["records"]["items"]
    assert set(items["required"]) == {"user_id", "item_id"}
    assert items["additionalProperties"] is False
    assert items["properties"]["user_id"]["type"] == ["string", "number", "boolean", "null"]
    context = schemas["RankRequest"]["properties"]["context"]
    assert context["required"] == ["user_id"] and context["additionalProperties"] is True
    # a record may still give what a table brings (it overrides the table)
    r = web.post(f"{url}/v1/predict", json={"records": [
        {**record, "age": 30, "city": "c1", "price": 9.5, "brand": "b1"}]})
    assert r.status_code == 200, r.text
    for name, route in routes.items():
        body = schemas[name]["examples"][0]
        r = web.post(f"{url}{route}", json=body)
        assert r.status_code == 200, (name, body, r.text)
    paths = doc["paths"]
    codes = {p: set(paths[p]["post"]["responses"]) for p in paths if "post" in paths[p]}
    assert {"401", "403", "400", "409"} <= codes["/v1/admin/reload"]
    assert {"401", "403", "409"} <= codes["/v1/admin/rollback"]
    for route in ("/v1/predict", "/v1/rank", "/v1/recommend", "/v1/events"):
        assert {"413", "503"} <= codes[route], route
    assert "503" in paths["/readyz"]["get"]["responses"]


def _raw_http(url: str, request: bytes) -> bytes:
    """Send bytes as they are and read until the server closes the connection."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(request)
        except OSError:  # the server may answer and close before taking all of it
            pass
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_requests_that_are_not_http_get_a_json_error(server):
    """Issue 45 item 10: uvicorn answered these with text/plain "Invalid HTTP request
    received."; every error the server sends is JSON."""
    url, _ = server
    head = b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = {
        "two Content-Lengths": head + b"Content-Length: 2\r\nContent-Length: 9\r\n\r\n{}",
        "Content-Length and chunked": head + b"Content-Length: 2\r\nTransfer-Encoding: "
                                             b"chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        "a garbled request line": b"GET\x00/ HTTP/1.1\r\nHost: x\r\n\r\n",
        "a 1 MB URL": b"GET /" + b"a" * 1_000_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "a body longer than its Content-Length": head + b"Content-Length: 2\r\n\r\n{}"
                                                        b"garbage that is no request\r\n\r\n",
    }
    for what, request in cases.items():
        reply = _raw_http(url, request)
        # the last answer (to the part that is not HTTP): a status line after a body
        starts = [m.start() for m in re.finditer(rb"HTTP/1\.1 \d{3} ", reply)]
        last = reply[starts[-1]:]
        status, _, rest = last.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 4"), (what, reply[:300])
        assert b"content-type: application/json" in headers.lower(), (what, reply[:300])
        assert json.loads(body)["error"], what


def test_serve_on_a_port_in_use_fails_before_it_says_it_serves(bundles):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags, key in ((["--port", str(port)], "--port"),
                           (["--port", "0", "--grpc-port", str(port)], "--grpc-port")):
            r = subprocess.run([sys.executable, "-m", "sampan.cli", "serve", str(bundles[0]),
                                *flags], capture_output=True, text=True, timeout=120)
            assert r.returncode == 2, r.stdout + r.stderr
            assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and key in r.stderr
            assert "serving" not in r.stdout


def test_sigterm_closes_the_server_journal_and_joiner_then_exits_0(bundles, tmp_path):
    """SIGTERM (what a container runtime sends) stops the server gracefully and then
    closes it: the journal writes the records it still held, the joiner stops with the
    server, and the exit status is 0. uvicorn raised the signal again after its shutdown,
    and the default handler killed the process before any of that (the journal's last
    second of requests lost, the joiner orphaned)."""
    import signal

    from benchmarks.serve_load import start_server

    log = tmp_path / "feedback"
    proc, url = start_server(bundles[0], "--set", f"feedback.dir={log}",
                             "--set", "feedback.flush_seconds=600")  # only a close writes
    try:
        joiner = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                  and _ppid(p) == proc.pid and b"spawn_main" in _cmdline(p)]
        r = web.post(f"{url}/v1/rank", json={"context": {"user_id": "u3"},
                                             "candidates": ["i1", "i2"], "k": 2})
        assert r.status_code == 200
        rid = r.json()["request_id"]
        assert rid not in "".join(f.read_text() for f in (log / "_journal").glob("*.jsonl"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rid in "".join(f.read_text() for f in (log / "_journal").glob("*.jsonl"))
    assert len(joiner) == 1 and not Path(f"/proc/{joiner[0]}").exists()  # gone with it


def _ppid(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""
