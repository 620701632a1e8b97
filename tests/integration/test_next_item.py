"""Next-item runs after training: `sampan eval --ranking` at any cut-offs with intervals, for
next-item and two-tower runs alike (issue 44)."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from sampan.data.behaviour import BuildOptions, build_sequences
from sampan.data.synthetic import interaction_samples
from tests.integration.test_learning import TRAIN, markov_lines, run


@pytest.fixture(scope="module")
def sasrec_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sasrec")
    samples = tmp / "samples.parquet"
    build_sequences(str(markov_lines(tmp / "seq.txt", users=300)), samples,
                    BuildOptions(format="sequence_lines", max_len=10))
    run(tmp, {
        "data": {"train": str(samples),
                 "split": {"method": "leave_one_out", "column": "user_id",
                           "order": "timestamp"}},
        "features": {"label": "label", "group": "user_id", "categorical": ["item_id"],
                     "lists": [{"name": "hist_item_id", "share": "item_id", "max_len": 10}]},
        "model": {"name": "sasrec", "embedding_dim": 16, "dropout": 0.1},
        "train": {**TRAIN, "epochs": 3, "batch_size": 64, "lr": 0.005, "embedding_l2": 0.0}})
    return tmp / "run-sasrec"


def test_eval_ranks_a_next_item_run_at_any_cutoffs_with_intervals(sasrec_run) -> None:
    p = subprocess.run([sys.executable, "-m", "sampan.cli", "eval", str(sasrec_run),
                        "--ranking", "1,50", "--bootstrap", "200"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout)
    assert m["queries"] == 300
    for k in (1, 5, 10, 20, 50):
        lo, hi = m[f"ndcg@{k}_ci95"]
        assert lo <= m[f"ndcg@{k}"] <= hi
        assert m[f"hitrate@{k}"] >= m[f"ndcg@{k}"]
    assert m["hitrate@1"] == pytest.approx(m["ndcg@1"])  # one relevant item: the same at 1
    assert m["hitrate@1"] <= m["mrr"] <= m["hitrate@50"]
    p = subprocess.run([sys.executable, "-m", "sampan.cli", "eval", str(sasrec_run),
                        "--ranking", "ten"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--ranking expects cut-offs like 5,10,20" in p.stderr


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
