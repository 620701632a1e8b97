"""The Taobao UserBehavior path end to end as a user walks it, with no hand-made table:
build DIN samples from the raw log, train DIN and two-tower from the shipped configs,
export both, serve both, post a user's events, and ask /v1/recommend with only the user's
id, over REST, gRPC and the Python client. What the server answers is checked against the
bundles scored directly with the histories written out by hand (the training-time
encoding). A prefix of the log keeps it quick."""

import gzip

import numpy as np
import pyarrow.parquet as pq
import pytest

from sampan.client import Client, GrpcClient, ServingError
from sampan.config import load_config
from sampan.data.behaviour import BuildOptions, build_sequences
from sampan.export import export_run
from sampan.serving import Predictor
from sampan.serving.retrieval import Retriever
from sampan.train.experiment import run_experiment
from tests import web
from tests.conftest import ROOT, Served

pytestmark = pytest.mark.realdata
FAST = ["train.epochs=1", "train.progress=false", "train.tensorboard=false"]
EVENTS = 30_000  # the log is in time order: its first half hour


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    from tests.conftest import SHARED_DATA

    raw = SHARED_DATA / "taobao_userbehavior" / "UserBehavior_sample_96168.csv.gz"
    if not raw.is_file():
        pytest.skip(f"real datasets not present at {SHARED_DATA}")
    root = tmp_path_factory.mktemp("taobao")
    with gzip.open(raw, "rt") as f:
        head = [next(f) for _ in range(EVENTS)]
    (root / "events.csv").write_text("".join(head))
    samples = root / "samples.parquet"
    build_sequences(str(root / "events.csv"), samples, BuildOptions(
        columns=["user_id", "item_id", "category_id", "behavior", "timestamp"], header=False,
        targets="positive", negatives=1, max_len=20))
    out = {}
    for name in ("taobao_din", "taobao_two_tower"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", overrides=[
            f"data.train={samples}", f"output_dir={root}", *FAST])
        run = run_experiment(cfg, run_dir=root / name)["run_dir"]
        out[name] = export_run(run, root / f"bundle-{name}")
    out["samples"] = samples
    return out


def test_events_then_recommend_over_rest_grpc_and_the_client(bundles):
    din, tt = bundles["taobao_din"], bundles["taobao_two_tower"]
    users = pq.read_table(din / "features" / "users.parquet").to_pydict()
    items = dict(zip(*pq.read_table(din / "features" / "items.parquet").to_pydict().values(),
                     strict=True))
    # the bundle's user history is that user's latest in the samples, with its own item
    s = pq.read_table(bundles["samples"]).to_pydict()
    last = {}
    for u, i, ts, y, h in zip(s["user_id"], s["item_id"], s["timestamp"], s["label"],
                              s["hist_item_id"], strict=True):
        if u not in last or (ts, y) >= last[u][0]:
            last[u] = ((ts, y), (h + [i] if y == 1 else h)[-20:])
    user_hist = dict(zip(users["user_id"], users["hist_item_id"], strict=True))
    assert len(user_hist) == len(last)
    assert all(user_hist[u] == last[u][1] for u in list(last)[:3000])
    user = next(u for u, h in user_hist.items() if len(h) >= 2)
    hist0 = list(user_hist[user])
    clicks = [i for i in items if i not in hist0][:3]

    served = Served([str(din), "--set", f"retrieval_bundle={tt}", "--set", "max_wait_ms=1"])
    try:
        with Client(served.url) as c, GrpcClient(served.grpc) as g:
            before = c.recommend({"user_id": user}, n=100, k=10)
            assert len(before.items) == 10 and before.retrieved == 100
            assert c.events([{"user_id": user, "item_id": i} for i in clicks[:2]]).accepted == 2
            assert g.events([{"user_id": user, "item_id": clicks[2]}]).accepted == 1
            after = c.recommend({"user_id": user, "colour": "red"}, n=100, k=10)
            grpc_after = g.recommend({"user_id": user}, n=100, k=10)
            rest = web.post(f"{served.url}/v1/recommend", json={
                "context": {"user_id": user}, "n": 100, "k": 10}).json()
            ranked = c.rank({"user_id": user}, clicks, k=3)
            with pytest.raises(ServingError) as e:
                c.events([{"user_id": user, "itemid": "1"}])
            metrics = c.metrics()
    finally:
        served.stop()

    assert after.warnings == ["context feature 'colour' is read by no served model (model "
                              "'din' and retrieval model 'two_tower'); it was ignored"]
    assert grpc_after.ids == after.ids == [i["item"] for i in rest["items"]]
    assert np.allclose([i.score for i in grpc_after.items], [i.score for i in after.items],
                       atol=1e-6)
    # what the server did equals scoring the histories written out as training would:
    # before the events, the bundle's history; after, the same with the three clicks
    retriever = Retriever(tt)
    near = dict(retriever.search({"user_id": user, "hist_item_id": hist0,
                                  "hist_category_id": [items.get(i, "") for i in hist0]}, 100))
    assert max(abs(near[i.item] - i.retrieval_score) for i in before.items) < 1e-5
    hist = (hist0 + clicks)[-20:]
    cats = [items.get(i, "") for i in hist]
    want = Predictor(din).predict([{"user_id": user, "item_id": i, "category_id": items[i],
                                    "hist_item_id": hist, "hist_category_id": cats}
                                   for i in after.ids])[:, 0]
    assert np.abs(want - [i.score for i in after.items]).max() < 1e-5
    moved = dict(retriever.search({"user_id": user, "hist_item_id": hist,
                                   "hist_category_id": cats}, 100))
    assert max(abs(moved[i.item] - i.retrieval_score) for i in after.items) < 1e-5
    assert any(abs(moved[i] - near[i]) > 1e-4 for i in set(moved) & set(near))
    want = Predictor(din).predict([{"user_id": user, "item_id": i, "category_id": items[i],
                                    "hist_item_id": hist, "hist_category_id": cats}
                                   for i in clicks])[:, 0]
    assert ranked.ids == [clicks[j] for j in np.argsort(-want, kind="stable")]
    assert e.value.status == 400 and e.value.field == "itemid"
    assert 'sampan_events_total 3.0' in metrics
    assert 'sampan_request_latency_seconds{quantile="0.99",route="/v1/recommend"}' in metrics
