"""The retrieval task against plain-Python references: the in-batch softmax loss with logQ
and accidental-hit masking, and Recall/NDCG@K over the corpus with seen items excluded."""

import math

import numpy as np
import torch

from sampan.batch import Batch
from sampan.data.store import SplitArrays
from sampan.models import build_model, get_model_class
from sampan.schema import DataSchema, SparseFeatureSpec
from sampan.tasks import make_task

SCHEMA = DataSchema(dense=[], sparse=[SparseFeatureSpec("user_id", 12),
                                      SparseFeatureSpec("item_id", 30),
                                      SparseFeatureSpec("cat", 5)])


def model():
    torch.manual_seed(0)
    cfg = get_model_class("two_tower").Config(item_features=["item_id", "cat"], embedding_dim=4,
                                              tower_mlp=[8], k=5, embedding_init_std=0.5)
    return build_model(cfg, SCHEMA).eval()


def split(users, items, labels):
    users, items = np.array(users), np.array(items)
    return SplitArrays(dense=np.zeros((len(users), 0), np.float32),
                       sparse=np.stack([users, items, items % 5], 1).astype(np.int64),
                       labels=np.array(labels, np.float32)[:, None])


rng = np.random.default_rng(0)
TRAIN = split(rng.integers(2, 12, 200), rng.integers(2, 30, 200), rng.random(200) < 0.7)
# eval rows: known users, an unknown user (1) and an item unseen in training (1 = OOV)
EVAL = split([*rng.integers(2, 12, 60), 1, 3], [*rng.integers(2, 30, 60), 7, 1],
             [*(rng.random(60) < 0.5), 1, 1])


def test_loss_matches_reference():
    m = model().train()
    task = make_task(m, TRAIN)
    b = Batch(dense=torch.zeros(6, 0), sparse=torch.tensor(
        [[2, 5, 0], [3, 6, 1], [4, 5, 0], [5, 9, 4], [6, 2, 2], [7, 3, 3]]),
        labels=torch.ones(6, 1))
    loss = task.loss(m, b)
    u, v = (t.detach() for t in m.vectors(b))
    items = b.sparse[:, 1].tolist()
    counts = np.bincount(TRAIN.sparse[TRAIN.labels[:, 0] > 0, 1], minlength=30)
    q = counts / counts.sum()
    total = 0.0
    for i in range(6):
        logits = [float(u[i] @ v[j]) / 0.05 - math.log(max(q[items[j]], 1e-12))
                  for j in range(6) if j == i or items[j] != items[i]]
        own = float(u[i] @ v[i]) / 0.05 - math.log(max(q[items[i]], 1e-12))
        total += -(own - math.log(sum(math.exp(z) for z in logits)))
    assert abs(loss.item() - total / 6) < 1e-4


def test_evaluation_matches_reference():
    m = model()
    task = make_task(m, TRAIN)

    def infer(fn, data):
        b = Batch(dense=torch.from_numpy(data.dense), sparse=torch.from_numpy(data.sparse))
        with torch.no_grad():
            return fn(b)

    got = task.evaluate(m, EVAL, infer)
    # reference: one query per known user with a positive eval row
    tr_users, tr_items = TRAIN.sparse[:, 0].tolist(), TRAIN.sparse[:, 1].tolist()
    corpus = sorted({i for i in tr_items if i >= 2})
    first_row = {i: tr_items.index(i) for i in corpus}
    with torch.no_grad():
        V = m.item_vectors(Batch(dense=torch.zeros(len(corpus), 0),
                                 sparse=torch.from_numpy(TRAIN.sparse[[first_row[i]
                                                                       for i in corpus]])))
    recalls, ndcgs, pops = [], [], []
    pop_count = {i: sum(1 for u, it, y in zip(tr_users, tr_items, TRAIN.labels[:, 0],
                                              strict=True) if it == i and y > 0)
                 for i in corpus}
    queries = {}
    for r, (u, it) in enumerate(zip(EVAL.sparse[:, 0], EVAL.sparse[:, 1], strict=True)):
        if EVAL.labels[r, 0] > 0 and u >= 2:
            queries.setdefault(int(u), (r, set()))[1].add(int(it))
    for u, (r, rel) in sorted(queries.items()):
        with torch.no_grad():
            uv = m.user_vectors(Batch(dense=torch.zeros(1, 0),
                                      sparse=torch.from_numpy(EVAL.sparse[r: r + 1])))[0]
        seen = {i for uu, i in zip(tr_users, tr_items, strict=True) if uu == u} - rel
        cands = [i for i in corpus if i not in seen]
        for scores, out in (({i: float(uv @ V[corpus.index(i)]) for i in cands}, recalls),
                            ({i: math.log1p(pop_count[i]) for i in cands}, pops)):
            # pessimistic ties: an item ranks below every item with an equal score
            rank = {i: sum(1 for j in cands if scores[j] >= scores[i]) for i in cands}
            top = [i for i in rel if i in rank and rank[i] <= 5]
            out.append(len(top) / len(rel))
            if out is recalls:
                dcg = sum(1 / math.log2(rank[i] + 1) for i in top)
                ideal = sum(1 / math.log2(k + 2) for k in range(min(len(rel), 5)))
                ndcgs.append(dcg / ideal)
    assert got["queries"] == len(queries)
    assert got["unknown_user_rows"] == 1
    assert abs(got["recall@5"] - np.mean(recalls)) < 1e-9
    assert abs(got["ndcg@5"] - np.mean(ndcgs)) < 1e-9
    assert abs(got["pop_recall@5"] - np.mean(pops)) < 1e-9


def test_the_header_says_which_rows_a_two_tower_run_leaves_out() -> None:
    """Issue 45 item 15: label-0 rows were dropped without a word."""
    import numpy as np

    from sampan.tasks import make_task
    from sampan.testing import as_split, batch, builder
    from tests.contract.test_models import OPTIONS

    model = builder("two_tower", **OPTIONS["two_tower"])()
    b = batch(b=16)
    b.labels[:] = 0
    b.labels[:5] = 1
    task = make_task(model, as_split(b))
    kept = task.training_rows(as_split(b))
    assert len(kept) == 5 and np.all(kept.labels == 1)
    line = task.describe()
    assert "trains on the 5 rows with label 1 and leaves out 11 rows with label 0" in line
    everything = batch(b=8)
    everything.labels[:] = 1
    task.training_rows(as_split(everything))
    assert "leaves out" not in task.describe()
