"""Dynamic tables inside EmbeddingCollection: keys become rows through the table's KeyIndex;
training through it equals a plain table fed the same rows; the default row is never
updated; an evicted row is drawn again and its optimizer state reset before its new key
uses it; sequences that share the table read the same rows; state dicts resume exactly."""

import pytest
import torch

from sampan.embedding import EmbeddingCollection, SparseAdagrad, SparseAdam
from sampan.schema import DynamicSpec, TableSpec

KEYS = torch.tensor([10**15 + 7, -3, 2**62, 99, 123456789])  # arbitrary 64-bit keys


def tables(capacity=8, **dyn):
    return [TableSpec("a", 6, 4, ("a",)),
            TableSpec("k", capacity + 1, 4, ("k", "hist_k"),
                      dynamic=DynamicSpec(capacity, **dyn))]


def batches(n=6, b=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randint(0, 6, (b,), generator=g),
                         KEYS[torch.randint(0, len(KEYS), (b,), generator=g)]], 1)
            for _ in range(n)]


def loss_of(out):
    return (out.sum(-1) - 1.0).square().mean()


def test_training_through_keys_equals_a_plain_table_fed_their_rows():
    torch.manual_seed(0)
    dyn = EmbeddingCollection(tables(), init_std=0.3)
    plain = EmbeddingCollection([TableSpec("a", 6, 4, ("a",)), TableSpec("k", 9, 4, ("k",))])
    plain.weight.data.copy_(dyn.weight.data)
    opt_d, opt_p = SparseAdam([dyn], lr=0.05), SparseAdam([plain], lr=0.05)
    for ids in batches():
        loss_of(dyn(ids)).backward()
        opt_d.step()
        rows = ids.clone()
        rows[:, 1] = dyn.dynamic["k"].find(ids[:, 1])  # the rows the keys were given
        assert bool((rows[:, 1] > 0).all())
        loss_of(plain(rows)).backward()
        opt_p.step()
    torch.testing.assert_close(dyn.weight, plain.weight, rtol=0, atol=0)
    assert len(dyn.dynamic["k"]) == len(KEYS) and int(dyn.dynamic_step) == 6


def test_keys_without_a_row_read_the_default_row_which_never_moves():
    torch.manual_seed(0)
    coll = EmbeddingCollection(tables(min_count=3), init_std=0.3)
    default = coll.weight[6].clone()  # row 0 of table k
    opt = SparseAdagrad([coll], lr=0.1)
    ids = torch.tensor([[1, 5], [2, 6]])  # keys 5 and 6, once each: not admitted
    out = coll(ids)
    assert torch.equal(out[0, 1], default) and torch.equal(out[1, 1], default)
    loss_of(out).backward()
    opt.step()
    assert torch.equal(coll.weight[6], default)
    coll.eval()
    with torch.no_grad():  # evaluation reads, never admits
        assert torch.equal(coll(torch.tensor([[0, 777]]))[0, 1], default)
    assert coll.dynamic["k"].find(torch.tensor([777])).item() == 0


def test_an_evicted_row_starts_again_for_its_new_key():
    torch.manual_seed(0)
    coll = EmbeddingCollection(tables(capacity=2, policy="lru", evict_fraction=0.0),
                               init_std=0.3)
    opt = SparseAdam([coll], lr=0.5)
    for ids in ([[0, 11]], [[0, 11], [0, 12]], [[0, 12]]):  # 11 and 12 trained
        loss_of(coll(torch.tensor(ids))).backward()
        opt.step()
    row = 6 + coll.dynamic["k"].find(torch.tensor([11])).item()
    trained = coll.weight[row].clone()
    state = opt.state[coll.weight]
    assert state["exp_avg"][row].abs().sum() > 0
    assert state["row_step"][row] == 2  # 11's updates, for its bias correction
    # key 13 takes 11's row (the least recent); a zero loss leaves the fresh draw as it is
    (0.0 * coll(torch.tensor([[0, 13]])).sum()).backward()
    assert 6 + coll.dynamic["k"].find(torch.tensor([13])).item() == row
    assert coll.dynamic["k"].find(torch.tensor([11])).item() == 0
    fresh = coll.weight[row].clone()
    assert not torch.equal(fresh, trained)
    assert 0.05 < fresh.std().item() < 1.0  # drawn from normal(0, 0.3) again
    opt.step()
    assert torch.equal(state["exp_avg"][row], torch.zeros(4))
    assert torch.equal(state["exp_avg_sq"][row], torch.zeros(4))
    assert state["row_step"][row] == 1  # 13's first update, not 11's third
    torch.testing.assert_close(coll.weight[row], fresh)


def test_a_second_lookup_in_a_step_never_takes_a_row_the_first_handed_out():
    torch.manual_seed(0)
    coll = EmbeddingCollection(tables(capacity=2, policy="lru", evict_fraction=0.0),
                               init_std=0.3)
    first = coll(torch.tensor([[0, 10], [0, 11]]))  # the table is full
    coll(torch.tensor([[0, 12]]))  # no row for 12 this step: 10 and 11 are in use
    assert 0 not in coll.dynamic["k"].find(torch.tensor([10, 11])).tolist()
    assert coll.dynamic["k"].find(torch.tensor([12])).item() == 0
    (first.sum()).backward()
    rows, _ = coll.pop_lookups()
    assert sorted(r for r in rows.tolist() if r >= 6) == [7, 8]  # table k: 10's and 11's
    coll(torch.tensor([[0, 12]]))  # the next step: now a row is freed for it
    assert coll.dynamic["k"].find(torch.tensor([12])).item() > 0


def test_a_sequence_sharing_the_table_reads_the_same_rows_and_padding_the_default():
    torch.manual_seed(0)
    coll = EmbeddingCollection(tables(), init_std=0.3)
    ids = torch.tensor([[1, 99], [2, -3]])
    hist = torch.tensor([[0, -3, 99], [0, 0, 99]])  # 0: padding
    fields, seqs = coll.lookup(ids, {"hist_k": hist})
    assert torch.equal(seqs["hist_k"][0, 2], fields[0, 1])  # key 99 both ways
    assert torch.equal(seqs["hist_k"][0, 1], fields[1, 1])  # key -3
    assert torch.equal(seqs["hist_k"][1, 0], coll.weight[6])  # padding: the default row
    assert len(coll.dynamic["k"]) == 2


def test_a_state_dict_resumes_exactly():
    def make():
        torch.manual_seed(0)
        c = EmbeddingCollection(tables(capacity=3, policy="lfu", evict_fraction=0.3),
                                init_std=0.3)
        return c, SparseAdam([c], lr=0.05)

    straight, opt_s = make()
    first, opt_f = make()
    run = batches(12, seed=1)
    for ids in run[:6]:
        for c, o in ((straight, opt_s), (first, opt_f)):
            loss_of(c(ids)).backward()
            o.step()
    resumed, opt_r = make()
    resumed.load_state_dict(first.state_dict())
    opt_r.load_state_dict(opt_f.state_dict())
    assert "dynamic_step" in first.state_dict() and "dynamic.k.row_key" in first.state_dict()
    rng = torch.get_rng_state()
    for c, o in ((straight, opt_s), (resumed, opt_r)):
        torch.set_rng_state(rng)  # a freed row's fresh draw comes from the global stream
        for ids in run[6:]:
            loss_of(c(ids)).backward()
            o.step()
    torch.testing.assert_close(resumed.weight, straight.weight, rtol=0, atol=0)


def test_a_dynamic_table_needs_its_capacity_plus_the_default_row():
    with pytest.raises(ValueError, match="capacity \\+ 1"):
        EmbeddingCollection([TableSpec("k", 8, 4, ("k",), dynamic=DynamicSpec(8))])


def test_a_data_parallel_run_places_dynamic_tables_like_any_other():
    from sampan.distributed import (
        ReplicatedCollection,
        RowShardedCollection,
        distribute_embeddings,
    )

    # the placement rule decides (auto: by size; row_sharded: always); the map stays whole
    big = EmbeddingCollection(tables())
    sharded = distribute_embeddings(big, lambda n: True, 1, 2)
    assert isinstance(sharded, RowShardedCollection) and set(sharded.dynamic) == set(big.dynamic)
    assert sharded.weight.shape[0] == sharded.hi - sharded.lo < big.num_rows
    assert isinstance(distribute_embeddings(EmbeddingCollection(tables()), lambda n: False,
                                            0, 2), ReplicatedCollection)


def test_two_tower_says_a_dynamic_item_feature_is_not_supported_yet():
    from sampan.config import ConfigError
    from sampan.models import build_model, get_model_class
    from sampan.schema import DataSchema, SparseFeatureSpec

    schema = DataSchema(sparse=[SparseFeatureSpec("user_id", 9),
                                SparseFeatureSpec("item_id", 11, DynamicSpec(10))])
    with pytest.raises(ConfigError, match="dynamic table"):
        build_model(get_model_class("two_tower").Config(item_features=["item_id"]), schema)


# ------------------------------------------------------ several dynamic tables, one map
def three_tables(second=None, k2=4):
    """A vocabulary table and three dynamic ones (the last with a sequence; the second of
    ``k2`` rows, fewer than the 5 keys); with ``second`` (DynamicSpec options), the second
    has settings of its own."""
    return [TableSpec("a", 6, 4, ("a",)),
            TableSpec("k1", 6, 4, ("k1",), dynamic=DynamicSpec(5, evict_fraction=0.2)),
            TableSpec("k2", k2 + 1, 4, ("k2",),
                      dynamic=DynamicSpec(k2, **(second or {"evict_fraction": 0.2}))),
            TableSpec("k3", 9, 4, ("k3", "hist_k3"), dynamic=DynamicSpec(8, evict_fraction=0.2))]


def three_batches(n=10, b=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = lambda: KEYS[torch.randint(0, len(KEYS), (b,), generator=g)]  # noqa: E731
    return [(torch.stack([torch.randint(0, 6, (b,), generator=g), keys(), keys(), keys()], 1),
             {"hist_k3": KEYS[torch.randint(0, len(KEYS), (b, 3), generator=g)]
              * (torch.rand(b, 3, generator=g) > 0.3)}) for _ in range(n)]


def test_tables_with_the_same_settings_share_one_map_and_train_like_plain_tables():
    torch.manual_seed(0)
    dyn = EmbeddingCollection(three_tables(k2=6), init_std=0.3)
    assert list(dyn.dynamic) == ["k1+k2+k3"] and dyn.dynamic["k1+k2+k3"].tables == 3
    plain = EmbeddingCollection([TableSpec("a", 6, 4, ("a",)), TableSpec("k1", 6, 4, ("k1",)),
                                 TableSpec("k2", 7, 4, ("k2",)),
                                 TableSpec("k3", 9, 4, ("k3", "hist_k3"))])
    plain.weight.data.copy_(dyn.weight.data)
    start = dyn.weight.detach().clone()
    opt_d, opt_p = SparseAdam([dyn], lr=0.05), SparseAdam([plain], lr=0.05)
    for ids, seqs in three_batches():
        out, s = dyn.lookup(ids, seqs)
        loss_of(out).backward(retain_graph=True)
        loss_of(s["hist_k3"]).backward()
        opt_d.step()
        rows = ids.clone()
        for c, t in ((1, "k1"), (2, "k2"), (3, "k3")):
            rows[:, c] = dyn.find_keys(t, ids[:, c])  # the rows the keys were given
        hist = dyn.find_keys("k3", seqs["hist_k3"]) * (seqs["hist_k3"] != 0)
        assert bool((rows[:, 1:] > 0).all())  # every key fits: no evictions
        out, s = plain.lookup(rows, {"hist_k3": hist})
        loss_of(out).backward(retain_graph=True)
        loss_of(s["hist_k3"]).backward()
        opt_p.step()
    # k3's row 0 (fused row 19): the plain table trains it as the sequence's padding, the
    # dynamic one keeps its default row as it was
    other = torch.arange(len(start)) != 19
    torch.testing.assert_close(dyn.weight[other], plain.weight[other], rtol=0, atol=0)
    assert torch.equal(dyn.weight[19], start[19])
    assert dyn.dynamic_summary() == {"k1": {"capacity": 5, "live": 5, "evicted": 0},
                                     "k2": {"capacity": 6, "live": 5, "evicted": 0},
                                     "k3": {"capacity": 8, "live": 5, "evicted": 0}}
    maps = dyn.frozen_maps()
    assert set(maps) == {"k1", "k2", "k3"} and sorted(maps["k3"][0].tolist()) == \
        sorted(KEYS.tolist()) and int(maps["k2"][1].max()) <= 6


def test_a_full_table_of_a_shared_map_evicts_its_own_rows_and_renews_them():
    torch.manual_seed(0)
    coll = EmbeddingCollection(three_tables(), init_std=0.3)
    for ids, seqs in three_batches(6):  # k2 (4 rows) sees 5 keys: it evicts
        loss_of(coll.lookup(ids, seqs)[0]).backward()
        coll.pop_lookups()
    s = coll.dynamic_summary()
    assert s["k2"]["evicted"] > 0 and s["k3"]["evicted"] == 0 and s["k1"]["evicted"] == 0
    reset = coll.pop_reset_rows()
    # the renewed rows are k2's (its default row is fused row 12, its rows 1-4 are 13-16)
    assert reset is not None and len(reset) and bool(((reset >= 13) & (reset <= 16)).all())


def test_tables_with_other_settings_get_maps_of_their_own():
    coll = EmbeddingCollection(three_tables(second={"policy": "lru"}))
    assert sorted(coll.dynamic) == ["k1+k3", "k2"]
    assert coll.key_index("k3") == (coll.dynamic["k1+k3"], 1)


def test_a_checkpoint_with_a_map_per_table_loads_into_a_shared_map():
    # before tables shared a map, each had its own under its name: the layout of tables
    # whose settings all differ (here their eviction shares, which give the same batch of
    # one row at these capacities)
    torch.manual_seed(0)
    tabs = three_tables()
    tabs[1:] = [TableSpec(t.name, t.rows, 4, t.features, dynamic=DynamicSpec(
        t.rows - 1, evict_fraction=f)) for t, f in zip(tabs[1:], (0.2, 0.21, 0.22), strict=True)]
    old = EmbeddingCollection(tabs, init_std=0.3)
    assert sorted(old.dynamic) == ["k1", "k2", "k3"]
    for ids, seqs in three_batches(4):
        loss_of(old.lookup(ids, seqs)[0]).backward()
        old.pop_lookups()
    state = old.state_dict()
    new = EmbeddingCollection(three_tables())
    new.load_state_dict(state)
    assert {t: (k.tolist(), r.tolist()) for t, (k, r) in new.frozen_maps().items()} == \
        {t: (k.tolist(), r.tolist()) for t, (k, r) in old.frozen_maps().items()}
    assert new.dynamic_summary() == old.dynamic_summary()
    torch.testing.assert_close(new.weight, old.weight, rtol=0, atol=0)
    ids, seqs = three_batches(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(new.eval().lookup(ids, seqs)[0],
                                   old.eval().lookup(ids, seqs)[0], rtol=0, atol=0)
    for ids, seqs in three_batches(3, seed=5):  # and it trains on
        loss_of(new.train().lookup(ids, seqs)[0]).backward()
        new.pop_lookups()
    for t in range(3):
        assert new.dynamic["k1+k2+k3"].summary(t)["live"] <= (5, 4, 8)[t]
