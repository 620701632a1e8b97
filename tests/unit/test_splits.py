"""Train / valid / test assignment: exact counts, determinism and chunk invariance."""

from __future__ import annotations

import numpy as np
import pytest

from sampan.config import SplitConfig
from sampan.data.splits import TEST, TRAIN, VALID, assign, split_fractions

ALL = ["train", "valid", "test"]
M64 = (1 << 64) - 1


def _chunked(method: str, fr: dict, seed: int, n: int, sizes: list[int]) -> np.ndarray:
    out, start = [], 0
    for s in sizes:
        out.append(assign(method, fr, seed, n, start, s))
        start += s
    assert start == n
    return np.concatenate(out)


def test_split_fractions_renormalise() -> None:
    sc = SplitConfig(train=0.7, valid=0.1, test=0.2)
    assert split_fractions(sc, ALL) == pytest.approx({"train": 0.7, "valid": 0.1, "test": 0.2})
    assert split_fractions(sc, ["train", "valid"]) == pytest.approx(
        {"train": 0.7 / 0.8, "valid": 0.1 / 0.8})
    assert split_fractions(sc, ["train"]) == pytest.approx({"train": 1.0})


def test_sequential_n10_exact() -> None:
    fr = split_fractions(SplitConfig(train=0.7, valid=0.1, test=0.2), ALL)
    codes = assign("sequential", fr, 0, 10, 0, 10)
    assert codes.tolist() == [TRAIN] * 7 + [VALID] + [TEST] * 2
    assert (TRAIN, VALID, TEST) == (0, 1, 2)


@pytest.mark.parametrize("n", [10, 11, 997, 1000])
def test_sequential_chunk_invariant_and_counts(n) -> None:
    fr = split_fractions(SplitConfig(train=0.8, valid=0.1, test=0.1), ALL)
    whole = assign("sequential", fr, 0, n, 0, n)
    rng = np.random.default_rng(n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(6, n - 1), replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [n]])).tolist()
    assert np.array_equal(_chunked("sequential", fr, 0, n, sizes), whole)
    n_train, n_valid = round(n * 0.8), round(n * 0.1)
    expected = [TRAIN] * n_train + [VALID] * n_valid + [TEST] * (n - n_train - n_valid)
    assert whole.tolist() == expected


def test_sequential_two_roles() -> None:
    fr = split_fractions(SplitConfig(train=0.6, valid=0.2, test=0.2), ["train", "test"])
    codes = assign("sequential", fr, 0, 8, 0, 8)
    assert codes.tolist() == [TRAIN] * 6 + [TEST] * 2


def _ref_uniform(i: int, seed: int) -> float:
    z = (i + ((seed * 0x9E3779B97F4A7C15 + 1) & M64)) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def test_random_matches_reference_splitmix() -> None:
    fr = split_fractions(SplitConfig(train=0.7, valid=0.1, test=0.2), ALL)
    seed = 17
    codes = assign("random", fr, seed, 1000, 0, 1000)
    expected = []
    for i in range(1000):
        u = _ref_uniform(i, seed)
        expected.append(TRAIN if u < 0.7 else VALID if u < 0.8 else TEST)
    assert codes.tolist() == expected


def test_random_deterministic_and_seed_dependent() -> None:
    fr = split_fractions(SplitConfig(train=0.7, valid=0.1, test=0.2), ALL)
    n = 100_000
    a = assign("random", fr, 1, n, 0, n)
    assert np.array_equal(a, assign("random", fr, 1, n, 0, n))
    b = assign("random", fr, 2, n, 0, n)
    # independent assignments agree with prob 0.7^2 + 0.1^2 + 0.2^2 = 0.54
    assert 0.50 < float(np.mean(a == b)) < 0.58
    for codes in (a, b):
        counts = np.bincount(codes, minlength=3) / n
        np.testing.assert_allclose(counts, [0.7, 0.1, 0.2], atol=0.01)


def test_random_chunk_invariant() -> None:
    fr = split_fractions(SplitConfig(train=0.8, valid=0.1, test=0.1), ALL)
    n = 50_000
    whole = assign("random", fr, 5, n, 0, n)
    sizes = [1, 999, 10_000, 3, 38_997]
    assert np.array_equal(_chunked("random", fr, 5, n, sizes), whole)
    # a chunk is also independent of n_total for the random method
    assert np.array_equal(assign("random", fr, 5, 10**9, 1000, 500), whole[1000:1500])


def test_random_two_roles_fractions() -> None:
    fr = split_fractions(SplitConfig(train=0.6, valid=0.2, test=0.2), ["train", "valid"])
    n = 100_000
    codes = assign("random", fr, 3, n, 0, n)
    assert set(np.unique(codes).tolist()) == {TRAIN, VALID}
    assert float(np.mean(codes == VALID)) == pytest.approx(0.25, abs=0.01)
