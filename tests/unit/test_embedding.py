"""The fused table against per-feature nn.Embedding, and the sparse optimizers against
PyTorch's own SparseAdam / Adagrad on identical gradients."""

import pytest
import torch
from torch import nn

from sampan.embedding import (
    EmbeddingCollection,
    SparseAdagrad,
    SparseAdam,
    SparseRowWiseAdagrad,
    SparseSGD,
    make_sparse_optimizer,
)
from sampan.schema import TableSpec

ROWS = [7, 3, 11]
DIM = 4


def make():
    torch.manual_seed(0)
    tables = [TableSpec(f"t{i}", r, DIM, (f"t{i}",)) for i, r in enumerate(ROWS)]
    return EmbeddingCollection(tables, init_std=0.5)


def batches(n=6, b=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    # Few distinct ids so rows repeat inside a batch (exercises deduplication).
    return [torch.stack([torch.randint(0, r, (b,), generator=g) for r in ROWS], dim=1)
            for _ in range(n)]


def reference_tables(coll):
    """Independent per-feature tables copied from the fused weight."""
    out, start = [], 0
    for r in ROWS:
        e = nn.Embedding(r, DIM, sparse=True)
        e.weight.data.copy_(coll.weight.data[start:start + r])
        out.append(e)
        start += r
    return out


def loss_of(vectors, target):
    # A loss with different weights per field and per dim, so gradients are not uniform.
    w = torch.arange(1, vectors.shape[1] * DIM + 1, dtype=torch.float32).view(1, -1, DIM)
    return ((vectors * w).sum(dim=(1, 2)) - target).square().mean()


def test_lookup_matches_separate_tables():
    coll = make()
    refs = reference_tables(coll)
    ids = batches(1)[0]
    coll.eval()
    got = coll(ids)
    want = torch.stack([refs[f](ids[:, f]) for f in range(len(ROWS))], dim=1)
    torch.testing.assert_close(got, want)
    coll.train()
    torch.testing.assert_close(coll(ids), want)


def test_gradients_are_per_unique_row_and_equal_dense_gradients():
    coll = make()
    refs = reference_tables(coll)
    ids = batches(1)[0]
    target = torch.linspace(-1, 1, ids.shape[0])
    loss_of(coll(ids), target).backward()
    rows, grad = coll.pop_lookups()
    assert rows.unique().numel() == rows.numel()  # one entry per distinct row
    dense_ref = torch.cat([torch.zeros(r, DIM) for r in ROWS])
    ref_vecs = torch.stack([refs[f](ids[:, f]) for f in range(len(ROWS))], dim=1)
    loss_of(ref_vecs, target).backward()
    start = 0
    for f, r in enumerate(ROWS):
        dense_ref[start:start + r] = refs[f].weight.grad.to_dense()
        start += r
    full = torch.zeros_like(dense_ref)
    full[rows] = grad
    torch.testing.assert_close(full, dense_ref)
    assert coll.pop_lookups() is None  # consumed


def run_pair(ours_factory, ref_factory, steps=6):
    coll = make()
    refs = reference_tables(coll)
    ours = ours_factory([coll])
    ref = ref_factory([e.weight for e in refs])
    for k, ids in enumerate(batches(steps)):
        target = torch.full((ids.shape[0],), float(k % 3) - 1)
        loss_of(coll(ids), target).backward()
        ours.step()
        ref.zero_grad()
        vecs = torch.stack([refs[f](ids[:, f]) for f in range(len(ROWS))], dim=1)
        loss_of(vecs, target).backward()
        ref.step()
    want = torch.cat([e.weight.data for e in refs])
    return coll.weight.data, want


def test_sparse_adam_table_correction_matches_torch_sparse_adam():
    got, want = run_pair(lambda c: SparseAdam(c, lr=0.05, bias_correction="table"),
                         lambda p: torch.optim.SparseAdam(p, lr=0.05))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sparse_adam_row_correction_is_dense_adam_per_row_stepped_when_used():
    """The default: every row is its own dense Adam parameter, stepped (and its step count
    advanced) only at the steps whose batch uses it, as torch.optim.Adam skips a parameter
    without a gradient."""
    coll = make()
    rows = [nn.Parameter(r.clone()) for r in coll.weight.data]
    # eps is added to sqrt(v) here, to sqrt(v / (1 - b2^k)) in Adam: make it negligible
    ours = SparseAdam([coll], lr=0.05, eps=1e-12)
    ref = torch.optim.Adam(rows, lr=0.05, eps=1e-12)
    offsets = torch.tensor([0, *ROWS[:-1]]).cumsum(0)
    seen = torch.zeros(len(rows), dtype=torch.bool)
    for k, ids in enumerate(batches(8, b=3, seed=5)):  # 3 rows a batch: most rows skip steps
        target = torch.full((ids.shape[0],), float(k % 3) - 1)
        loss_of(coll(ids), target).backward()
        ours.step()
        ref.zero_grad(set_to_none=True)
        loss_of(torch.stack([torch.stack([rows[int(i)] for i in ids[b] + offsets])
                             for b in range(ids.shape[0])]), target).backward()
        ref.step()
        seen[(ids + offsets).flatten()] = True
    assert 0 < int(seen.sum()) < len(rows)
    # float32 rounding in a different order: ~1e-6; table correction is off by ~0.04 here
    torch.testing.assert_close(coll.weight.data, torch.stack([r.data for r in rows]),
                               rtol=1e-4, atol=1e-5)


def test_sparse_adam_first_update_of_a_row_is_lr_whenever_it_comes():
    """Table correction gives a row first used at step 3,001 a step of ~3.1 lr per
    coordinate (fresh moments, the table's correction nearly spent); row correction gives lr,
    as at step 1."""
    table = 0.1 / 0.001 ** 0.5 * (1 - 0.999 ** 3001) ** 0.5 / (1 - 0.9 ** 3001)
    for correction, want in (("row", 0.01), ("table", 0.01 * table)):
        coll = make()
        opt = SparseAdam([coll], lr=0.01, bias_correction=correction)
        first = torch.zeros(1, len(ROWS), dtype=torch.long)
        for _ in range(3000):
            coll(first).sum().backward()
            opt.step()
        before = coll.weight.data.clone()
        late = torch.tensor([[1, 1, 1]])
        coll(late).sum().backward()
        opt.step()
        moved = (coll.weight.data - before)[late[0] + torch.tensor([0, *ROWS[:-1]]).cumsum(0)]
        torch.testing.assert_close(moved.abs(), torch.full_like(moved, want), rtol=1e-4,
                                   atol=0)


def test_sparse_adam_state_without_row_counts_resumes_with_the_table_step():
    """A state saved by a table-corrected run (or before rows were counted) continues with
    the correction it had: every row with moments counted at the table's step."""
    coll = make()
    opt = SparseAdam([coll], lr=0.05, bias_correction="table")
    for ids in batches(3):
        loss_of(coll(ids), torch.zeros(ids.shape[0])).backward()
        opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["bias_correction"] = "row"
    resumed = SparseAdam([coll], lr=0.05)
    resumed.load_state_dict(sd)
    ids = batches(1, seed=9)[0]
    loss_of(coll(ids), torch.zeros(ids.shape[0])).backward()
    resumed.step()
    counts = resumed.state[coll.weight]["row_step"]
    touched = batches(3)
    used = torch.zeros_like(counts, dtype=torch.bool)
    offsets = torch.tensor([0, *ROWS[:-1]]).cumsum(0)
    for ids_k in touched:
        used[(ids_k + offsets).flatten()] = True
    now = torch.zeros_like(used)
    now[(ids + offsets).flatten()] = True
    assert torch.equal(counts, used.float() * 3 + now.float())


def test_sparse_adagrad_matches_torch_adagrad():
    got, want = run_pair(lambda c: SparseAdagrad(c, lr=0.1),
                         lambda p: torch.optim.Adagrad(p, lr=0.1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sparse_sgd_matches_torch_sgd():
    got, want = run_pair(lambda c: SparseSGD(c, lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_embedding_l1_is_a_proximal_step_on_the_rows_used():
    coll = make()
    w0 = coll.weight.data.clone()
    ids = batches(1)[0]
    opt = make_sparse_optimizer("sgd", [coll], lr=0.1, embedding_l1=3.0)
    loss_of(coll(ids), torch.zeros(ids.shape[0])).backward()
    rows, grad = coll._lookups[0][0], coll._lookups[0][1].grad.clone()
    opt.step()
    # hand formula: the SGD step, then each value moves 0.1 * 3 toward 0, stopping at 0
    stepped = w0[rows] - 0.1 * grad
    expect = w0.clone()
    expect[rows] = torch.sign(stepped) * torch.clamp(stepped.abs() - 0.3, min=0.0)
    torch.testing.assert_close(coll.weight.data, expect)
    assert (coll.weight.data[rows] == 0).any() and (coll.weight.data[rows] != 0).any()
    untouched = torch.ones(w0.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(coll.weight.data[untouched], w0[untouched])


def test_rowwise_adagrad_matches_hand_formula():
    coll = make()
    w = coll.weight.data.clone()
    acc = torch.zeros(w.shape[0])
    opt = SparseRowWiseAdagrad([coll], lr=0.1, eps=1e-10)
    for ids in batches(3):
        loss_of(coll(ids), torch.zeros(ids.shape[0])).backward()
        rows, grad = coll._lookups[0][0], coll._lookups[0][1].grad
        # Hand formula on a private copy: s += mean(g^2); w -= lr * g / (sqrt(s) + eps)
        acc[rows] += grad.square().mean(1)
        w[rows] -= 0.1 * grad / (acc[rows].sqrt() + 1e-10).unsqueeze(1)
        opt.step()
    torch.testing.assert_close(coll.weight.data, w)


def test_embedding_l2_adds_l2_times_row_to_gradient():
    coll = make()
    w0 = coll.weight.data.clone()
    ids = batches(1)[0]
    opt = SparseAdagrad([coll], lr=0.1, embedding_l2=0.5)
    loss_of(coll(ids), torch.zeros(ids.shape[0])).backward()
    rows, grad = coll._lookups[0][0], coll._lookups[0][1].grad.clone()
    opt.step()
    g = grad + 0.5 * w0[rows]
    expect = w0.clone()
    expect[rows] -= 0.1 * g / (g.square().sqrt() + 1e-10)
    torch.testing.assert_close(coll.weight.data, expect)
    untouched = torch.ones(w0.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(coll.weight.data[untouched], w0[untouched])


def test_two_lookups_in_one_step_are_merged():
    coll = make()
    ids = batches(1)[0]
    (coll(ids).sum() + coll(ids).sum()).backward()
    rows, grad = coll.pop_lookups()
    assert rows.unique().numel() == rows.numel()
    single = make()
    (2 * single(ids).sum()).backward()
    rows2, grad2 = single.pop_lookups()
    torch.testing.assert_close(rows, rows2)
    torch.testing.assert_close(grad, grad2)


def test_weight_is_not_a_dense_parameter_and_state_dict_round_trips():
    coll = make()
    assert [p for p in coll.parameters() if p.requires_grad] == []
    other = make()
    nn.init.zeros_(other.weight)
    other.load_state_dict(coll.state_dict())
    assert torch.equal(other.weight, coll.weight)


def test_mixed_dims_are_rejected():
    with pytest.raises(ValueError, match="one dim"):
        EmbeddingCollection([TableSpec("a", 3, 4, ("a",)), TableSpec("b", 3, 8, ("b",))])


def test_optimizer_state_dict_round_trip_continues_identically():
    def train(steps_before, steps_after, reload):
        coll = make()
        opt = SparseAdam([coll], lr=0.05)
        bs = batches(steps_before + steps_after)
        for ids in bs[:steps_before]:
            loss_of(coll(ids), torch.zeros(ids.shape[0])).backward()
            opt.step()
        if reload:
            state, weights = opt.state_dict(), coll.state_dict()
            coll = make()
            coll.load_state_dict(weights)
            opt = SparseAdam([coll], lr=0.05)
            opt.load_state_dict(state)
        for ids in bs[steps_before:]:
            loss_of(coll(ids), torch.zeros(ids.shape[0])).backward()
            opt.step()
        return coll.weight.data

    torch.testing.assert_close(train(3, 3, True), train(3, 3, False), rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_build_holds_exactly_its_rows_of_the_whole_table(monkeypatch, world) -> None:
    """A table built deferred (on the meta device) and then given one rank's rows has the
    values of those rows in the whole table (drawn block by block from the same random
    stream), and leaves the generator where building the whole table leaves it."""
    import dataclasses
    import itertools

    import sampan.embedding.collection as C
    from sampan.distributed import RowShardedCollection, distribute_embeddings
    from sampan.schema import TableSpec

    monkeypatch.setattr(C, "_INIT_BLOCK_ROWS", 32)  # many blocks, small remainders
    for rows, dim in itertools.product([1, 31, 33, 65, 129, 1000], [1, 3, 16, 17]):
        tables = [TableSpec("a", rows, dim, ("a",))]
        deferred = [dataclasses.replace(t, device="meta") for t in tables]
        torch.manual_seed(1)
        whole = C.EmbeddingCollection(tables, 0.1)
        after = torch.rand(3)
        for r in range(world):
            torch.manual_seed(1)
            built = C.EmbeddingCollection(deferred, 0.1)
            assert built.deferred and built.weight.is_meta
            assert torch.equal(torch.rand(3), after)
            shard = RowShardedCollection(built, r, world)
            lo, hi = shard.bounds[r], shard.bounds[r + 1]
            assert shard.weight.shape == (hi - lo, dim)
            assert torch.equal(shard.weight, whole.weight[lo:hi]), (rows, dim, r)
    # the rule sees the table's bytes and may keep a table whole
    seen = []
    whole = distribute_embeddings(C.EmbeddingCollection([TableSpec("a", 10, 4, ("a",),
                                                                   device="meta")]),
                                  lambda nbytes: seen.append(nbytes), 0, 2)
    assert seen == [10 * 4 * 4] and not isinstance(whole, RowShardedCollection) and \
        whole.weight.shape == (10, 4)


@pytest.mark.parametrize("c_kernels", [True, False], ids=["c", "tensor-ops"])
@pytest.mark.parametrize("bound", [None, 50, 2**32, 2**40])
def test_dedup_and_segment_sum_match_unique_and_index_add(bound, c_kernels, monkeypatch):
    from sampan import native
    from sampan.embedding.collection import dedup, segment_sum

    if not c_kernels:
        monkeypatch.setattr(native, "library", lambda: None)
    g = torch.Generator().manual_seed(3)
    flat = torch.randint(0, 50, (2000,), generator=g) * (1 if bound != 2**40 else 2**33)
    d = dedup(flat, bound)
    uniq, inv, counts = torch.unique(flat, return_inverse=True, return_counts=True)
    assert torch.equal(d.uniq, uniq) and d.uniq.dtype == torch.int64
    assert torch.equal(d.inverse, inv) and torch.equal(d.counts, counts)
    assert torch.equal(flat[d.order], uniq.repeat_interleave(counts))  # grouped by value
    ends = counts.cumsum(0).tolist()
    assert all(torch.all(d.order[i:j].diff() > 0)  # stable: positions ascend in a group
               for i, j in zip([0, *ends[:-1]], ends, strict=True))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):  # CSR product, index_add_
        grads = torch.randn(2000, 5, generator=g).to(dtype)
        want = torch.zeros(len(uniq), 5, dtype=dtype).index_add_(0, inv, grads)
        torch.testing.assert_close(segment_sum(grads, d), want)
    empty = dedup(torch.zeros(0, dtype=torch.int64), 10)
    assert len(empty.uniq) == 0 and segment_sum(torch.zeros(0, 3), empty).shape == (0, 3)


def test_the_c_sort_and_sums_give_the_tensor_paths_numbers_at_a_criteo_batch(monkeypatch):
    """The radix sort and the per-row sums in C against torch.sort and the CSR product,
    at a Criteo batch's shape (106,496 ids of 845,543 rows): the same groups, and sums equal
    to the bit (both add in position order). A key outside the bound leaves the C sort to
    the general path."""
    from sampan import native
    from sampan.embedding.collection import dedup, segment_sum

    if native.library() is None:
        pytest.skip(f"the C kernels: {native.status()}")
    g = torch.Generator().manual_seed(5)
    flat = torch.randint(0, 845_543, (106_496,), generator=g)
    flat[:5000] = flat[5000:10_000]  # repeats
    grads = torch.randn(106_496, 17, generator=g)
    c = dedup(flat, 845_543)
    got = segment_sum(grads, c)
    monkeypatch.setattr(native, "library", lambda: None)
    t = dedup(flat, 845_543)
    assert all(torch.equal(a, b) for a, b in zip(c, t, strict=True))
    assert torch.equal(got, segment_sum(grads, t))
    monkeypatch.undo()
    assert native.sort_dedup(torch.tensor([3, 60, 3]), 50) is None
    assert dedup(torch.tensor([3, 60, 3]), 50).counts.tolist() == [2, 1]


def test_the_config_names_build_the_two_adam_corrections():
    from sampan.embedding.optim import make_sparse_optimizer

    coll = make()
    assert make_sparse_optimizer("adam", [coll], 0.01).param_groups[0][
        "bias_correction"] == "row"
    assert make_sparse_optimizer("adam_table", [coll], 0.01).param_groups[0][
        "bias_correction"] == "table"
    with pytest.raises(ValueError, match="adam_table"):
        make_sparse_optimizer("adamw", [coll], 0.01)
