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
