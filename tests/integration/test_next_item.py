"""Next-item runs after training: `sampan eval --ranking` at any cut-offs with intervals, for
next-item and two-tower runs alike (issue 44)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from sampan.data.behaviour import BuildOptions, build_sequences
from sampan.data.synthetic import interaction_samples
from tests import web
from tests.integration.test_cli import sampan_here
from tests.integration.test_learning import TRAIN, markov_lines, run


def sasrec_raw(samples) -> dict:  # type: ignore[no-untyped-def]
    """A small SASRec experiment on ``samples`` (sequence lines), leave-one-out."""
    return {
        "data": {"train": str(samples),
                 "split": {"method": "leave_one_out", "column": "user_id",
                           "order": "timestamp"}},
        "features": {"label": "label", "group": "user_id", "categorical": ["item_id"],
                     "lists": [{"name": "hist_item_id", "share": "item_id", "max_len": 10}]},
        "model": {"name": "sasrec", "embedding_dim": 16, "dropout": 0.1},
        "train": {**TRAIN, "epochs": 3, "batch_size": 64, "lr": 0.005, "embedding_l2": 0.0}}


@pytest.fixture(scope="module")
def sasrec_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sasrec")
    samples = tmp / "samples.parquet"
    build_sequences(str(markov_lines(tmp / "seq.txt", users=300)), samples,
                    BuildOptions(format="sequence_lines", max_len=10))
    run(tmp, sasrec_raw(samples))
    return tmp / "run-sasrec"


@pytest.fixture(scope="module")
def sasrec_bundle(sasrec_run):
    """The run exported by `sampan export` (in this process), with what it printed."""
    bundle = sasrec_run.parent / "bundle"
    p = sampan_here("export", str(sasrec_run), "--out", str(bundle), check=True)
    return bundle, " ".join(p.stdout.split())


def test_eval_ranks_a_next_item_run_at_any_cutoffs_with_intervals(sasrec_run) -> None:
    p = sampan_here("eval", str(sasrec_run), "--ranking", "1,50", "--bootstrap", "200")
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout)
    assert m["queries"] == 300
    for k in (1, 5, 10, 20, 50):
        lo, hi = m[f"ndcg@{k}_ci95"]
        assert lo <= m[f"ndcg@{k}"] <= hi
        assert m[f"hitrate@{k}"] >= m[f"ndcg@{k}"]
    assert m["hitrate@1"] == pytest.approx(m["ndcg@1"])  # one relevant item: the same at 1
    assert m["hitrate@1"] <= m["mrr"] <= m["hitrate@50"]
    p = sampan_here("eval", str(sasrec_run), "--ranking", "ten")
    assert p.returncode == 2 and "--ranking expects cut-offs like 5,10,20" in p.stderr
    # early stopping waits ten epochs for a next-item model (the task's patience)
    why = json.loads((sasrec_run / "schedule.json").read_text())["reasons"]
    assert why["early_stopping.patience"].startswith("10: 10 epochs")


def test_eval_ranks_a_two_tower_run_with_groups(tmp_path) -> None:
    """It crashed with a tensor size mismatch: the CTR path ranked the item vectors."""
    from sampan.train.experiment import RunArtifacts

    path = tmp_path / "clicks.parquet"
    pq.write_table(interaction_samples(users=200, items=300, per_user=10, seed=0), path)
    run(tmp_path, {
        "data": {"train": str(path),
                 "split": {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}},
        "features": {"group": "user_id", "categorical": ["user_id", "item_id"]},
        "model": {"name": "two_tower", "item_features": ["item_id"], "embedding_dim": 8,
                  "k": 10},
        "train": {**TRAIN, "epochs": 1, "batch_size": 128}})
    m = RunArtifacts(tmp_path / "run-two_tower").evaluate("test", ranking=[5, 20])
    for k in (5, 10, 20):
        assert 0.0 <= m[f"recall@{k}"] <= 1.0 and f"pop_recall@{k}" in m
    assert m["recall@5"] <= m["recall@10"] <= m["recall@20"]


def _offline_top(art, history, n):
    """The PyTorch model of the run over every item: ``[(item, logit)]``, best first."""
    import numpy as np
    import torch

    from sampan.batch import Batch

    enc = next(e for e in art.pipeline.categorical if e.spec.name == "item_id")
    vocab = enc.vocab_.to_pylist()
    ids = [2 + vocab.index(i) if i in vocab else 1 for i in history][-10:]
    seq = torch.tensor([[0] * (10 - len(ids)) + ids])
    model = art.model.eval()
    with torch.no_grad():
        state = model.user_state(Batch(dense=torch.zeros(1, 0), sparse=torch.zeros(
            1, 1, dtype=torch.long), sequences={"hist_item_id": seq}))
        scores = (state @ model.item_vectors().T)[0].numpy()
    scores[:2] = -np.inf
    best = np.argsort(-scores, kind="stable")[:n]
    return [(vocab[i - 2], float(scores[i])) for i in best]


def test_export_and_serve_top_k_from_the_live_history(sasrec_run, sasrec_bundle) -> None:
    """The bundle holds the user-state encoder and the item index: served top-K (REST and
    gRPC) is the PyTorch model's over every item, for the history the bundle's user table
    holds, for recent items sent in the request, and for the live history after events."""
    import math

    from sampan.client import Client, GrpcClient
    from sampan.train.experiment import RunArtifacts
    from tests.conftest import Served

    bundle, printed = sasrec_bundle
    assert "retrieval for /v1/recommend: user tower user_tower.onnx" in printed
    art = RunArtifacts(sasrec_run)
    # each user's whole sequence, read here from the lines the run was built from
    lines = (sasrec_run.parent / "seq.txt").read_text().split("\n")
    seqs = {w[0]: w[1:] for w in (ln.split() for ln in lines) if w}

    def check(ranking, history):
        want = _offline_top(art, history, 20)
        assert [i.item for i in ranking.items] == [i for i, _ in want]
        for got, (_, logit) in zip(ranking.items, want, strict=True):
            assert abs(got.retrieval_score - logit) < 1e-5
            assert abs(got.score - 1 / (1 + math.exp(-logit))) < 1e-5

    served = Served([str(bundle), "--set", "max_wait_ms=1"])
    try:
        with Client(served.url) as c, GrpcClient(served.grpc) as g:
            for user in ("u0", "u7", "u123"):
                r = c.recommend({"user_id": user}, n=20, k=20)
                assert r.retrieved == 20 and not r.warnings
                check(r, seqs[user])
            recent = ["i5", "i6", "i13"]
            check(c.recommend({"hist_item_id": recent}, n=20, k=20), recent)
            check(g.recommend({"hist_item_id": recent}, n=20, k=20), recent)
            assert c.events([{"user_id": "u7", "item_id": "i40"},
                             {"user_id": "u7", "item_id": "i41"}]).accepted == 2
            check(c.recommend({"user_id": "u7"}, n=20, k=20), seqs["u7"] + ["i40", "i41"])
            check(g.recommend({"user_id": "u7"}, n=20, k=20), seqs["u7"] + ["i40", "i41"])
            # no history: the same candidates for everyone, said; an unseen item, said
            empty = c.recommend({"user_id": "nobody"}, n=20, k=20)
            check(empty, [])
            assert "holds no item the retrieval model knows" in empty.warnings[0]
            # the OpenAPI document's examples are this bundle's, and each is taken
            schemas = web.get(f"{served.url}/openapi.json").json()["components"]["schemas"]
            for name, route in (("PredictRequest", "predict"), ("RankRequest", "rank"),
                                ("RecommendRequest", "recommend"), ("EventsRequest", "events")):
                body = schemas[name]["examples"][0]
                r = web.post(f"{served.url}/v1/{route}", json=body)
                assert r.status_code == 200, (name, body, r.text)
            # the history comes from the live state by the user: the user is what a
            # record gives
            assert set(schemas["PredictRequest"]["examples"][0]["records"][0]) == {
                "item_id", "user_id"}
            odd = c.recommend({"hist_item_id": ["i5", "never-seen"]}, n=20, k=20)
            check(odd, ["i5", "never-seen"])
            assert odd.warnings == ["1 item(s) of the history 'hist_item_id' are unknown to "
                                    "the retrieval model (not in its training data)"]
    finally:
        served.stop()


def test_served_top_k_leaves_out_the_history_when_the_model_does(sasrec_run, sasrec_bundle):
    """``exclude_history`` (as the run's evaluation ranks): the history's items are not
    candidates, and ``n`` items still come back."""
    from sampan.serving.retrieval import Retriever
    from sampan.train.experiment import RunArtifacts

    retriever = Retriever(sasrec_bundle[0])
    assert retriever.exclude_history is False
    retriever.exclude_history = True  # what a run with model.exclude_history exports
    art = RunArtifacts(sasrec_run)
    history = [i for i, _ in _offline_top(art, ["i5", "i6"], 3)] + ["i5"]
    found, notes = retriever.search_with_notes({"hist_item_id": history}, 10)
    want = [(i, s) for i, s in _offline_top(art, history, 30) if i not in history][:10]
    assert [i for i, _ in found] == [i for i, _ in want] and not notes
    assert max(abs(a - b) for (_, a), (_, b) in zip(found, want, strict=True)) < 1e-5


def test_compare_two_next_item_runs_on_their_ranking_metrics(sasrec_run, tmp_path) -> None:
    """`sampan compare` on next-item runs: every ranking metric of both (each equal to the
    run's own evaluation), and the paired bootstrap of the difference over the users. It
    crashed (an AUC of runs that have none)."""
    from sampan.train.experiment import RunArtifacts

    cfg = json.loads(json.dumps(RunArtifacts(sasrec_run).cfg.model_dump(mode="json")))
    other = tmp_path / "hstu"
    run(other, {"data": cfg["data"], "features": cfg["features"],
                "model": {"name": "hstu", "embedding_dim": 16, "heads": 2},
                "train": {**TRAIN, "epochs": 2, "batch_size": 64, "lr": 0.005}})
    hstu_run = other / "run-hstu"
    p = sampan_here("compare", str(sasrec_run), str(hstu_run), "--resamples", "300")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["queries"] == 300 and r["metric"] == "ndcg@10"
    for side, path in (("a", sasrec_run), ("b", hstu_run)):
        own = RunArtifacts(path).evaluate("test")
        for name in ("ndcg@10", "hitrate@20", "mrr"):
            assert r[side][name] == pytest.approx(own[name], abs=1e-6)
    for name, m in r["metrics"].items():
        assert m["diff"] == pytest.approx(r["b"][name] - r["a"][name], abs=2e-6)
        assert m["diff_ci95"][0] <= m["diff"] <= m["diff_ci95"][1]
    assert r["diff"] == r["metrics"]["ndcg@10"]["diff"]
    same = sampan_here("compare", str(sasrec_run), str(sasrec_run))
    s = json.loads(same.stdout)
    assert s["diff"] == 0.0 and s["diff_ci95"] == [0.0, 0.0] and s["p_b_better"] == 0.0


def test_compare_two_retrieval_runs_user_by_user(tmp_path) -> None:
    """`sampan compare` on two-tower runs: Recall / NDCG / HitRate@K and MRR of both, each
    the run's own evaluation, and the paired bootstrap over the users. A run that numbers
    the users differently (trained on the rows in another order) pairs each user with
    itself."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from sampan.train.experiment import RunArtifacts, _query_metrics

    path, flipped = tmp_path / "clicks.parquet", tmp_path / "flipped.parquet"
    table = interaction_samples(users=200, items=300, per_user=10, seed=0)
    pq.write_table(table, path)
    pq.write_table(table.take(np.arange(len(table))[::-1]), flipped)
    raw = {"data": {"train": str(path),
                    "split": {"method": "random", "train": 0.8, "valid": 0.1, "test": 0.1}},
           "features": {"group": "user_id", "categorical": ["user_id", "item_id"]},
           "model": {"name": "two_tower", "item_features": ["item_id"], "embedding_dim": 8,
                     "k": 10},
           "train": {**TRAIN, "epochs": 2, "batch_size": 128}}
    run(tmp_path / "a", raw)
    run(tmp_path / "b", {**raw, "model": {**raw["model"], "embedding_dim": 16}})
    a, b = tmp_path / "a" / "run-two_tower", tmp_path / "b" / "run-two_tower"
    p = sampan_here("compare", str(a), str(b), "--resamples", "300")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    own = {side: RunArtifacts(path).evaluate("test") for side, path in (("a", a), ("b", b))}
    assert r["metric"] == "recall@10" and r["queries"] == own["a"]["queries"] > 100
    for side in ("a", "b"):
        for name in ("recall@10", "ndcg@10", "hitrate@10", "mrr"):
            assert r[side][name] == pytest.approx(own[side][name], abs=1e-6)
    for name, m in r["metrics"].items():
        assert m["diff"] == pytest.approx(r["b"][name] - r["a"][name], abs=2e-6)
        assert m["diff_ci95"][0] <= m["diff"] <= m["diff_ci95"][1]
    assert r["diff"] == r["metrics"]["recall@10"]["diff"]
    same = json.loads(sampan_here("compare", str(a), str(a)).stdout)
    assert same["diff"] == 0.0 and same["diff_ci95"] == [0.0, 0.0]
    # a run on the rows in reverse order numbers the users otherwise; on the same raw rows
    # each user is paired with itself: equal metrics from equal models, user by user
    run(tmp_path / "c", {**raw, "data": {**raw["data"], "train": str(flipped)}})
    c = tmp_path / "c" / "run-two_tower"
    ids = [RunArtifacts(x).pipeline.categorical[0].vocab_.to_pylist()[:5] for x in (a, c)]
    assert ids[0] != ids[1]
    r = json.loads(sampan_here("compare", str(a), str(c), "--data", str(path)).stdout)
    for side, x in (("a", a), ("b", c)):
        assert r[side]["recall@10"] == pytest.approx(
            RunArtifacts(x).evaluate([str(path)])["recall@10"], abs=1e-6)
    users = [_query_metrics(RunArtifacts(x), [str(path)], (10,))[0] for x in (a, c)]
    assert users[0].tolist() == users[1].tolist() == sorted(
        set(table.filter(pc.equal(table["label"], 1))["user_id"].cast(pa.string()).to_pylist()))
