import numpy as np
import pytest

from sampan.data.loader import BatchLoader
from sampan.data.store import SplitArrays


def data(n=103):
    ids = np.arange(n, dtype=np.int64)
    return SplitArrays(dense=ids[:, None].astype(np.float32), sparse=np.stack([ids, ids * 2], 1),
                       labels=(ids % 2)[:, None].astype(np.float32), group=ids // 10)


def rows_of(loader):
    return [b.sparse[:, 0].numpy() for b in loader]


@pytest.mark.parametrize("shuffle", ["rows", "blocks", "none"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_row_once_per_epoch_and_aligned(shuffle, prefetch):
    d = data()
    loader = BatchLoader(d, batch_size=10, shuffle=shuffle, seed=3, prefetch=prefetch,
                         block_rows=16)
    assert len(loader) == 11
    batches = list(loader)
    seen = np.concatenate([b.sparse[:, 0].numpy() for b in batches])
    assert sorted(seen.tolist()) == list(range(103))
    for b in batches:  # every field of a row travels together
        ids = b.sparse[:, 0]
        assert (b.sparse[:, 1] == ids * 2).all()
        assert (b.dense[:, 0] == ids.float()).all()
        assert (b.labels[:, 0] == (ids % 2).float()).all()
        assert (b.group == ids // 10).all()
    if shuffle == "none":
        assert seen.tolist() == list(range(103))


def test_shuffle_depends_on_seed_and_epoch_only():
    a = BatchLoader(data(), 10, seed=1)
    b = BatchLoader(data(), 10, seed=1, prefetch=0)
    first = np.concatenate(rows_of(a))
    assert np.array_equal(first, np.concatenate(rows_of(b)))
    assert not np.array_equal(first, np.arange(103))
    a.set_position(1)
    assert not np.array_equal(np.concatenate(rows_of(a)), first)
    c = BatchLoader(data(), 10, seed=2)
    assert not np.array_equal(np.concatenate(rows_of(c)), first)


def test_resume_position_gives_the_remaining_batches():
    full = rows_of(BatchLoader(data(), 10, seed=5))
    loader = BatchLoader(data(), 10, seed=5)
    loader.set_position(0, 4)
    rest = rows_of(loader)
    assert len(rest) == len(full) - 4
    for x, y in zip(rest, full[4:], strict=True):
        assert np.array_equal(np.sort(x), np.sort(y))


def test_drop_last_and_early_break_do_not_hang():
    loader = BatchLoader(data(), 10, drop_last=True, prefetch=1)
    assert len(loader) == 10
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert len(list(loader)) == 10


def test_bad_shuffle_name():
    with pytest.raises(ValueError, match="shuffle"):
        BatchLoader(data(), 10, shuffle="random")


def test_batch_mask_and_lengths_of_list_features():
    import torch

    from sampan.batch import Batch

    seq = torch.tensor([[0, 0, 5], [3, 4, 5], [0, 0, 0]])
    b = Batch(dense=torch.zeros(3, 1), sparse=torch.zeros(3, 1, dtype=torch.long),
              sequences={"h": seq})
    assert b.mask("h").tolist() == [[False, False, True], [True, True, True],
                                    [False, False, False]]
    assert b.lengths("h").tolist() == [1, 3, 0]


def test_rank_parts_cover_each_global_batch_with_two_rows_or_more():
    import numpy as np

    from sampan.data.loader import BatchLoader
    from sampan.data.store import SplitArrays

    n = 10
    arr = SplitArrays(dense=np.arange(n, dtype=np.float32)[:, None],
                      sparse=np.zeros((n, 1), np.int64))
    parts = [[b.dense[:, 0].tolist() for b in BatchLoader(
        arr, batch_size=4, shuffle="rows", seed=1, prefetch=0, drop_singleton=True,
        rank=r, world=2)] for r in range(2)]
    single = [b.dense[:, 0].tolist() for b in BatchLoader(
        arr, batch_size=4, shuffle="rows", seed=1, prefetch=0, drop_singleton=True)]
    # the last global batch (2 rows) cannot give 2 ranks two rows each: it is dropped
    # (one process keeps it: only a single row would be dropped there)
    assert len(parts[0]) == len(parts[1]) == 2 and [len(b) for b in single] == [4, 4, 2]
    for i, batch in enumerate(single[:2]):
        assert sorted(parts[0][i] + parts[1][i]) == sorted(batch)
        assert len(parts[0][i]) >= 2 and len(parts[1][i]) >= 2


def test_batches_gathered_on_a_device_are_the_host_batches():
    """``device=``: the arrays live on the device and batches are gathered there; every
    shuffle mode gives the same rows in the same order as the host path (on the CPU here;
    the GPU tests run it on CUDA)."""
    import torch

    from sampan.data.arrays import SplitArrays
    from sampan.data.loader import BatchLoader

    rng = np.random.default_rng(0)
    n = 1000
    data = SplitArrays(dense=rng.standard_normal((n, 3)).astype(np.float32),
                       sparse=rng.integers(0, 50, (n, 4)).astype(np.int32),
                       labels=rng.random((n, 1)).astype(np.float32),
                       sequences={"hist": rng.integers(0, 9, (n, 5))})
    for shuffle in ("rows", "blocks", "none"):
        for rank in (0, 1):
            kw = dict(batch_size=96, shuffle=shuffle, seed=3, block_rows=128, rank=rank,
                      world=2)
            host = list(BatchLoader(data, **kw))
            dev = list(BatchLoader(data, device="cpu", **kw))
            assert len(host) == len(dev) == 11
            for a, b in zip(host, dev, strict=True):
                assert b.sparse.dtype == torch.int64
                for x, y in ((a.dense, b.dense), (a.sparse, b.sparse), (a.labels, b.labels),
                             (a.sequences["hist"], b.sequences["hist"])):
                    assert torch.equal(x, y)
