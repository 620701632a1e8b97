"""Column transforms and FeaturePipeline against independent reference computations."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from sampan.config import CategoricalFeature, FeaturesConfig, NumericFeature
from sampan.data.pipeline import FeaturePipeline
from sampan.data.sources import DataError
from sampan.data.transforms import (
    FIRST_VOCAB_ID,
    OOV_ID,
    CategoricalEncoder,
    NotFittedError,
    NumericEncoder,
    stable_hash,
)

M64 = (1 << 64) - 1


def ref_fnv1a(data: bytes, seed: int = 0) -> int:
    """Plain 64-bit FNV-1a (offset basis XOR the seed mix), no finaliser."""
    h = 0xCBF29CE484222325 ^ ((seed * 0x9E3779B97F4A7C15) & M64)
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def ref_hash(s: str | None, seed: int = 0) -> int:
    """Reference for stable_hash: FNV-1a over UTF-8 bytes, then the splitmix64 finaliser."""
    h = ref_fnv1a(("" if s is None else s).encode("utf-8"), seed)
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & M64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & M64
    h ^= h >> 31
    return h


def test_reference_fnv_matches_published_vectors() -> None:
    # FNV-1a 64 test vectors (seed 0 mixes nothing in)
    assert ref_fnv1a(b"") == 0xCBF29CE484222325
    assert ref_fnv1a(b"a") == 0xAF63DC4C8601EC8C
    assert ref_fnv1a(b"foobar") == 0x85944171F73967E8


# ------------------------------------------------------------------------------ stable_hash
STRINGS = ["a", "b", "ab", "ba", "hello world", "é", "日本語", "🙂 emoji", "x" * 1000,
           "tab\tand\nnewline", "0", "00", "Ω" * 37]


@pytest.mark.parametrize("seed", [0, 1, 12345, -7])
def test_stable_hash_matches_reference(seed) -> None:
    got = stable_hash(pa.array(STRINGS), seed=seed)
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [ref_hash(s, seed) for s in STRINGS]


def test_stable_hash_repeatable_and_layout_independent() -> None:
    a = stable_hash(pa.array(STRINGS))
    b = stable_hash(pa.array(STRINGS))
    assert np.array_equal(a, b)
    # large_string input, a sliced array and a chunked array give the same hashes
    assert np.array_equal(stable_hash(pa.array(STRINGS, pa.large_string())), a)
    padded = pa.array(["zzz"] + STRINGS + ["yyy"]).slice(1, len(STRINGS))
    assert np.array_equal(stable_hash(padded), a)
    chunked = pa.chunked_array([STRINGS[:4], STRINGS[4:]])
    assert np.array_equal(stable_hash(chunked), a)


def test_stable_hash_seed_changes_value() -> None:
    assert int(stable_hash(pa.array(["abc"]), seed=1)[0]) != int(
        stable_hash(pa.array(["abc"]), seed=2)[0])


def test_stable_hash_empty_and_null_alone() -> None:
    expected = ref_hash("")
    assert [int(v) for v in stable_hash(pa.array([""]))] == [expected]
    assert [int(v) for v in stable_hash(pa.array([None, ""], pa.string()))] == [expected] * 2
    assert len(stable_hash(pa.array([], pa.string()))) == 0


@pytest.mark.parametrize("values", [["", "a"], ["", "b"], ["a", ""], ["abc", None, "de", ""]])
def test_stable_hash_empty_next_to_nonempty(values) -> None:
    got = stable_hash(pa.array(values, pa.string()))
    assert [int(v) for v in got] == [ref_hash(v) for v in values]


# ------------------------------------------------------------------------ CategoricalEncoder
def _fit(spec: CategoricalFeature, *chunks) -> CategoricalEncoder:
    enc = CategoricalEncoder(spec)
    for c in chunks:
        enc.partial_fit(c if isinstance(c, (pa.Array, pa.ChunkedArray)) else pa.array(c))
    enc.finalize()
    return enc


def test_categorical_vocab_order_count_desc_then_value() -> None:
    vals = ["d"] * 3 + ["b"] * 2 + ["c"] * 2 + ["a"] * 1 + ["e"] * 3
    enc = _fit(CategoricalFeature(name="c"), vals)
    assert enc.vocab_.tolist() == ["d", "e", "b", "c", "a"]
    assert enc.counts_.tolist() == [3, 3, 2, 2, 1]
    ids = enc.transform(pa.array(["d", "e", "b", "c", "a", "unseen"]))
    assert ids.dtype == np.int64
    assert ids.tolist() == [2, 3, 4, 5, 6, OOV_ID]
    assert FIRST_VOCAB_ID == 2 and OOV_ID == 1
    assert enc.cardinality == 2 + 5
    assert enc.oov_count_ == 0


def test_categorical_min_count_and_missing_value() -> None:
    enc = _fit(CategoricalFeature(name="c", min_count=2), ["a", "b", "a", None, None, "c"])
    # "" (missing) x2 and "a" x2 qualify; ties by value: "" < "a"
    assert enc.vocab_.tolist() == ["", "a"]
    assert enc.oov_count_ == 2  # "b" and "c"
    assert enc.transform(pa.array(["a", "b", None, "", "zzz"])).tolist() == [3, 1, 2, 2, 1]


def test_categorical_max_size() -> None:
    vals = ["a"] * 5 + ["b"] * 4 + ["c"] * 3 + ["d"] * 2
    enc = _fit(CategoricalFeature(name="c", max_size=2), vals)
    assert enc.vocab_.tolist() == ["a", "b"]
    assert enc.oov_count_ == 5
    assert enc.transform(pa.array(["a", "b", "c", "d"])).tolist() == [2, 3, 1, 1]
    assert enc.cardinality == 4


def test_categorical_hash_buckets_for_unknown_values() -> None:
    buckets = 7
    enc = _fit(CategoricalFeature(name="c", min_count=2, hash_buckets=buckets),
               ["a", "a", "b", "b", "rare"])
    assert enc.vocab_.tolist() == ["a", "b"]
    base = 2 + 2
    queries = ["a", "rare", "new1", "new2", "b", "日本", "new1"]
    ids = enc.transform(pa.array(queries))
    expected = [2, *[base + ref_hash(q) % buckets for q in queries[1:4]], 3,
                base + ref_hash("日本") % buckets, base + ref_hash("new1") % buckets]
    assert ids.tolist() == expected
    assert all(base <= i < base + buckets for i in ids[[1, 2, 3, 5, 6]])
    assert np.array_equal(enc.transform(pa.array(queries)), ids)
    assert enc.cardinality == base + buckets


def test_categorical_hash_buckets_missing_value() -> None:
    enc = _fit(CategoricalFeature(name="c", hash_buckets=5), ["a"])
    ids = enc.transform(pa.array(["zz", None]))
    assert ids.tolist() == [3 + ref_hash("zz") % 5, 3 + ref_hash("") % 5]


def test_categorical_pure_hashing() -> None:
    buckets = 11
    enc = _fit(CategoricalFeature(name="c", vocab=False, hash_buckets=buckets), ["a", "b"])
    assert len(enc.vocab_) == 0
    q = ["a", "b", "q", "é"]
    assert enc.transform(pa.array(q)).tolist() == [2 + ref_hash(v) % buckets for v in q]
    assert enc.cardinality == 2 + buckets


def test_categorical_chunked_fit_equals_single_fit() -> None:
    rng = np.random.default_rng(0)
    vals = [f"v{int(k)}" for k in rng.zipf(1.5, size=3000) % 200]
    vals = [None if i % 17 == 0 else v for i, v in enumerate(vals)]
    spec = CategoricalFeature(name="c", min_count=3, max_size=50)
    once = _fit(spec, vals)
    parts = _fit(spec, vals[:1], vals[1:1000], vals[1000:1001], vals[1001:])
    assert once.vocab_.tolist() == parts.vocab_.tolist()
    assert once.counts_.tolist() == parts.counts_.tolist()
    assert once.oov_count_ == parts.oov_count_
    # independent check of the vocabulary with Python counting
    counts: dict[str, int] = {}
    for v in vals:
        counts["" if v is None else v] = counts.get("" if v is None else v, 0) + 1
    ranked = sorted((v for v, c in counts.items() if c >= 3), key=lambda v: (-counts[v], v))
    assert once.vocab_.tolist() == ranked[:50]
    assert once.oov_count_ == len(vals) - sum(counts[v] for v in ranked[:50])


def test_categorical_bucketize_log_squared() -> None:
    enc = _fit(CategoricalFeature(name="c", bucketize="log_squared"),
               pa.array([0.0, 2.0, 3.0, 100.0, None, 1.7, 2.5]))
    expected = {0.0: "0", 2.0: "2", 3.0: str(math.floor(math.log(3) ** 2)),
                100.0: str(math.floor(math.log(100) ** 2)), None: "", 1.7: "1",
                2.5: str(math.floor(math.log(2.5) ** 2))}
    assert expected[3.0] == "1" and expected[100.0] == "21" and expected[2.5] == "0"
    assert sorted(enc.vocab_.tolist()) == sorted(set(expected.values()))
    lookup = {v: i + 2 for i, v in enumerate(enc.vocab_.tolist())}
    q = [3.0, 100.0, None, 2.0, 0.0, 50.0]
    # 50 -> floor(ln(50)^2) = 15, a bucket not seen in training -> OOV
    assert math.floor(math.log(50) ** 2) == 15 and "15" not in lookup
    want = [lookup[expected[v]] for v in q[:-1]] + [OOV_ID]
    assert enc.transform(pa.array(q)).tolist() == want
    # strings holding numbers (how text sources deliver them) bucketize the same way
    assert enc.transform(pa.array(["3", "100", None])).tolist() == want[:3]


def test_categorical_numeric_input_cast() -> None:
    enc = _fit(CategoricalFeature(name="c"), pa.array([3.0, 3.0, 2.5, -1.0]))
    assert enc.vocab_.tolist() == ["3", "-1", "2.5"]
    assert enc.transform(pa.array([3.0, 2.5, -1.0, 4.0])).tolist() == [2, 4, 3, 1]
    # integers and their string form land on the same ids
    assert enc.transform(pa.array([3, -1], pa.int64())).tolist() == [2, 3]
    assert enc.transform(pa.array(["3", "2.5"])).tolist() == [2, 4]


def test_categorical_large_float_input() -> None:
    enc = _fit(CategoricalFeature(name="c"), pa.array([1e20, 3.0]))
    assert sorted(enc.transform(pa.array([1e20, 3.0])).tolist()) == [2, 3]


def test_categorical_transform_before_fit_raises() -> None:
    enc = CategoricalEncoder(CategoricalFeature(name="c"))
    with pytest.raises(NotFittedError):
        enc.transform(pa.array(["a"]))
    enc.partial_fit(pa.array(["a"]))  # partial fit without finalize is still unfitted
    with pytest.raises(NotFittedError):
        enc.transform(pa.array(["a"]))


@pytest.mark.parametrize("spec", [
    CategoricalFeature(name="c1", min_count=2),
    CategoricalFeature(name="c2", hash_buckets=13, max_size=3),
    CategoricalFeature(name="c3", vocab=False, hash_buckets=9),
    CategoricalFeature(name="c4", bucketize="log_squared"),
])
def test_categorical_state_round_trip(tmp_path, spec) -> None:
    num = spec.bucketize == "log_squared"
    train = pa.array([1.0, 5.0, 5.0, 40.0, None, 2.0] * 3) if num else \
        pa.array(["a", "b", "a", "é", None, "c", "c", "d", "a"])
    query = pa.array([0.0, 5.0, 40.0, None, 1e4, 2.0]) if num else \
        pa.array(["a", "b", "é", "new", "c", "d", "x", "a"])
    enc = _fit(spec, train)
    d = enc.state(tmp_path)
    d = json.loads(json.dumps(d))  # the state must be JSON
    back = CategoricalEncoder.from_state(d, tmp_path)
    assert back.vocab_.tolist() == enc.vocab_.tolist()
    assert back.oov_count_ == enc.oov_count_
    assert back.cardinality == enc.cardinality
    assert np.array_equal(back.transform(query), enc.transform(query))


# ---------------------------------------------------------------------------- NumericEncoder
def _fit_num(spec: NumericFeature, chunks) -> NumericEncoder:
    enc = NumericEncoder(spec)
    for c in chunks:
        enc.partial_fit(pa.array(c, pa.float64()))
    enc.finalize()
    return enc


def _ref_numeric(spec: NumericFeature, train: list, query: list) -> np.ndarray:
    seen = np.array([v for v in train if v is not None], dtype=np.float64)
    fill = 0.0 if spec.fill == "mean" else float(spec.fill)

    def shape(v):
        x = np.array([fill if u is None else u for u in v], dtype=np.float64)
        if spec.clip is not None:
            lo, hi = spec.clip
            x = np.clip(x, -np.inf if lo is None else lo, np.inf if hi is None else hi)
        if spec.log1p:
            x = np.sign(x) * np.log1p(np.abs(x))
        return x

    if spec.fill == "mean":  # the raw value at the mean of the shaped seen values
        t = shape(seen).mean()
        fill = float(np.sign(t) * np.expm1(abs(t))) if spec.log1p else t
    q = shape(query)
    if spec.standardize:
        t = shape(train)
        q = (q - t.mean()) / t.std()
    return q


NUM_SPECS = [
    NumericFeature(name="x"),
    NumericFeature(name="x", fill=-1.5),
    NumericFeature(name="x", fill="mean"),
    NumericFeature(name="x", fill="mean", standardize=True),
    NumericFeature(name="x", clip=(None, 10.0), log1p=True),
    NumericFeature(name="x", clip=(-2.0, 50.0), standardize=True),
    NumericFeature(name="x", fill=7.0, clip=(-20.0, None), log1p=True, standardize=True),
    NumericFeature(name="x", fill="mean", clip=(-3.0, 3.0), log1p=True, standardize=True),
]


@pytest.mark.parametrize("spec", NUM_SPECS)
def test_numeric_matches_numpy_over_chunks(spec) -> None:
    rng = np.random.default_rng(42)
    vals = rng.normal(3.0, 20.0, size=500)
    train = [None if i % 9 == 0 else float(v) for i, v in enumerate(vals)]
    enc = _fit_num(spec, [train[:1], train[1:200], train[200:201], train[201:]])
    raw = np.array([v for v in train if v is not None])
    if spec.fill == "mean" and spec.clip is None and not spec.log1p:
        assert enc.fill_ == pytest.approx(raw.mean(), rel=1e-12)
    assert enc.missing_rate_ == pytest.approx(sum(v is None for v in train) / len(train))
    query = [None, -100.0, -1.0, 0.0, 0.5, 3.0, 12.0, 1e4]
    got = enc.transform(pa.array(query, pa.float64()))
    assert got.dtype == np.float32 and got.shape == (len(query),)
    np.testing.assert_allclose(got, _ref_numeric(spec, train, query), rtol=2e-6, atol=2e-6)


def test_fill_mean_is_the_average_the_model_sees() -> None:
    """With log1p a missing count enters at the mean of the log1p'd counts (0 once
    standardized), not at the raw mean, which a heavy tail puts far above most rows."""
    counts = [1.0, 2.0, 3.0, 5.0, 8.0, 10_000.0, None]
    enc = _fit_num(NumericFeature(name="x", fill="mean", log1p=True, standardize=True),
                   [counts])
    shaped = np.log1p(np.array(counts[:-1]))
    assert enc.fill_ == pytest.approx(np.expm1(shaped.mean()))
    assert enc.fill_ < 20 < np.mean(counts[:-1])
    assert enc.transform(pa.array([None], pa.float64()))[0] == pytest.approx(0.0, abs=1e-6)


def test_numeric_docstring_values() -> None:
    enc = _fit_num(NumericFeature(name="x", fill="mean", standardize=True), [[1.0, 3.0, None]])
    # filled column [1, 3, 2]: mean 2, population std sqrt(2/3)
    assert enc.fill_ == 2.0
    assert enc.mean_ == pytest.approx(2.0)
    assert enc.std_ == pytest.approx(math.sqrt(2 / 3))
    got = enc.transform(pa.array([None, 3.0]))
    np.testing.assert_allclose(got, [0.0, 1 / math.sqrt(2 / 3)], rtol=1e-6)


def test_numeric_signed_log1p_hand_values() -> None:
    enc = _fit_num(NumericFeature(name="x", log1p=True), [[1.0]])
    got = enc.transform(pa.array([-math.e + 1, 0.0, math.e - 1, 99.0]))
    np.testing.assert_allclose(got, [-1.0, 0.0, 1.0, math.log(100)], rtol=1e-6)


@pytest.mark.parametrize("chunks", [[[3.7] * 5, [3.7] * 1000], [[None] * 10], [[0.1] * 3]])
def test_numeric_constant_column_no_division_by_zero(chunks) -> None:
    enc = _fit_num(NumericFeature(name="x", standardize=True, fill=0.0), chunks)
    const = next((v for c in chunks for v in c if v is not None), 0.0)
    got = enc.transform(pa.array([const, None if chunks[0][0] is None else const]))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, [0.0, 0.0], atol=1e-6)


def test_numeric_all_missing_mean_fill_is_zero() -> None:
    enc = _fit_num(NumericFeature(name="x", fill="mean"), [[None, None]])
    assert enc.fill_ == 0.0
    assert enc.transform(pa.array([None, 2.0], pa.float64())).tolist() == [0.0, 2.0]


def test_numeric_transform_before_fit_raises(tmp_path) -> None:
    enc = NumericEncoder(NumericFeature(name="x"))
    with pytest.raises(NotFittedError):
        enc.transform(pa.array([1.0]))
    with pytest.raises(NotFittedError):
        enc.state(tmp_path)


def test_numeric_state_round_trip(tmp_path) -> None:
    spec = NumericFeature(name="x", fill="mean", clip=(-5.0, 5.0), log1p=True, standardize=True)
    enc = _fit_num(spec, [[1.0, None, -7.0, 2.5, 9.0]])
    back = NumericEncoder.from_state(enc.state(tmp_path), tmp_path)
    q = pa.array([None, -10.0, 0.0, 4.0], pa.float64())
    assert np.array_equal(back.transform(q), enc.transform(q))


# --------------------------------------------------------------------------- FeaturePipeline
def _features() -> FeaturesConfig:
    return FeaturesConfig(
        # the package's feature defaults switched off: this checks the encoding itself
        categorical_defaults={"min_count": 1},
        numeric_defaults={"fill": 0.0, "log1p": False, "standardize": False, "buckets": 0},
        label="label", group="user",
        categorical=["c", {"name": "d", "hash_buckets": 4, "min_count": 2}],
        numeric=["x", {"name": "y", "log1p": True, "standardize": True}],
    )


def _table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "label": rng.integers(0, 2, n).astype(np.float64),
        "c": [f"c{k}" for k in rng.integers(0, 5, n)],
        "d": [f"d{k}" for k in rng.integers(0, 30, n)],
        "x": pa.array([None if k % 7 == 0 else float(v) for k, v in
                       enumerate(rng.normal(size=n))], pa.float64()),
        "y": rng.exponential(10.0, n),
        "user": [f"u{k}" for k in rng.integers(0, 6, n)],
    })


def test_pipeline_fit_transform_shapes_and_values() -> None:
    train = [_table(100, 1), _table(57, 2)]
    pipe = FeaturePipeline(_features()).fit(train)
    assert pipe.fitted_rows_ == 157
    q = _table(40, 3)
    out = pipe.transform(q)
    assert out["sparse"].shape == (40, 2) and out["sparse"].dtype == np.int64
    assert out["dense"].shape == (40, 2) and out["dense"].dtype == np.float32
    assert out["labels"].shape == (40, 1) and out["labels"].dtype == np.float32
    assert out["group"].shape == (40,) and out["group"].dtype == np.int64
    np.testing.assert_array_equal(out["labels"][:, 0], q.column("label").to_numpy())
    # each column equals its own encoder fitted on the concatenated train data
    full = pa.concat_tables(train)
    c_enc = _fit(CategoricalFeature(name="c"), full.column("c").combine_chunks())
    np.testing.assert_array_equal(out["sparse"][:, 0], c_enc.transform(q.column("c")))
    x_ref = _ref_numeric(NumericFeature(name="x"), full.column("x").to_pylist(),
                         q.column("x").to_pylist())
    np.testing.assert_allclose(out["dense"][:, 0], x_ref, rtol=1e-6)
    y_spec = NumericFeature(name="y", log1p=True, standardize=True)
    y_ref = _ref_numeric(y_spec, full.column("y").to_pylist(), q.column("y").to_pylist())
    np.testing.assert_allclose(out["dense"][:, 1], y_ref, rtol=1e-5, atol=1e-6)
    schema = pipe.schema()
    assert [s.cardinality for s in schema.sparse] == [2 + 5, c_card(pipe)]
    # without labels: no label column needed, no labels key
    out2 = pipe.transform(q.drop_columns(["label"]), with_labels=False)
    assert "labels" not in out2
    np.testing.assert_array_equal(out2["sparse"], out["sparse"])


def c_card(pipe: FeaturePipeline) -> int:
    return 2 + len(pipe.categorical[1].vocab_) + 4


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_pipeline_label_out_of_range_raises(bad) -> None:
    pipe = FeaturePipeline(_features()).fit([_table(30, 1)])
    t = _table(5, 2)
    labels = t.column("label").to_pylist()
    labels[3] = bad
    t = t.set_column(0, "label", pa.array(labels, pa.float64()))
    with pytest.raises(DataError, match="label"):
        pipe.transform(t)


def test_pipeline_transform_before_fit_raises() -> None:
    with pytest.raises(NotFittedError):
        FeaturePipeline(_features()).transform(_table(3, 0))


def test_pipeline_save_load_round_trip(tmp_path) -> None:
    pipe = FeaturePipeline(_features()).fit([_table(200, 5)])
    pipe.save(tmp_path / "p")
    back = FeaturePipeline.load(tmp_path / "p")
    q = _table(64, 6)
    a, b = pipe.transform(q), back.transform(q)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype
        assert np.array_equal(a[k], b[k]), k
    assert back.fitted_rows_ == 200
    assert back.schema() == pipe.schema()


def test_pipeline_group_hash() -> None:
    pipe = FeaturePipeline(_features()).fit([_table(30, 1)])
    q = _table(50, 9)
    g = pipe.transform(q)["group"]
    users = q.column("user").to_pylist()
    expected = np.array([ref_hash(u) for u in users], dtype=np.uint64).view(np.int64)
    np.testing.assert_array_equal(g, expected)
    # equal strings <-> equal ids
    for i in range(len(users)):
        for j in range(len(users)):
            assert (g[i] == g[j]) == (users[i] == users[j])


def test_binned_category_column_is_read_as_a_number():
    from sampan.config import FeaturesConfig

    fc = FeaturesConfig(categorical=["c", {"name": "n_bin", "column": "n",
                                          "bucketize": "log_squared"}])
    roles = FeaturePipeline(fc).roles()
    assert "n" in roles.numeric and "n" not in roles.categorical  # bad text is rejected
    assert "c" in roles.categorical


def _index_in(values: pa.Array, query: pa.Array) -> list[int]:
    import pyarrow.compute as pc

    return pc.fill_null(pc.index_in(query, value_set=values, skip_nulls=True), -1).to_pylist()


@pytest.mark.parametrize("size", [5, 3000, 50_000])
def test_value_index_matches_index_in(size) -> None:
    from sampan.data.transforms import ValueIndex

    rng = np.random.default_rng(size)
    # distinct values of varied length, unicode and the empty string among them
    pool = [f"{x:x}" * (1 + x % 3) for x in rng.choice(10 * size, size, replace=False)]
    pool[0], pool[-1] = "", "größe-名前"
    values = pa.array(pool)
    q = [pool[i] for i in rng.integers(0, size, 400)] + [f"miss{i}" for i in range(100)]
    q += [None, "", "größe-名前", pool[1] + "x", pool[1][:-1]]
    query = pa.array(q, pa.large_string())
    index = ValueIndex(values)
    assert index.positions(query).tolist() == _index_in(values, pa.array(q))
    # the hashed index serves sets much larger than the query; index_in the others
    assert (index._hashes is not None) == (size > max(ValueIndex.SMALL, 3 * len(q)))
    taken = index.take_indices(query)
    assert taken.null_count == sum(p < 0 for p in _index_in(values, pa.array(q)))
    assert index.positions(pa.array([], pa.string())).tolist() == []


def test_value_index_falls_back_when_two_values_share_a_hash(monkeypatch) -> None:
    import sampan.data.hashing as T  # where ValueIndex and stable_hash live

    real = T.stable_hash
    # a hash with 7 values: any large set collides, so the index must use index_in
    monkeypatch.setattr(T, "stable_hash", lambda v, seed=0: real(v, seed) % np.uint64(7))
    values = pa.array([f"v{i}" for i in range(3000)])
    index = T.ValueIndex(values)
    query = pa.array(["v5", "v2999", "nope", None])
    assert index.positions(query).tolist() == [5, 2999, -1, -1]
    assert index._hashes is None and index._collides
    # and when the set has no collision, a query that collides with a value is still
    # told apart by comparing the strings
    monkeypatch.setattr(T, "stable_hash", lambda v, seed=0: np.array(
        [int(s[1:]) if s and s[0] in "vw" else 10**9 for s in v.to_pylist()], np.uint64))
    index = T.ValueIndex(values)
    assert index.positions(pa.array(["v7", "w7", "v2999", "zz"])).tolist() == [7, -1, 2999, -1]
    assert index._hashes is not None


def test_categorical_encoder_large_vocabulary_uses_the_index() -> None:
    from sampan.data.transforms import FIRST_VOCAB_ID, OOV_ID

    enc = CategoricalEncoder(CategoricalFeature(name="c", min_count=1))
    vals = [f"id{i}" for i in range(5000)]
    enc.partial_fit(pa.array(vals))
    enc.finalize()
    ids = enc.transform(pa.array(["id17", "unknown", None, "id4999"]))  # 4 << 5000
    vocab = enc.vocab_.to_pylist()
    assert ids.tolist() == [FIRST_VOCAB_ID + vocab.index("id17"), OOV_ID,
                            OOV_ID if "" not in vocab else FIRST_VOCAB_ID + vocab.index(""),
                            FIRST_VOCAB_ID + vocab.index("id4999")]
    assert enc.index._hashes is not None


def test_merged_fits_of_parts_equal_one_fit_over_all_rows():
    """What the Ray engine relies on: counts merged to the same vocabulary, moments folded
    chunk by chunk to the same bits."""
    rng = np.random.default_rng(3)
    chunks = [pa.array([f"v{int(x)}" for x in rng.zipf(1.3, 500) % 97]) for _ in range(6)]
    nums = [pa.array(np.where(rng.random(500) < 0.1, np.nan, rng.lognormal(1, 2, 500)),
                     from_pandas=True) for _ in range(6)]
    spec = CategoricalFeature(name="c", min_count=3, max_size=40)
    one, parts = CategoricalEncoder(spec), [CategoricalEncoder(spec) for _ in range(3)]
    nspec = NumericFeature(name="x", log1p=True, standardize=True)
    none, nparts = NumericEncoder(nspec), [NumericEncoder(nspec) for _ in range(3)]
    for i, (c, x) in enumerate(zip(chunks, nums, strict=True)):
        one.partial_fit(c)
        parts[i // 2].partial_fit(c)
        none.partial_fit(x)
        nparts[i // 2].partial_fit(x)
    for enc, rest in ((parts[0], parts[1:]), (nparts[0], nparts[1:])):
        for other in rest:
            enc.merge(other)
    for enc in (one, parts[0], none, nparts[0]):
        enc.finalize()
    assert parts[0].vocab_.equals(one.vocab_) and len(one.vocab_) == 40
    assert (parts[0].counts_ == one.counts_).all() and parts[0].oov_count_ == one.oov_count_
    assert (nparts[0].mean_, nparts[0].std_, nparts[0].fill_) == (none.mean_, none.std_,
                                                                   none.fill_)


def test_merged_samples_stay_a_uniform_sample_within_the_dkw_bound():
    from sampan.data.transforms import Reservoir

    rng = np.random.default_rng(0)
    size, parts = 2000, 4
    streams = [rng.normal(i, 1 + i, 50_000) for i in range(parts)]  # unlike parts
    merged = Reservoir(size=size)
    for i, x in enumerate(streams):
        r = Reservoir(size=size)
        r.reseed((0, i))
        for chunk in np.array_split(x, 7):
            r.add(chunk)
        merged.merge(r)
    every = np.sort(np.concatenate(streams))
    sample = merged.values()
    assert len(sample) == size
    qs = np.arange(1, 10) / 10
    # the share of all values below each sample quantile is within DKW's bound of it (99 %)
    share = np.searchsorted(every, np.quantile(sample, qs)) / len(every)
    assert np.abs(share - qs).max() < np.sqrt(np.log(2 / 0.01) / (2 * size))


def test_a_fitted_pipeline_reads_its_labels_where_new_data_has_them(tmp_path):
    """A run trained on ratings keeps learning from a feedback log whose label is a click:
    relabel() reads the label from the log's column, the features as fitted (saved and
    loaded too); a different number of labels is refused."""
    from sampan.errors import ConfigError

    t = pa.table({"u": ["a", "b", "a", "c"], "rating": [5.0, 1.0, 4.0, 3.0]})
    pipe = FeaturePipeline(FeaturesConfig(label="rating", label_threshold=4,
                                          categorical=["u"])).fit([t])
    ids = pipe.transform(t)["sparse"]
    assert pipe.relabel(FeaturesConfig(label="rating", label_threshold=4,
                                       categorical=["u"])) is None
    said = pipe.relabel(FeaturesConfig(label="label", categorical=["u"]))
    assert said == "labels read from 'label' (the run was trained on 'rating' >= 4)"
    log = pa.table({"u": ["c", "a", "zz"], "label": [1, 0, 1]})
    pipe.save(tmp_path / "p")
    out = FeaturePipeline.load(tmp_path / "p").transform(log)
    assert out["labels"][:, 0].tolist() == [1.0, 0.0, 1.0]
    assert out["sparse"][:2].tolist() == [ids[3].tolist(), ids[0].tolist()]  # as fitted
    assert pipe.features.labels == ["rating"]  # the model's output keeps its name
    with pytest.raises(ConfigError, match="2 label.*trained for 1"):
        pipe.relabel(FeaturesConfig(label=["click", "like"], categorical=["u"]))
