"""The next-item task: full-ranking ranks against a brute-force sort, the popularity ranks,
the blocked encoding against the plain one, and the rows it trains on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sampan.data.loader import BatchLoader
from sampan.data.store import SplitArrays
from sampan.models.hstu import HSTU
from sampan.models.sasrec import SASRec
from sampan.schema import DataSchema, SequenceFeatureSpec, SparseFeatureSpec
from sampan.tasks import make_task

N_ITEMS, L = 30, 6
SCHEMA = DataSchema(dense=[], sparse=[SparseFeatureSpec("item", N_ITEMS)],
                    sequences=[SequenceFeatureSpec("hist", L, "item")], labels=["label"])


def split(n: int = 40, seed: int = 0, users: int | None = None) -> SplitArrays:
    rng = np.random.default_rng(seed)
    hist = rng.integers(2, N_ITEMS, (n, L))
    lengths = rng.integers(0, L + 1, n)
    hist[np.arange(L)[None, :] < (L - lengths)[:, None]] = 0  # left padding
    target = rng.integers(2, N_ITEMS, n)
    target[:3] = [1, 1, hist[2, -1] if lengths[2] else 5]  # OOV items; a repeat
    return SplitArrays(dense=np.zeros((n, 0), np.float32), sparse=target[:, None],
                       labels=np.ones((n, 1), np.float32),
                       group=None if users is None else rng.integers(0, users, n),
                       sequences={"hist": hist})


MODELS = {"sasrec": SASRec, "hstu": HSTU}


def model(name: str = "sasrec", **options):
    torch.manual_seed(0)
    cls = MODELS[name]
    m = cls(SCHEMA, cls.Config(embedding_dim=8, heads=2, **options))
    return m.eval()


def infer(fn, data):
    with torch.no_grad():
        return torch.cat([fn(b) for b in BatchLoader(data, 7, shuffle="none", prefetch=0)])


def brute_ranks(scores: np.ndarray, target: np.ndarray, hist: np.ndarray | None) -> np.ndarray:
    """Sort each row (target after every item of equal score) and find the target."""
    out = []
    for q in range(len(scores)):
        s = scores[q].astype(np.float64).copy()
        s[:2] = -np.inf
        if hist is not None:
            for x in set(hist[q].tolist()) - {int(target[q])}:
                s[x] = -np.inf
        if target[q] < 2:
            out.append(np.inf)
            continue
        is_target = np.zeros(len(s))
        is_target[target[q]] = 1
        order = np.lexsort((is_target, -s))
        out.append(float(np.flatnonzero(order == target[q])[0] + 1))
    return np.array(out)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("exclude", [False, True])
def test_ranks_equal_a_brute_force_sort(exclude, name) -> None:
    m = model(name, exclude_history=exclude)
    train, data = split(60, seed=1), split(40, seed=2)
    task = make_task(m, train)
    mine, pop = task.ranks(m, data, infer)
    with torch.no_grad():
        scores = (infer(m.user_state, data) @ m.item_vectors().T).numpy()
    target, hist = data.sparse[:, 0], data.sequences["hist"] if exclude else None
    np.testing.assert_array_equal(mine, brute_ranks(scores, target, hist))
    counts = np.bincount(train.sparse[:, 0], minlength=N_ITEMS).astype(float)
    pop_scores = np.broadcast_to(np.log1p(counts), scores.shape)
    np.testing.assert_array_equal(pop, brute_ranks(pop_scores, target, hist))
    assert np.isinf(mine[:2]).all()  # an item unknown to training is a miss
    metrics = task.evaluate(m, data, infer)
    r = brute_ranks(scores, target, hist)
    assert metrics["hitrate@10"] == pytest.approx(np.mean(r <= 10))
    assert metrics["ndcg@10"] == pytest.approx(np.mean(np.where(r <= 10, 1 / np.log2(
        np.where(np.isinf(r), 2, r) + 1), 0)))
    assert metrics["mrr"] == pytest.approx(np.mean(1 / r))


@pytest.mark.parametrize("name", MODELS)
def test_blocked_encoding_equals_the_padded_one(name) -> None:
    m = model(name)
    data = split(50, seed=3)
    seq = torch.from_numpy(data.sequences["hist"])
    with torch.no_grad():
        plain = m.encode(seq)[:, -1]
        m.BLOCK = 4  # forces blocks cut by length
        blocked = infer(m.user_state, data)
    torch.testing.assert_close(blocked, plain, rtol=1e-5, atol=1e-5)
    # training positions: blocks of similar length give the states of the plain pass
    task = make_task(m, split(10))
    target = torch.from_numpy(data.sparse[:, 0])
    with torch.no_grad():
        task.BLOCK = 5
        states, wanted = task._positions(m, seq, target)
        task.BLOCK = 1000
        states_all, wanted_all = task._positions(m, seq, target)
    order = np.lexsort((states.numpy()[:, 0], wanted.numpy()))
    order_all = np.lexsort((states_all.numpy()[:, 0], wanted_all.numpy()))
    torch.testing.assert_close(states[order], states_all[order_all], rtol=1e-4, atol=1e-5)
    assert len(wanted) == int(((seq != 0) & (torch.cat([seq[:, 1:], target[:, None]], 1)
                                             >= 2)).sum())


def test_training_rows_are_each_users_longest_history() -> None:
    data = split(60, seed=4, users=9)
    task = make_task(model(), data)
    rows = task.training_rows(data)
    lengths = (data.sequences["hist"] != 0).sum(1)
    want = [max(np.flatnonzero(data.group == u), key=lambda r: (lengths[r], r))
            for u in np.unique(data.group)]
    assert sorted(rows.sparse[:, 0].tolist()) == sorted(data.sparse[want, 0].tolist())
    assert len(rows) == len(np.unique(data.group))
    assert len(task.training_rows(split(20))) == 20  # no users: every row


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("loss", ["full", "sampled", "bce"])
def test_each_loss_starts_near_its_reference(loss, name) -> None:
    m = model(name, loss=loss, negatives=16, similarity="dot")
    m.train()
    data = split(40, seed=5)
    task = make_task(m, data)
    b = next(iter(BatchLoader(data, 40, shuffle="none", prefetch=0)))
    value = task.loss(m, b)
    assert torch.isfinite(value)
    assert abs(value.item() - task.reference_loss(data, 40)) < 0.5
    value.backward()
    assert m.position.weight.grad is not None


def test_a_ranking_of_few_rows_per_user_is_flagged() -> None:
    from sampan.train.experiment import few_candidates_note

    note = few_candidates_note({"hitrate@10": 1.0, "candidates_per_query": 2.0})
    assert "2.0 per user" in note and "sasrec" in note
    assert few_candidates_note({"hitrate@10": 0.3, "candidates_per_query": 50.0}) is None
    assert few_candidates_note({"auc": 0.7}) is None


def test_cosine_similarity_scores_cos_over_temperature() -> None:
    m = model("hstu", temperature=0.05)
    data = split(10, seed=6)
    b = next(iter(BatchLoader(data, 10, shuffle="none", prefetch=0)))
    with torch.no_grad():
        state, items = m.user_state(b), m.item_vectors()
        assert torch.allclose(state.norm(dim=1), torch.full((10,), 0.05 ** -0.5))
        assert torch.allclose(items.norm(dim=1), torch.full((N_ITEMS,), 0.05 ** -0.5))
        logit = m(b)[:, 0]
        item = items[torch.from_numpy(data.sparse[:, 0])]
        cos = torch.nn.functional.cosine_similarity(state, item)
    torch.testing.assert_close(logit, cos / 0.05, rtol=1e-5, atol=1e-5)


ATTR_SCHEMA = DataSchema(dense=[], sparse=[SparseFeatureSpec("item", N_ITEMS)],
                         sequences=[SequenceFeatureSpec("hist", L, "item"),
                                    SequenceFeatureSpec("attrs", 3, "attrs", "mean")],
                         own_tables=[SparseFeatureSpec("attrs", 10)], labels=["label"])


@pytest.mark.parametrize("name", MODELS)
def test_item_features_add_the_mean_of_each_items_attributes(name) -> None:
    """An item's vector is its own embedding plus the mean of its attributes' embeddings,
    read from the training rows (the attributes of each row's next item), for the history
    and the catalogue alike."""
    cls = MODELS[name]
    torch.manual_seed(0)
    m = cls(ATTR_SCHEMA, cls.Config(embedding_dim=8, heads=2, item_features=["attrs"]))
    m.eval()
    data = split()
    target = data.sparse[:, 0]
    attrs = np.zeros((len(data), 3), np.int64)
    attrs[:, 0] = 2 + target % 4  # each item's first attribute: its id mod 4
    attrs[target % 2 == 0, 1] = 9  # and 9 for even ids
    data.sequences["attrs"] = attrs
    note = m.fit_data(data)
    known = {int(t) for t in target if t >= 2}
    assert note == f"item attributes: attrs for {len(known)} of {N_ITEMS - 2} items"
    table = m.attributes_attrs.numpy()
    assert not table[:2].any()  # padding and OOV have none
    for t in known:
        assert table[t].tolist() == [2 + t % 4, 9 if t % 2 == 0 else 0, 0]
    emb = m.embedding
    own = emb.lookup(torch.zeros(0, len(emb.offsets), dtype=torch.long),
                     {"hist": torch.arange(N_ITEMS).unsqueeze(0)})[1]["hist"][0]
    attr_rows = emb.lookup(torch.zeros(0, len(emb.offsets), dtype=torch.long),
                           {"attrs": torch.arange(10).unsqueeze(0)})[1]["attrs"][0]
    with torch.no_grad():
        got = m._lookup(torch.arange(N_ITEMS))
    for t in range(N_ITEMS):
        a = [int(x) for x in table[t] if x]
        want = own[t] + (attr_rows[a].mean(0) if a else 0)
        assert torch.allclose(got[t], want, atol=1e-6), t
    # the buffer travels with the weights
    fresh = cls(ATTR_SCHEMA, cls.Config(embedding_dim=8, heads=2, item_features=["attrs"]))
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh.attributes_attrs, m.attributes_attrs)


def test_item_features_must_name_a_list_of_the_data() -> None:
    from sampan.errors import ConfigError

    with pytest.raises(ConfigError, match=r"names 'brand', which is not a list feature of "
                       r"the item; the data's lists: \['attrs'\]"):
        SASRec(ATTR_SCHEMA, SASRec.Config(embedding_dim=8, item_features=["brand"]))
