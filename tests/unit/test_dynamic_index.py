"""KeyIndex, the key -> row map of dynamic tables: collision-free while the capacity allows,
admission by count and by probability, eviction by LRU / LFU / TTL that never takes a row
the batch uses, and an exact resume from its state dict."""

import numpy as np
import pytest
import torch

from sampan.embedding.dynamic import KeyIndex


def invariants(idx: KeyIndex) -> dict[int, int]:
    """The live key -> row map, checked: one row per key, the map and the rows agree, the
    free stack holds exactly the other rows, ``find`` reads the same."""
    live = idx.live.nonzero().squeeze(1)
    keys = idx.row_key[live]
    assert len(live) == len(idx) <= idx.capacity
    assert len(torch.unique(keys)) == len(keys), "two rows hold one key"
    assert not bool(idx.live[0]), "the default row was given to a key"
    free = idx.free[: int(idx.n_free)]
    assert sorted(free.tolist() + live.tolist()) == list(range(1, idx.capacity + 1))
    assert torch.equal(idx.find(keys), live)
    return dict(zip(keys.tolist(), live.tolist(), strict=True))


@pytest.mark.parametrize("n", [1_000_000, pytest.param(10_000_000, marks=pytest.mark.heavy)])
def test_distinct_keys_never_share_a_row_while_the_capacity_allows(n):
    g = torch.Generator().manual_seed(0)
    # n distinct keys over the whole int64 range, extremes included, in batches of 100k
    # (10 M with -m heavy)
    keys = torch.unique(torch.randint(-2**63, 2**63 - 1, (n + n // 50,), generator=g))[:n]
    keys[:3] = torch.tensor([-2**63, 2**63 - 1, 0])
    keys = keys[torch.randperm(n, generator=g)]
    idx = KeyIndex(n)
    rows = torch.cat([idx.admit(b, step=i)[0] for i, b in enumerate(keys.split(100_000))])
    assert len(idx) == n and int(rows.min()) == 1 and int(rows.max()) == n
    assert len(torch.unique(rows)) == n, "distinct keys share a row"
    assert torch.equal(idx.find(keys), rows)
    assert torch.equal(idx.admit(keys[:100_000], step=999)[0], rows[:100_000])  # stable


def test_find_changes_nothing_and_unknown_keys_read_the_default_row():
    idx = KeyIndex(100)
    rows, _ = idx.admit(torch.tensor([[5, 6], [5, -1]]), step=1)
    assert rows.shape == (2, 2) and rows[0, 0] == rows[1, 0]
    assert len(set(rows.flatten().tolist())) == 3
    before = {k: v.clone() for k, v in idx.state_dict().items()}
    assert idx.find(torch.tensor([5, 7, -1])).tolist() == [int(rows[0, 0]), 0, int(rows[1, 1])]
    for k, v in idx.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_admission_by_count_waits_for_min_count_sightings():
    idx = KeyIndex(1000, min_count=3)
    seen = torch.tensor([1, 2, 2, 3, 3, 3])
    rows, _ = idx.admit(seen, step=1)
    got = dict(zip(seen.tolist(), rows.tolist(), strict=True))
    assert got[1] == 0 and got[2] == 0 and got[3] > 0  # 3 times in one batch is enough
    assert idx.admit(torch.tensor([2]), step=2)[0].item() > 0  # its third sighting
    assert idx.admit(torch.tensor([1]), step=3)[0].item() == 0  # its second
    invariants(idx)


def test_after_the_first_pass_sightings_are_no_longer_counted():
    """Epochs after the first read the same rows again: a key the training rows show once
    stays without a row under min_count 2, however many epochs; one they show twice has
    its row, and one that reached its count keeps getting a row when it comes again."""
    idx = KeyIndex(1000, min_count=2)
    first = torch.tensor([1, 2, 2, 3])
    rows, _ = idx.admit(first, step=1)
    assert rows.tolist()[0] == 0 and rows.tolist()[1] > 0
    idx.stop_counting()
    sketch = idx.sketch.clone()
    for step in range(2, 6):  # the later epochs
        rows, _ = idx.admit(first, step=step)
        assert rows.tolist()[0] == 0 and rows.tolist()[3] == 0
    assert torch.equal(idx.sketch, sketch)
    # saved and loaded (a resumed run): still not counting; an older save still counts
    again = KeyIndex(1000, min_count=2)
    again.load_state_dict(idx.state_dict())
    assert not bool(again.counting) and again.admit(torch.tensor([1]), step=9)[0].item() == 0
    old = {k: v for k, v in idx.state_dict().items() if k != "counting"}
    again.load_state_dict(old)
    assert bool(again.counting)
    invariants(idx)


def test_a_count_lasts_while_the_sketch_is_not_crowded():
    # a key seen once, then 200,000 sightings of 50 other keys that never all fit in the
    # 20 rows, so they go on being counted (far more sightings than the 4,096-counter
    # sketch has counters, but few distinct keys): its second sighting admits
    idx = KeyIndex(20, min_count=2)
    assert idx.sketch.shape == (4, 4096)
    assert idx.admit(torch.tensor([10**12]), step=0)[0].item() == 0
    others = torch.arange(50).repeat(100)
    for step in range(1, 41):
        idx.admit(others, step)
    assert int(idx.sketch[0].sum()) > 100_000  # counted, never halved
    assert idx.admit(torch.tensor([10**12]), step=41)[0].item() > 0
    invariants(idx)


def test_a_stream_of_new_keys_keeps_false_admissions_rare():
    # never a key twice: every admission is a count-min collision; the halving when the
    # sketch fills keeps them near 0.25 ** 4, where counts that never fade would let most
    # keys in by the end (300,000 keys through 131,072 counters a row)
    idx = KeyIndex(10_000, min_count=2, policy="lru")
    admitted = 0
    for step in range(300):
        keys = torch.arange(step * 1000, (step + 1) * 1000) * 7919 + 13
        admitted += int((idx.admit(keys, step)[0] > 0).sum())
    assert 0 < admitted < 0.01 * 300_000, admitted
    assert int(idx.sketch[0].count_nonzero()) <= 0.25 * idx.sketch.shape[1] + 1000


def test_the_sketch_is_sized_by_the_capacity():
    assert KeyIndex(3, min_count=2).sketch.shape == (4, 4096)
    assert KeyIndex(100_000, min_count=2).sketch.shape == (4, 1 << 20)
    assert KeyIndex(10_000_000, min_count=2).sketch.shape == (4, 1 << 20)  # 16 MB at most
    assert KeyIndex(100_000).sketch.numel() == 4  # no sketch without min_count


def test_a_checkpoint_with_a_sketch_of_another_width_resumes_exactly(monkeypatch):
    # checkpoints before the sketch was sized by the capacity hold 4 x 2**20 counters
    import sampan.embedding.dynamic as dynamic

    g = np.random.default_rng(3)
    stream = [torch.from_numpy(g.zipf(1.3, 500).astype(np.int64)) for _ in range(30)]
    monkeypatch.setattr(dynamic, "_SKETCH_PER_ROW", 64)
    old = KeyIndex(300, min_count=2, policy="lru")
    for s, b in enumerate(stream[:15]):
        old.admit(b, s)
    state = old.state_dict()
    monkeypatch.undo()
    resumed = KeyIndex(300, min_count=2, policy="lru")
    assert resumed.sketch.shape[1] < old.sketch.shape[1]
    resumed.load_state_dict(state)
    assert resumed.sketch.shape == old.sketch.shape
    for s, b in enumerate(stream[15:], start=15):
        assert torch.equal(old.admit(b, s)[0], resumed.admit(b, s)[0]), s
    invariants(resumed)
    # a state saved without counting (min_count 1) leaves the counting index its sketch
    counting = KeyIndex(300, min_count=2, policy="lru")
    counting.load_state_dict(KeyIndex(300, policy="lru").state_dict())
    assert counting.sketch.shape == (4, 4096)
    assert counting.admit(torch.arange(10), step=0)[0].tolist() == [0] * 10


def test_admission_by_probability_admits_that_share_and_the_same_on_a_rerun():
    keys = torch.arange(20_000)
    a, b = KeyIndex(50_000, probability=0.25), KeyIndex(50_000, probability=0.25)
    ra, rb = a.admit(keys, step=7)[0], b.admit(keys, step=7)[0]
    assert torch.equal(ra, rb)  # a hash of key and step: the same draws again
    share = (ra > 0).float().mean().item()
    assert abs(share - 0.25) < 4 * (0.25 * 0.75 / 20_000) ** 0.5, share
    # refused keys get another draw at another step
    again = a.admit(keys[ra == 0], step=8)[0]
    assert 0.15 < (again > 0).float().mean().item() < 0.35


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl"])
def test_eviction_frees_the_rows_the_policy_names_and_never_this_batchs(policy):
    idx = KeyIndex(10, policy=policy, ttl_steps=1000, evict_fraction=0.0)  # (ttl: no expiry)
    for k in range(10):  # key k first seen at step k
        idx.admit(torch.tensor([k]), step=k)
    for s, k in enumerate([3, 3, 3, 7], start=10):  # 3 and 7 seen again, and often
        idx.admit(torch.tensor([k]), step=s)
    before = invariants(idx)
    batch = torch.tensor([0, 100, 101])  # key 0 (seen once, longest ago) is in this batch
    rows, freed = idx.admit(batch, step=20)
    after = invariants(idx)
    assert len(freed) == 2 and set(rows[1:].tolist()) == set(freed.tolist())
    assert after[0] == before[0], "a row of the batch was evicted"
    # lru / ttl: the least recently seen; lfu: the fewest uses, the least recent of those
    assert sorted(set(before) - set(after)) == [1, 2]
    idx.admit(torch.tensor([3, 7]), step=21)
    idx.admit(torch.tensor([200]), step=22)
    assert sorted(set(after) - set(invariants(idx))) == [4]


def test_ttl_frees_rows_unseen_for_ttl_steps_whether_the_table_is_full_or_not():
    idx = KeyIndex(100, policy="ttl", ttl_steps=16)  # expiry checked every 2 steps
    idx.admit(torch.tensor([1, 2, 3]), step=0)
    for s in range(1, 30):
        _, freed = idx.admit(torch.tensor([3]), step=s)  # 3 stays in use
        if s < 18:
            assert len(freed) == 0
        if s == 18:  # the first check past 16 steps unseen
            assert len(freed) == 2  # the rows of keys 1 and 2
    assert sorted(invariants(idx)) == [3]
    assert idx.find(torch.tensor([1, 2])).tolist() == [0, 0]
    assert len(idx.expire(step=100)) == 1  # and by hand


def test_lfu_never_evicts_this_batchs_rows_even_when_they_are_the_least_used():
    idx = KeyIndex(4, policy="lfu", evict_fraction=0.0)
    idx.admit(torch.tensor([1, 1, 1, 2, 2, 2, 3, 4]), step=0)  # 1 and 2 used three times
    rows, freed = idx.admit(torch.tensor([3, 4, 5, 6]), step=1)  # 3 and 4: the least used
    assert bool((rows > 0).all()) and sorted(invariants(idx)) == [3, 4, 5, 6]
    assert len(freed) == 2


def test_lfu_and_lru_differ_where_frequency_and_recency_disagree():
    def victim(policy):
        idx = KeyIndex(3, policy=policy, evict_fraction=0.0)
        idx.admit(torch.tensor([1, 1, 1, 1, 2, 3]), step=0)  # 1 four times
        idx.admit(torch.tensor([2]), step=1)
        idx.admit(torch.tensor([3]), step=2)  # 1 is now the least recent
        before = invariants(idx)
        idx.admit(torch.tensor([9]), step=3)
        return sorted(set(before) - set(invariants(idx)))

    assert victim("lru") == [1] and victim("lfu") == [2]


def test_a_random_stream_keeps_the_map_consistent_through_evictions_and_rebuilds():
    g = np.random.default_rng(0)
    idx = KeyIndex(500, policy="lru", evict_fraction=0.05)
    slots = idx.mask + 1
    for step in range(300):
        keys = torch.from_numpy(g.zipf(1.3, 256).astype(np.int64) * 7919 - 10**6)
        rows, freed = idx.admit(keys, step)
        assert bool((rows > 0).all()), "a key of the batch went without a row"
        m = invariants(idx)
        assert [m[k] for k in keys.tolist()] == rows.tolist()
        assert idx.used_slots <= 0.75 * slots + 256
    assert idx.mask + 1 == slots  # rebuilt in place, never grown


def test_state_dict_resumes_exactly():
    g = np.random.default_rng(1)
    stream = [torch.from_numpy(g.zipf(1.2, 300).astype(np.int64)) for _ in range(40)]

    def make():
        return KeyIndex(200, min_count=2, probability=0.8, policy="lfu", evict_fraction=0.1,
                        sketch_width=256)

    straight, first = make(), make()
    for s, b in enumerate(stream[:20]):
        straight.admit(b, s)
        first.admit(b, s)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for s, b in enumerate(stream[20:], start=20):
        ra, fa = straight.admit(b, s)
        rb, fb = resumed.admit(b, s)
        assert torch.equal(ra, rb) and torch.equal(fa, fb), s
    assert invariants(straight) == invariants(resumed)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="capacity"):
        KeyIndex(0)
    with pytest.raises(ValueError, match="policy"):
        KeyIndex(5, policy="fifo")
    with pytest.raises(ValueError, match="ttl_steps"):
        KeyIndex(5, policy="ttl")
    with pytest.raises(ValueError, match="probability"):
        KeyIndex(5, probability=0.0)


@pytest.mark.parametrize("size", [1 << 17, 1 << 21])  # both large enough for the sampled path
@pytest.mark.parametrize("spread", [10, 10**12])  # many ties, few ties
def test_the_sampled_eviction_threshold_picks_exactly_the_lowest_rows(spread, size):
    idx = KeyIndex(size)
    g = torch.Generator().manual_seed(spread)
    idx.row_stamp.copy_(torch.randint(0, spread, idx.row_stamp.shape, generator=g))
    none = torch.empty(0, dtype=torch.long)
    for n in (1, 1000, 3000, 30_000):
        got = idx._lowest(n, step=n, keep=none)
        assert len(torch.unique(got)) == n
        want = torch.sort(idx.row_stamp).values[:n]
        assert torch.equal(torch.sort(idx.row_stamp[got]).values, want), n


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_the_sampled_eviction_never_takes_a_row_seen_at_this_step(policy):
    """The one-pass path drops the rows to keep from its candidates: under LFU the rows
    seen now can hold the lowest stamps (one use), and they must stay."""
    idx = KeyIndex(1 << 21, policy=policy)
    g = torch.Generator().manual_seed(0)
    step = 1000
    idx.row_stamp.copy_(torch.randint(0, step, idx.row_stamp.shape, generator=g))
    if policy == "lfu":  # counts 5.. above the low 32 bits; a tenth seen now with 1 use
        idx.row_stamp.add_(torch.randint(5, 50, idx.row_stamp.shape, generator=g) << 32)
    now = torch.randperm(len(idx.row_stamp), generator=g)[: len(idx.row_stamp) // 10]
    idx.row_stamp[now] = (1 << 32) + step if policy == "lfu" else step
    idx.row_stamp[0] = torch.iinfo(torch.int64).max  # the default row: never live
    n = 20_000
    got = idx._lowest(n, step=step)
    assert len(torch.unique(got)) == n and not torch.isin(got, now).any() and 0 not in got
    rest = torch.ones(len(idx.row_stamp), dtype=torch.bool)
    rest[now], rest[0] = False, False
    want = torch.sort(idx.row_stamp[rest]).values[:n]
    assert torch.equal(torch.sort(idx.row_stamp[got]).values, want)
    by_keep = idx._lowest(n, step=step, keep=now)  # the same rows named explicitly
    assert torch.equal(torch.sort(idx.row_stamp[by_keep]).values, want)


class _NoKeptCut(KeyIndex):
    """Every eviction takes its own pass over the table, as before the cut was kept."""

    def _lowest(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._forget_cuts()
        return super()._lowest(*args, **kwargs)


@pytest.mark.parametrize("policy", ["lfu", "lru", "ttl"])
def test_evictions_from_the_kept_cut_free_the_rows_a_fresh_pass_would(policy):
    """Evictions after the first take their rows from the rows under the last pass's cut
    (a stamp only grows): the same rows, step after step, as a pass over the whole table
    each time, through the cases that must throw the kept rows away: a row given out
    under the cut (LFU: new keys used once where the table's rows were used three times)
    and the step going back (rows seen again get lower stamps)."""
    g = np.random.default_rng(7)
    size = 1 << 17  # sampled eviction (above _SAMPLED_EVICTION), 1,310 rows a time
    opts = dict(policy=policy, ttl_steps=500 if policy == "ttl" else None)
    kept, fresh = KeyIndex(size, **opts), _NoKeptCut(size, **opts)
    hot = 10**12 + np.arange(size // 4)
    for i, step in enumerate([*range(90), *range(0, 20)]):
        new = 10**9 + i * 10**5 + np.arange(1500)
        uses = 3 if i < 60 else 1  # LFU: from the 60th step on, new rows under the cut
        if i == 90:  # the step goes back: live keys only, stamped under the cut
            live = kept.row_key[kept.live].numpy()
            keys = g.choice(live, 20_000, replace=False)
        else:
            keys = np.concatenate([g.choice(hot, 1000), np.repeat(new, uses)])
        keys = torch.from_numpy(g.permutation(keys).astype(np.int64))
        ra, fa = kept.admit(keys, step)
        rb, fb = fresh.admit(keys, step)
        assert torch.equal(ra, rb) and torch.equal(fa, fb), (i, step)
    assert invariants(kept) == invariants(fresh)
    # a third of the evictions or more took their rows from the kept ones
    assert kept.eviction_passes < 0.67 * fresh.eviction_passes, (kept.eviction_passes,
                                                                 fresh.eviction_passes)


def test_eviction_ties_go_to_the_lowest_rows():
    """Which of several equally old rows is evicted does not depend on the device: the
    result is a stable sort's (by stamp, then row), as on CPU so on CUDA."""
    from sampan.embedding.dynamic import _lowest_first

    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 50, 199, 200):
        rows = torch.sort(torch.randperm(1000, generator=g)[:200]).values
        stamps = torch.randint(0, 6, (200,), generator=g)  # many ties
        want = rows[torch.sort(stamps, stable=True).indices[:n]]
        assert torch.equal(_lowest_first(rows, stamps, n), want)
    assert len(_lowest_first(rows, stamps, 0)) == 0


# ------------------------------------------------------------ several tables in one map
def table_map(idx: KeyIndex, t: int) -> dict[int, int]:
    """Table ``t``'s live key -> row map, checked: its rows in ``[1, capacity[t]]``, one row
    per key, its free stack holding exactly its other rows, ``find`` reading the same."""
    keys, rows = idx.table_live(t)
    cap = idx.capacities[t]
    assert len(torch.unique(keys)) == len(keys), "two rows of one table hold one key"
    a = idx.starts_list[t]
    free = (idx.free[a: a + int(idx.n_free[t])] - a).tolist()
    assert sorted(free + rows.tolist()) == list(range(1, cap + 1))
    assert idx.summary(t)["live"] == len(rows)
    assert torch.equal(idx.find(keys, torch.full_like(keys, t)), rows)
    return dict(zip(keys.tolist(), rows.tolist(), strict=True))


@pytest.mark.parametrize("policy", ["lfu", "lru", "ttl"])
def test_tables_in_one_map_behave_as_maps_of_their_own(policy):
    # each table of a shared map gives the rows, and frees the rows, that a map of its own
    # gives when fed that table's keys as the shared map holds them (salted)
    g = np.random.default_rng(4)
    caps = [50, 20, 80]
    opts = dict(policy=policy, ttl_steps=6, evict_fraction=0.1, probability=0.9)
    shared = KeyIndex(caps, **opts)
    alone = [KeyIndex(c, **opts) for c in caps]
    for step in range(60):
        keys = torch.from_numpy(g.zipf(1.3, (40, 3)).astype(np.int64))  # the same keys
        tables = torch.tensor([0, 1, 2]).expand(40, 3)  # in each table: one column each
        rows, freed = shared.admit(keys, step, tables)
        got = [alone[t].admit(keys[:, t] ^ shared.table_salt[t], step) for t in range(3)]
        for t in range(3):
            assert torch.equal(rows[:, t], got[t][0]), (step, t)
            mine = freed[shared.table_of(freed) == t]
            assert sorted(shared.local(mine).tolist()) == sorted(got[t][1].tolist()), (step, t)
            assert table_map(shared, t) == {k ^ int(shared.table_salt[t]): r for k, r in
                                            table_map(alone[t], 0).items()}
    assert any(a.summary()["evicted"] for a in alone)  # full tables evicted on the way


def test_one_key_in_several_tables_is_a_key_of_each():
    idx = KeyIndex([3, 3])
    rows, _ = idx.admit(torch.tensor([5, 5, 6]), step=0, tables=torch.tensor([0, 1, 1]))
    assert rows.tolist()[0] == 1 and sorted(rows.tolist()[1:]) == [1, 2]
    # table 0 fills up and evicts its own rows; table 1 keeps its keys
    idx.admit(torch.tensor([7, 8, 9]), step=1, tables=torch.tensor([0, 0, 0]))
    assert idx.summary(0)["evicted"] >= 1 and idx.summary(1) == {"capacity": 3, "live": 2,
                                                                   "evicted": 0}
    assert idx.find(torch.tensor([5, 6]), torch.tensor([1, 1])).tolist() == rows.tolist()[1:]


def test_keys_of_two_tables_that_meet_after_salting_keep_rows_of_their_own():
    idx = KeyIndex([4, 4])
    x = 12345
    y = x ^ int(idx.table_salt[1])  # table 1's y is salted to table 0's x
    rows, _ = idx.admit(torch.tensor([x, y, 7]), step=0, tables=torch.tensor([0, 1, 1]))
    assert rows.tolist()[0] == 1 and rows.tolist()[1] > 0 and rows.tolist()[2] > 0
    assert idx.find(torch.tensor([x, y, y, x]), torch.tensor([0, 1, 0, 1])).tolist() == \
        [rows[0].item(), rows[1].item(), 0, 0]
    table_map(idx, 0), table_map(idx, 1)


def test_a_shared_map_resumes_exactly_from_its_state_dict():
    g = np.random.default_rng(2)
    stream = [torch.from_numpy(g.zipf(1.2, (100, 2)).astype(np.int64)) for _ in range(30)]
    tables = torch.tensor([0, 1]).expand(100, 2)

    def make():
        return KeyIndex([60, 90], min_count=2, policy="lfu", evict_fraction=0.1)

    straight, first = make(), make()
    for s, b in enumerate(stream[:15]):
        straight.admit(b, s, tables)
        first.admit(b, s, tables)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for s, b in enumerate(stream[15:], start=15):
        ra, fa = straight.admit(b, s, tables)
        rb, fb = resumed.admit(b, s, tables)
        assert torch.equal(ra, rb) and torch.equal(fa, fb), s
    assert table_map(straight, 1) == table_map(resumed, 1)


def test_lfu_counts_every_repeat_of_a_key_in_a_batch():
    idx = KeyIndex(8, policy="lfu")
    idx.admit(torch.tensor([5, 5, 5, 9]), step=1)
    rows, _ = idx.admit(torch.tensor([9, 5, 9, 9, 12]), step=2)
    r5, r9, r12 = rows[1], rows[0], rows[4]
    uses = (idx.row_stamp >> 32).tolist()
    assert (uses[r5], uses[r9], uses[r12]) == (4, 4, 1)
    assert int(idx.row_stamp[r9]) & 0xFFFFFFFF == 2


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_tables_short_of_rows_in_one_batch_evict_as_each_alone_would(policy, monkeypatch):
    # small full tables are chosen from in one sort, a large one by its sampled cut; the
    # freed rows (and their order: it seeds the new rows' draw) are those of maps of their
    # own, table after table
    big = (1 << 16) + 4000
    caps = [30, big, 12, 5]
    opts = dict(policy=policy, evict_fraction=0.01)
    shared = KeyIndex(caps, **opts)
    alone = [KeyIndex(c, **opts) for c in caps]
    cut = []  # the tables the shared map narrowed by a sampled threshold
    sampled = shared._sampled

    def spy(t: int, n: int) -> bool:
        if sampled(t, n):
            cut.append(t)
            return True
        return False

    monkeypatch.setattr(shared, "_sampled", spy)
    g = np.random.default_rng(7)
    fresh = 10**9
    for step in range(12):
        cols = []
        for c in caps:
            n = c + 50 if step == 0 else max(4, c // 50)  # fill, then new keys every step
            old = g.integers(1, 10**6, n // 2)
            new = np.arange(fresh, fresh + n - n // 2)
            fresh += n
            cols.append(np.concatenate([old, new]))
        keys = torch.from_numpy(np.concatenate(cols).astype(np.int64))
        tables = torch.from_numpy(np.repeat(np.arange(len(caps)), [len(c) for c in cols]))
        rows, freed = shared.admit(keys, step, tables)
        want = []
        for t in range(len(caps)):
            mine = tables == t
            r, f = alone[t].admit(keys[mine] ^ shared.table_salt[t], step)
            assert torch.equal(rows[mine], r), (step, t)
            want.append(f + shared.starts_list[t])
        assert torch.equal(freed, torch.cat(want)), step
    assert all(a.summary()["evicted"] for a in alone)
    assert shared.summary(1)["evicted"] >= 10 * shared.evict_batch[1]
    assert set(cut) == {1}


def _tensor_path(idx: KeyIndex) -> KeyIndex:
    idx.native = False
    return idx


@pytest.mark.parametrize("opts", [
    dict(policy="lfu"), dict(policy="lru", min_count=2), dict(policy="ttl", ttl_steps=6),
    dict(policy="lfu", probability=0.7, min_count=2)], ids=["lfu", "lru", "ttl", "lfu-p"])
@pytest.mark.parametrize("caps", [[300], [120, 40, 200]], ids=["one", "three"])
def test_the_c_kernels_give_the_rows_stamps_and_evictions_of_the_tensor_path(caps, opts):
    """The C probe (which stamps the rows it finds, one use per occurrence) and insert
    against the tensor operations that run on a GPU: the same rows, freed rows, stamps,
    free stacks and lookups, step after step, through evictions, rebuilds of the map, keys
    of two tables that meet after salting, and a batch of more than 8,192 keys (the probe
    on several threads)."""
    from sampan import native

    if native.library() is None:
        pytest.skip(f"the C kernels: {native.status()}")
    g = np.random.default_rng(11)
    c, t = KeyIndex(caps, evict_fraction=0.05, **opts), \
        _tensor_path(KeyIndex(caps, evict_fraction=0.05, **opts))
    n_t = len(caps)
    for step in range(80):
        size = 9000 if step % 20 == 7 else 256
        keys = torch.from_numpy(g.zipf(1.2, size).astype(np.int64) * 7919 - 10**6)
        tables = torch.from_numpy(g.integers(0, n_t, size))
        if n_t > 1 and step % 10 == 3:  # table 1's key salted onto table 0's
            keys[:2] = torch.tensor([5, 5 ^ int(c.table_salt[1])])
            tables[:2] = torch.tensor([0, 1])
        args = (keys, step) if n_t == 1 else (keys, step, tables)
        (ra, fa), (rb, fb) = c.admit(*args), t.admit(*args)
        assert torch.equal(ra, rb) and torch.equal(fa, fb), step
        assert torch.equal(c.row_stamp, t.row_stamp) and torch.equal(c.row_key, t.row_key)
        assert torch.equal(c.free, t.free) and torch.equal(c.n_free, t.n_free)
        probe = torch.from_numpy(g.zipf(1.2, 500).astype(np.int64) * 7919 - 10**6)
        on = torch.from_numpy(g.integers(0, n_t, 500))
        fargs = (probe,) if n_t == 1 else (probe, on)
        assert torch.equal(c.find(*fargs), t.find(*fargs))
    assert int(c.freed_total.sum()) > 0 and int(c.freed_total.sum()) == int(t.freed_total.sum())
    if n_t == 1:
        invariants(c)


def test_without_a_c_compiler_the_map_runs_on_tensor_operations(tmp_path):
    """No compiler: the kernels are off, the status says why, and the map still works."""
    import os
    import subprocess
    import sys

    code = ("import torch; from sampan import native; "
            "from sampan.embedding.dynamic import KeyIndex; i = KeyIndex(4); "
            "print(i.admit(torch.tensor([3, 9, 3]), 1)[0].tolist(), native.status())")
    env = {**os.environ, "CC": "/bin/false", "SAMPAN_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[1, 2, 1] off: /bin/false failed"), out.stdout


def test_a_table_the_map_does_not_hold_is_an_error_not_a_stray_read():
    idx = KeyIndex([3, 3])
    with pytest.raises(IndexError, match="table 2 of a key"):
        idx.admit(torch.tensor([5, 6]), step=0, tables=torch.tensor([0, 2]))
    with pytest.raises(IndexError, match="table -1 of a key"):
        idx.find(torch.tensor([5]), tables=torch.tensor([-1]))


def test_int32_keys_are_the_int64_keys_of_the_same_values():
    """The map holds int64 keys (the C kernels read them so): int32 keys are widened."""
    a, b = KeyIndex(100), KeyIndex(100)
    keys = torch.tensor([1, 2, 3, 2, 1 << 30], dtype=torch.int32)
    assert torch.equal(a.admit(keys, 1)[0], b.admit(keys.long(), 1)[0])
    assert torch.equal(a.find(keys), b.find(keys.long())) and len(a) == len(b) == 4
