"""List features (sequence / bag / text), quantile buckets and crossed features.

Expected values are hand-computed or recomputed with numpy / pyarrow, not with the code
under test.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from sampan.config import CategoricalFeature, ConfigError, FeaturesConfig, ListFeature, load_config
from sampan.data.hashing import stable_hash
from sampan.data.lists import ListEncoder, pad_ids, split_lists
from sampan.data.pipeline import FeaturePipeline
from sampan.data.transforms import CategoricalEncoder, NotFittedError, Reservoir
from sampan.schema import SequenceFeatureSpec, SparseFeatureSpec

SEQ = ListFeature(name="h", delimiter="|")


def _lists(values: pa.Array, spec: ListFeature = SEQ) -> list[list[str]]:
    out = split_lists(values, spec)
    assert pa.types.is_list(out.type) or pa.types.is_large_list(out.type)
    assert len(out) == len(values)
    assert out.null_count == 0
    return out.to_pylist()


# ------------------------------------------------------------------------------ split_lists
def test_split_delimited_strings() -> None:
    got = _lists(pa.array(["a|b|c", "b", "x|y"]))
    assert got == [["a", "b", "c"], ["b"], ["x", "y"]]


def test_split_nulls_and_empty_strings_are_empty_lists() -> None:
    got = _lists(pa.array([None, "", "a", None], pa.string()))
    assert got == [[], [], ["a"], []]
    assert _lists(pa.array([None, None], pa.string())) == [[], []]
    assert _lists(pa.array([], pa.string())) == []


def test_split_empty_tokens_dropped() -> None:
    got = _lists(pa.array(["||x||", "a||b", "|", "c|"]))
    assert got == [["x"], ["a", "b"], [], ["c"]]


def test_split_other_delimiter() -> None:
    spec = ListFeature(name="h", delimiter=";")
    assert _lists(pa.array(["a;b", "a|b;c"]), spec) == [["a", "b"], ["a|b", "c"]]


def test_split_sliced_input() -> None:
    arr = pa.array(["x|y", "a||b", None, "c"]).slice(1)
    assert _lists(arr) == [["a", "b"], [], ["c"]]


BAG = ListFeature(name="b", kind="bag")


def test_split_list_typed_input() -> None:
    arr = pa.array([["a", "b"], None, [], ["", "c"]], pa.list_(pa.string()))
    assert _lists(arr, BAG) == [["a", "b"], [], [], ["c"]]
    # a list of numbers becomes a list of their spellings
    assert _lists(pa.array([[1, 2], None, [3]]), BAG) == [["1", "2"], [], ["3"]]
    big = pa.array([["a", ""], ["b"]], pa.large_list(pa.string()))
    assert _lists(big, BAG) == [["a"], ["b"]]


def test_split_list_typed_input_with_null_elements() -> None:
    arr = pa.array([["a", None], ["b"], [None]], pa.list_(pa.string()))
    assert _lists(arr, BAG) == [["a"], ["b"], []]  # a bag drops them
    # a sequence keeps positions (histories of items and of categories stay aligned)
    assert _lists(arr, ListFeature(name="h", kind="sequence")) == [["a", ""], ["b"], [""]]


def test_split_text_lowercase_word_tokens() -> None:
    spec = ListFeature(name="t", kind="text")
    got = _lists(pa.array(["Hello, World!  It's FINE.", None, "a_b c-d\te\nf", "  ...  ",
                           "Route 66"]), spec)
    assert got == [["hello", "world", "it", "s", "fine"], [], ["a_b", "c", "d", "e", "f"], [],
                   ["route", "66"]]


def test_split_text_keeps_accented_letters() -> None:
    spec = ListFeature(name="t", kind="text")
    assert _lists(pa.array(["Café AU lait, ÉCOLE naïve"]), spec) == [
        ["café", "au", "lait", "école", "naïve"]]


# ---------------------------------------------------------------------------------- pad_ids
def test_pad_ids_hand_computed() -> None:
    flat = np.array([11, 12, 13, 14, 15, 21, 31, 32], dtype=np.int64)
    counts = np.array([5, 0, 1, 2])  # longer, empty, shorter, equal to max_len=2
    got = pad_ids(flat, counts, 2)
    assert got.dtype == np.int64 and got.shape == (4, 2)
    assert got.tolist() == [[14, 15], [0, 0], [0, 21], [31, 32]]


def test_pad_ids_keep_first_hand_computed() -> None:
    flat = np.array([11, 12, 13, 14, 15, 21, 31, 32], dtype=np.int64)
    got = pad_ids(flat, np.array([5, 0, 1, 2]), 2, keep="first")
    assert got.tolist() == [[11, 12], [0, 0], [0, 21], [31, 32]]


def test_keep_first_is_for_bags() -> None:
    enc = ListEncoder(ListFeature(name="g", kind="bag", delimiter="|", max_len=2, keep="first"))
    enc.partial_fit(pa.array(["a|b|c"]))
    enc.finalize()
    # ids: a 2, b 3, c 4 (0 padding, 1 OOV); the first two values of each row are kept
    assert enc.transform(pa.array(["c|b|a", "a"])).tolist() == [[4, 3], [0, 2]]
    with pytest.raises(ValidationError, match="keep: first is for bags"):
        ListFeature(name="h", kind="sequence", keep="first")


def test_pad_ids_wider_than_every_row() -> None:
    got = pad_ids(np.array([1, 2, 3, 4]), np.array([3, 1]), 4)
    assert got.tolist() == [[0, 1, 2, 3], [0, 0, 0, 4]]


def test_pad_ids_all_empty_and_no_rows() -> None:
    assert pad_ids(np.array([], np.int64), np.array([0, 0]), 3).tolist() == [[0] * 3] * 2
    assert pad_ids(np.array([], np.int64), np.array([], np.int64), 3).shape == (0, 3)


def test_pad_ids_matches_python_reference() -> None:
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 9, 50)
    flat = rng.integers(2, 1000, int(counts.sum()))
    for max_len in (1, 3, 8, 12):
        expected, pos = [], 0
        for c in counts:
            row = flat[pos:pos + c].tolist()[-max_len:]
            expected.append([0] * (max_len - len(row)) + row)
            pos += c
        assert pad_ids(flat, counts, max_len).tolist() == expected


# ------------------------------------------------------------------------------ ListEncoder
def test_list_encoder_own_vocabulary() -> None:
    spec = ListFeature(name="g", kind="bag", delimiter="|", max_len=3, min_count=2)
    enc = ListEncoder(spec)
    assert enc.owns_vocab
    enc.partial_fit(pa.array(["a|b|c", "b|a"]))
    enc.partial_fit(pa.array(["b", None]))
    enc.finalize()
    # counts: b 3, a 2, c 1 -> c is below min_count; vocabulary b=2, a=3
    assert enc.vocab.vocab_.to_pylist() == ["b", "a"]
    assert enc.cardinality == 4
    assert enc.lengths_ == {"mean": 6 / 4, "max": 3}
    got = enc.transform(pa.array(["c|a|b", "b", None, "zz|a", "a|b|a|b"]))
    assert got.dtype == np.int64 and got.shape == (5, 3)
    assert got.tolist() == [[1, 3, 2], [0, 0, 2], [0, 0, 0], [0, 1, 3], [2, 3, 2]]
    assert got.max() < enc.cardinality


def test_list_encoder_ids_start_at_two_and_padding_is_zero() -> None:
    enc = ListEncoder(ListFeature(name="g", max_len=4))
    enc.partial_fit(pa.array(["x,y,z", "z"]))
    enc.finalize()
    got = enc.transform(pa.array(["x,y,z", "z", ""]))
    real = got[got != 0]
    assert real.min() >= 2 and set(real.tolist()) == {2, 3, 4}
    assert (got[:, 0] == 0).all()  # every row shorter than max_len is left-padded


def test_list_encoder_own_vocabulary_max_size_and_hash_buckets() -> None:
    spec = ListFeature(name="g", kind="bag", delimiter="|", max_len=4, max_size=2,
                       hash_buckets=7)
    enc = ListEncoder(spec)
    enc.partial_fit(pa.array(["a|b|c", "a|b", "a"]))
    enc.finalize()
    assert enc.vocab.vocab_.to_pylist() == ["a", "b"]  # c (count 1) is beyond max_size
    assert enc.cardinality == 2 + 2 + 7
    got = enc.transform(pa.array(["b|c|zz|a"]))
    h = (stable_hash(pa.array(["c", "zz"])) % np.uint64(7)).astype(np.int64)
    assert got.tolist() == [[3, 4 + h[0], 4 + h[1], 2]]


def test_list_encoder_transform_before_fit_raises() -> None:
    enc = ListEncoder(ListFeature(name="g"))
    with pytest.raises(NotFittedError):
        enc.transform(pa.array(["a"]))


def test_list_encoder_shared_vocabulary_counts_list_values() -> None:
    item = CategoricalEncoder(CategoricalFeature(name="item"))
    enc = ListEncoder(ListFeature(name="hist", share="item", max_len=3), shared=item)
    assert not enc.owns_vocab and enc.vocab is item
    item.partial_fit(pa.array(["i1", "i2", "i1"]))
    enc.partial_fit(pa.array(["i3,i2", None, "i1,i3,i4,i2"]))
    item.finalize()
    enc.finalize()
    # i1: 2 + 1, i2: 1 + 2, i3: 0 + 2, i4: 0 + 1 (i3 and i4 only seen in histories)
    assert item.vocab_.to_pylist() == ["i1", "i2", "i3", "i4"]
    assert item.counts_.tolist() == [3, 3, 2, 1]
    assert enc.cardinality == item.cardinality == 6
    assert item.transform(pa.array(["i4", "nope"])).tolist() == [5, 1]
    got = enc.transform(pa.array(["i3,i2", None, "i1,i3,i4,i2"]))
    assert got.tolist() == [[0, 4, 3], [0, 0, 0], [4, 5, 3]]


# the package's feature defaults switched off: these tests check the encoding itself
NEUTRAL = {"categorical_defaults": {"min_count": 1},
           "numeric_defaults": {"log1p": False, "standardize": False, "buckets": 0}}


def _list_features() -> FeaturesConfig:
    return FeaturesConfig(**NEUTRAL, categorical=["item", "user"], lists=[
        {"name": "hist", "column": "hist_item", "share": "item", "max_len": 3},
        {"name": "genres", "kind": "bag", "delimiter": "|", "max_len": 2, "pooling": "sum"},
        {"name": "title", "kind": "text", "max_len": 4}])


def _list_table() -> pa.Table:
    return pa.table({"label": [1.0, 0.0, 1.0], "item": ["i1", "i2", "i1"],
                     "user": ["u1", "u2", "u1"],
                     "hist_item": ["i3,i2", None, "i1,i3,i4,i2"],
                     "genres": ["x|y", "y", ""],
                     "title": ["The Matrix", "the END", None]})


def test_pipeline_list_features_values() -> None:
    pipe = FeaturePipeline(_list_features()).fit([_list_table()])
    out = pipe.transform(_list_table())
    seq = out["sequences"]
    assert set(seq) == {"hist", "genres", "title"}
    assert seq["hist"].tolist() == [[0, 4, 3], [0, 0, 0], [4, 5, 3]]
    # genres: y 2, x 1 -> y=2, x=3
    assert seq["genres"].tolist() == [[3, 2], [0, 2], [0, 0]]
    # title tokens: the 2, matrix 1, end 1 -> the=2, end=3, matrix=4
    assert seq["title"].tolist() == [[0, 0, 2, 4], [0, 0, 2, 3], [0, 0, 0, 0]]
    # the shared vocabulary also gives the item column its ids
    assert out["sparse"][:, 0].tolist() == [2, 3, 2]


def test_pipeline_schema_sequences_and_own_tables() -> None:
    pipe = FeaturePipeline(_list_features()).fit([_list_table()])
    schema = pipe.schema()
    assert schema.sparse == [SparseFeatureSpec("item", 6), SparseFeatureSpec("user", 4)]
    assert schema.sequences == [SequenceFeatureSpec("hist", 3, "item", None),
                                SequenceFeatureSpec("genres", 2, "genres", "sum"),
                                SequenceFeatureSpec("title", 4, "title", "mean")]
    # a shared list has no table of its own
    assert schema.own_tables == [SparseFeatureSpec("genres", 4), SparseFeatureSpec("title", 5)]
    assert [s.name for s in schema.bags] == ["genres", "title"]
    assert [s.name for s in schema.behaviour] == ["hist"]
    roles = pipe.roles()
    assert roles.lists == ["hist_item", "genres", "title"]


def test_pipeline_list_state_round_trip(tmp_path) -> None:
    pipe = FeaturePipeline(_list_features()).fit([_list_table()])
    pipe.save(tmp_path / "p")
    back = FeaturePipeline.load(tmp_path / "p")
    assert back.schema() == pipe.schema()
    assert [e.lengths_ for e in back.lists] == [e.lengths_ for e in pipe.lists]
    # the shared list encoder uses the loaded categorical encoder, not a copy
    assert back.lists[0].vocab is back.categorical[0]
    assert [e.owns_vocab for e in back.lists] == [False, True, True]
    q = pa.table({"label": [0.0, 1.0], "item": ["i4", "new"], "user": ["u2", "u9"],
                  "hist_item": ["new,i4,i1,i1", "i2"], "genres": ["y|x|zz", None],
                  "title": ["END of the matrix", "unseen"]})
    a, b = pipe.transform(q), back.transform(q)
    for k in a["sequences"]:
        assert a["sequences"][k].dtype == b["sequences"][k].dtype == np.int64
        np.testing.assert_array_equal(a["sequences"][k], b["sequences"][k])
    np.testing.assert_array_equal(a["sparse"], b["sparse"])
    assert a["sequences"]["hist"].tolist() == [[5, 2, 2], [0, 0, 3]]


# -------------------------------------------------------------------------- quantile buckets
def _quantile(values: np.ndarray, buckets: int, chunks: int = 3) -> CategoricalEncoder:
    enc = CategoricalEncoder(CategoricalFeature(name="q", bucketize="quantile", buckets=buckets))
    for part in np.array_split(values, chunks):
        enc.partial_fit(pa.array(part))
    enc.partial_fit(pa.array([None, None], pa.float64()))  # missing values are not sampled
    enc.finalize()
    return enc


def test_quantile_boundaries_equal_numpy_quantiles() -> None:
    x = np.random.default_rng(0).normal(size=1000)
    enc = _quantile(x, 4)
    qs = np.quantile(x, [0.25, 0.5, 0.75])
    np.testing.assert_array_equal(enc.boundaries_, qs)
    assert enc.cardinality == 2 + 1 + 4  # pad, OOV, missing, 4 buckets


def test_quantile_ids_hand_values() -> None:
    x = np.random.default_rng(1).normal(size=999)
    enc = _quantile(x, 4)
    b = np.quantile(x, [0.25, 0.5, 0.75])
    q = pa.array([None, -10.0, b[0] - 1e-9, b[0], b[1], b[2], 10.0])
    assert enc.transform(q).tolist() == [2, 3, 3, 4, 5, 6, 6]


def test_quantile_ids_are_3_plus_searchsorted_right() -> None:
    rng = np.random.default_rng(2)
    x = rng.exponential(5.0, 2000)
    enc = _quantile(x, 10, chunks=7)
    b = np.quantile(x, np.arange(1, 10) / 10)
    np.testing.assert_array_equal(enc.boundaries_, b)
    q = np.concatenate([x[:300], rng.exponential(5.0, 300), [0.0, 1e9]])
    mask = np.zeros(len(q), bool)
    mask[::17] = True
    ids = enc.transform(pa.array(q, mask=mask))
    expected = 3 + np.searchsorted(b, q, side="right")
    expected[mask] = 2
    np.testing.assert_array_equal(ids, expected)
    assert ids.min() >= 2 and ids.max() < enc.cardinality == 2 + 1 + 10


def test_quantile_ties_collapse_buckets() -> None:
    enc = _quantile(np.array([1, 1, 1, 1, 1, 1, 2, 3], dtype=np.float64), 4, chunks=1)
    # quantiles 1, 1, 1.25 -> unique boundaries [1, 1.25]
    assert enc.boundaries_.tolist() == [1.0, 1.25]
    assert enc.cardinality == 2 + 1 + 3
    assert enc.transform(pa.array([0.0, 1.0, 1.2, 1.25, 3.0, None])).tolist() == [
        3, 4, 4, 5, 5, 2]


def test_quantile_integer_input() -> None:
    enc = _quantile(np.arange(100, dtype=np.int64), 5, chunks=2)
    np.testing.assert_array_equal(enc.boundaries_, np.quantile(np.arange(100), [.2, .4, .6, .8]))


def test_quantile_state_round_trip_through_pipeline(tmp_path) -> None:
    fc = FeaturesConfig(categorical=["c", {"name": "x_q", "column": "x", "bucketize": "quantile",
                                           "buckets": 5}])
    x = np.random.default_rng(3).gamma(2.0, size=500)
    t = pa.table({"label": np.zeros(500), "c": ["a"] * 500, "x": x})
    pipe = FeaturePipeline(fc).fit([t])
    assert "x" in pipe.roles().numeric
    pipe.save(tmp_path / "p")
    back = FeaturePipeline.load(tmp_path / "p")
    np.testing.assert_array_equal(back.categorical[1].boundaries_,
                                  np.quantile(x, [.2, .4, .6, .8]))
    np.testing.assert_array_equal(back.transform(t)["sparse"], pipe.transform(t)["sparse"])
    assert back.schema().sparse[1] == SparseFeatureSpec("x_q", 2 + 1 + 5, binned=True)


def test_reservoir_keeps_a_fixed_size_sample() -> None:
    res = Reservoir(size=100, seed=0)
    for part in np.array_split(np.arange(1000, dtype=np.float64), 9):
        res.add(part)
    v = res.values()
    assert len(v) == 100 and len(np.unique(v)) == 100
    assert set(v.tolist()) <= set(range(1000))
    again = Reservoir(size=100, seed=0)
    for part in np.array_split(np.arange(1000, dtype=np.float64), 9):
        again.add(part)
    np.testing.assert_array_equal(np.sort(again.values()), np.sort(v))
    # fewer values than the size: all of them are kept
    small = Reservoir(size=100, seed=0)
    small.add(np.arange(30.0))
    small.add(np.arange(30.0, 60.0))
    assert sorted(small.values().tolist()) == list(range(60))


# ---------------------------------------------------------------------------- crossed features
def test_cross_id_is_stable_hash_of_joined_values() -> None:
    fc = FeaturesConfig(categorical=[{"name": "ab", "cross": ["a", "b"], "hash_buckets": 97},
                                     "a"])
    assert fc.categorical[0].vocab is False
    t = pa.table({"label": [1.0, 0.0, 1.0, 0.0, 1.0], "a": ["x", "y", "x", None, "y"],
                  "b": ["1", "2", "1", "z", "1"]})
    pipe = FeaturePipeline(fc).fit([t])
    ids = pipe.transform(t)["sparse"][:, 0]
    joined = pa.array(["x\x1f1", "y\x1f2", "x\x1f1", "\x1fz", "y\x1f1"])
    expected = 2 + (stable_hash(joined) % np.uint64(97)).astype(np.int64)
    np.testing.assert_array_equal(ids, expected)
    assert ids[0] == ids[2]  # equal column pairs, equal ids
    assert pipe.schema().sparse[0] == SparseFeatureSpec("ab", 2 + 97)
    assert ids.min() >= 2 and ids.max() < 99
    # the crossed columns are read as categories
    assert {"a", "b"} <= set(pipe.roles().categorical)


def test_cross_three_columns_and_round_trip(tmp_path) -> None:
    fc = FeaturesConfig(categorical=[{"name": "abc", "cross": ["a", "b", "c"],
                                      "hash_buckets": 1000}])
    t = pa.table({"label": [0.0, 1.0], "a": ["p", "p"], "b": ["q", "q"], "c": ["r", "s"]})
    pipe = FeaturePipeline(fc).fit([t])
    expected = 2 + (stable_hash(pa.array(["p\x1fq\x1fr", "p\x1fq\x1fs"]))
                    % np.uint64(1000)).astype(np.int64)
    np.testing.assert_array_equal(pipe.transform(t)["sparse"][:, 0], expected)
    pipe.save(tmp_path / "p")
    np.testing.assert_array_equal(FeaturePipeline.load(tmp_path / "p").transform(t)["sparse"],
                                  pipe.transform(t)["sparse"])


def test_cross_config_needs_hash_buckets_and_two_columns() -> None:
    with pytest.raises(ValidationError, match="cross needs hash_buckets > 0"):
        CategoricalFeature(name="ab", cross=["a", "b"])
    with pytest.raises(ValidationError, match="two or more columns"):
        CategoricalFeature(name="ab", cross=["a"], hash_buckets=10)
    raw = {"data": {"format": "synthetic"},
           "features": {"categorical": [{"name": "ab", "cross": ["a", "b"]}]}}
    with pytest.raises(ConfigError, match="hash_buckets"):
        load_config(raw=raw)


def test_list_feature_config_checks() -> None:
    with pytest.raises(ValidationError, match="remove share"):
        ListFeature(name="t", kind="text", share="item")
    with pytest.raises(ValidationError, match="delimiter"):
        ListFeature(name="t", delimiter="")
    with pytest.raises(ValidationError, match="not a categorical feature"):
        FeaturesConfig(categorical=["item"], lists=[{"name": "h", "share": "itm"}])
    with pytest.raises(ValidationError, match="unique"):
        FeaturesConfig(categorical=["item"], lists=[{"name": "item"}])


def test_jieba_tokenizer_segments_chinese():
    pytest.importorskip("jieba")
    lists = split_lists(pa.array(["我爱北京天安门"]),
                        ListFeature(name="t", kind="text", tokenizer="jieba"))
    tokens = lists.to_pylist()[0]
    assert "".join(tokens) == "我爱北京天安门" and len(tokens) > 1
