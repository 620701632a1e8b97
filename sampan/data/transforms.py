"""Column transforms with a streaming ``partial_fit`` / ``finalize`` / ``transform`` life cycle.

Fitted state ends in ``_``, is set only by fitting, and is saved as JSON plus ``.npy`` files
(never pickle). ``transform`` before fitting raises :class:`NotFittedError`. Every method works
on whole Arrow / NumPy columns; nothing loops over rows in Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.config import CategoricalFeature, ListFeature, NumericFeature

PAD_ID = 0
OOV_ID = 1
FIRST_VOCAB_ID = 2

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


class NotFittedError(RuntimeError):
    """``transform`` was called before the transform was fitted."""


def stable_hash(values: pa.Array, seed: int = 0) -> np.ndarray:
    """64-bit FNV-1a of each string's UTF-8 bytes, finished with a splitmix64 mix.

    Stable across processes, platforms and Python versions (unlike ``hash()``). Nulls hash
    like the empty string. Vectorised over rows; the Python loop runs over byte positions.

    >>> int(stable_hash(pa.array(["a"]))[0]) == int(stable_hash(pa.array(["a"]))[0])
    True
    """
    arr = values.cast(pa.large_string()) if not pa.types.is_large_string(values.type) else values
    arr = pc.fill_null(arr, "")
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64, count=arr.offset + n + 1)[arr.offset:]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    starts = offsets[:-1]
    lens = offsets[1:] - starts
    seed_mix = np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    h = np.full(n, _FNV_OFFSET ^ seed_mix, dtype=np.uint64)
    maxlen = int(lens.max()) if n else 0
    with np.errstate(over="ignore"):
        rows = np.arange(n)
        for j in range(maxlen):
            rows = rows[lens[rows] > j]  # strings still longer than j bytes
            h[rows] = (h[rows] ^ data[starts[rows] + j].astype(np.uint64)) * _FNV_PRIME
        # splitmix64 finaliser: spreads low-entropy FNV states before the modulo.
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return h


def as_string(values: pa.Array) -> pa.Array:
    """Categorical ids may come from numeric columns (e.g. an integer count used as a category)."""
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return values
    if pa.types.is_floating(values.type):
        # 3.0 -> "3": integral floats read as the integers they were written as. Values
        # beyond int64 precision, NaN and inf keep their float spelling.
        x = values.cast(pa.float64())
        integral = pc.and_(pc.is_finite(x), pc.less(pc.abs(x), 2.0**53))
        integral = pc.and_(integral, pc.equal(pc.floor(x), x))
        as_int = pc.if_else(integral, x, 0.0).cast(pa.int64())
        return pc.if_else(integral, as_int.cast(pa.string()), x.cast(pa.string()))
    return values.cast(pa.string())


class ValueIndex:
    """The position of each query string in a fixed array of distinct strings (``-1`` when
    absent or null), without rebuilding a hash table of the whole set per call.

    ``pc.index_in`` builds a hash table of the value set on every call: about 0.1 s for a
    million values, paid per chunk when transforming and per request when serving. When
    the set is much larger than the query, the set is instead indexed once (on first such
    use) by the 64-bit :func:`stable_hash` of its values, sorted; a query is hashed, found
    by binary search and confirmed by comparing the strings, so the answer is exact. Sets
    where two different values share a hash (odds ~n²/2⁶⁵) always use ``pc.index_in``.

    >>> ValueIndex(pa.array(["a", "b", ""])).positions(pa.array(["b", "z", None, ""])).tolist()
    [1, -1, -1, 2]
    """

    SMALL = 2048  # below this, index_in's own table costs less than hashing the query
    RATIO = 3  # the hashed path pays off once the set has RATIO x the query's values

    def __init__(self, values: pa.Array):
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        self.values = values.cast(pa.string())
        self._hashes: np.ndarray | None = None  # sorted
        self._order: np.ndarray | None = None
        self._collides = False

    def __len__(self) -> int:
        return len(self.values)

    def _hashed(self, queries: int) -> bool:
        n = len(self.values)
        if self._collides or n <= max(self.SMALL, self.RATIO * queries):
            return False
        if self._hashes is None:
            h = stable_hash(self.values)
            order = np.argsort(h, kind="stable")
            h = h[order]
            if (h[1:] == h[:-1]).any():
                self._collides = True
                return False
            self._order, self._hashes = order, h  # _hashes last: it marks the index ready
        return True

    def prepare(self, queries: int = 1) -> None:
        """Build now what a lookup of ``queries`` values would build on first use (a
        server does this at start-up rather than in its first request)."""
        self._hashed(queries)

    def positions(self, query: pa.Array) -> np.ndarray:
        """``int64 [len(query)]``: each value's position in the set, ``-1`` if absent."""
        if isinstance(query, pa.ChunkedArray):
            query = query.combine_chunks()
        query = query.cast(pa.string())
        if not self._hashed(len(query)):
            idx = pc.index_in(query, value_set=self.values, skip_nulls=True)
            return pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        hashes, order = self._hashes, self._order
        h = stable_hash(query)
        pos = np.minimum(np.searchsorted(hashes, h), len(hashes) - 1)
        cand = order[pos]
        hit = hashes[pos] == h
        hit &= pc.is_valid(query).to_numpy(zero_copy_only=False)
        rows = np.flatnonzero(hit)
        if len(rows):  # the hash agrees: confirm with the strings themselves
            same = pc.equal(pc.take(self.values, pa.array(cand[rows])),
                            pc.take(query, pa.array(rows)))
            hit[rows] = pc.fill_null(same, False).to_numpy(zero_copy_only=False)
        return np.where(hit, cand, -1).astype(np.int64)

    def take_indices(self, query: pa.Array) -> pa.Array:
        """:meth:`positions` as an Arrow index array with nulls where absent (for
        ``pc.take``, which then gives nulls)."""
        pos = self.positions(query)
        return pa.array(pos, type=pa.int64(), mask=pos < 0)


class CategoricalEncoder:
    """Maps a string column to ids: ``0`` padding, ``1`` OOV, then the vocabulary.

    Fit counts values over the train split in a streaming pass; ``min_count`` and
    ``max_size`` decide the vocabulary (most frequent first, ties by value). Missing values
    are the empty string, a category like any other.

    >>> enc = CategoricalEncoder(CategoricalFeature(name="c", min_count=2))
    >>> enc.partial_fit(pa.array(["a", "b", "a", None, None])); enc.finalize()
    >>> enc.vocab_.tolist()          # count 2 each; ties broken by value
    ['', 'a']
    >>> enc.transform(pa.array(["a", "b", None, "zzz"])).tolist()
    [3, 1, 2, 1]
    """

    def __init__(self, spec: CategoricalFeature):
        self.spec = spec
        self._parts: list[pa.Table] = []
        self._pending = 0
        self._merged_size = 0
        self.vocab_: pa.Array | None = None  # string values, id = FIRST_VOCAB_ID + position
        self._index: ValueIndex | None = None
        self._index_of: pa.Array | None = None  # the vocabulary _index was built from
        self.counts_: np.ndarray | None = None
        self.oov_count_: int | None = None
        self.boundaries_: np.ndarray | None = None  # bucketize: quantile
        self._sample = Reservoir(seed=0) if spec.bucketize == "quantile" else None

    def _prepare(self, values: pa.Array) -> pa.Array:
        if self.spec.bucketize == "log_squared":
            x = values.cast(pa.float64())
            big = pc.greater(x, 2.0)
            logsq = pc.floor(pc.power(pc.ln(pc.if_else(big, x, 3.0)), 2))
            # whole numbers by construction (inputs are finite): one cast to text
            return pc.if_else(big, logsq, pc.floor(x)).cast(pa.int64(), safe=False).cast(
                pa.string())
        return as_string(values)

    # -- fitting
    def partial_fit(self, values: pa.Array) -> None:
        if self._sample is not None:
            self._sample.add(pc.drop_null(values.cast(pa.float64())).to_numpy(
                zero_copy_only=False))
            return
        if not self.spec.vocab:
            return
        vc = pc.value_counts(pc.fill_null(self._prepare(values), ""))
        self._parts.append(pa.table({"v": vc.field("values"), "c": vc.field("counts")}))
        self._pending += len(vc)
        # Merge the partial counts once they outgrow the merged table: memory stays
        # proportional to the vocabulary, not to the rows read.
        if self._pending > max(100_000, 2 * self._merged_size):
            self._parts = [self._merged()]
            self._merged_size = self._pending = len(self._parts[0])

    def _merged(self) -> pa.Table:
        if not self._parts:
            return pa.table({"v": pa.array([], pa.string()), "c": pa.array([], pa.int64())})
        t = pa.concat_tables(self._parts)
        return t.group_by("v").aggregate([("c", "sum")]).rename_columns(["v", "c"])

    def finalize(self) -> None:
        if self._sample is not None:
            # Quantile buckets need no vocabulary: id = first id + 1 + bucket, missing first.
            x = self._sample.values()
            qs = np.quantile(x, np.arange(1, self.spec.buckets) / self.spec.buckets) \
                if len(x) else np.array([])
            self.boundaries_ = np.unique(qs)
        if not self.spec.vocab or self._sample is not None:
            self.vocab_ = pa.array([], pa.string())
            self.counts_ = np.array([], dtype=np.int64)
            self.oov_count_ = 0
            return
        t = self._merged()
        self._parts = []
        total = int(pc.sum(t.column("c")).as_py() or 0)
        t = t.filter(pc.greater_equal(t.column("c"), self.spec.min_count))
        # most frequent first; ties by value (deterministic across runs and chunkings)
        t = t.sort_by([("c", "descending"), ("v", "ascending")])
        if self.spec.max_size is not None:
            t = t.slice(0, self.spec.max_size)
        self.vocab_ = t.column("v").combine_chunks().cast(pa.string())
        self.counts_ = t.column("c").to_numpy().astype(np.int64)
        self.oov_count_ = total - int(self.counts_.sum())

    # -- state
    @property
    def index(self) -> ValueIndex:
        """The vocabulary's lookup structure, built on first use."""
        self._check()
        if self._index is None or self._index_of is not self.vocab_:
            self._index, self._index_of = ValueIndex(self.vocab_), self.vocab_
        return self._index

    @property
    def cardinality(self) -> int:
        """Number of ids this feature can produce (its rows in the embedding table)."""
        self._check()
        if self.boundaries_ is not None:  # missing + len(boundaries) + 1 buckets
            return FIRST_VOCAB_ID + len(self.boundaries_) + 2
        return FIRST_VOCAB_ID + len(self.vocab_) + self.spec.hash_buckets

    def _check(self) -> None:
        if self.vocab_ is None:
            raise NotFittedError(f"categorical feature {self.spec.name!r} is not fitted")

    def transform(self, values: pa.Array) -> np.ndarray:
        """Ids for ``values`` as int64, shape ``[len(values)]``."""
        self._check()
        if self.boundaries_ is not None:
            x = values.cast(pa.float64())
            missing = pc.is_null(x).to_numpy(zero_copy_only=False)
            xs = pc.fill_null(x, 0.0).to_numpy(zero_copy_only=False)
            ids = FIRST_VOCAB_ID + 1 + np.searchsorted(self.boundaries_, xs, side="right")
            ids[missing] = FIRST_VOCAB_ID
            return ids.astype(np.int64)
        values = pc.fill_null(self._prepare(values), "")
        if len(self.vocab_):
            ids = self.index.positions(values)
            known = ids >= 0
            ids += FIRST_VOCAB_ID
        else:
            ids = np.zeros(len(values), dtype=np.int64)
            known = np.zeros(len(values), dtype=bool)
        if self.spec.hash_buckets:
            unknown = np.nonzero(~known)[0]
            if len(unknown):
                h = stable_hash(pc.take(values, pa.array(unknown)), seed=0)
                base = FIRST_VOCAB_ID + len(self.vocab_)
                ids[unknown] = base + (h % np.uint64(self.spec.hash_buckets)).astype(np.int64)
        else:
            ids[~known] = OOV_ID
        return ids

    def state(self, directory: Path) -> dict[str, Any]:
        """Fitted state as JSON; the vocabulary goes to ``vocab_<name>.offsets.npy`` and
        ``vocab_<name>.bytes.npy`` (UTF-8 values back to back), counts to ``counts_<name>.npy``."""
        self._check()
        v = self.vocab_.cast(pa.large_string())
        offsets = np.frombuffer(v.buffers()[1], dtype=np.int64, count=len(v) + 1)
        data = np.frombuffer(v.buffers()[2], dtype=np.uint8) if len(v) and v.buffers()[2] \
            else np.empty(0, np.uint8)
        stem = f"vocab_{self.spec.name}"
        np.save(directory / f"{stem}.offsets.npy", offsets - offsets[0], allow_pickle=False)
        np.save(directory / f"{stem}.bytes.npy", data[offsets[0]:offsets[-1]], allow_pickle=False)
        np.save(directory / f"counts_{self.spec.name}.npy", self.counts_, allow_pickle=False)
        return {"spec": self.spec.model_dump(mode="json"), "vocab_file": stem,
                "vocab_size": len(v), "oov_count": self.oov_count_,
                "boundaries": None if self.boundaries_ is None else self.boundaries_.tolist()}

    @classmethod
    def from_state(cls, d: dict[str, Any], directory: Path) -> CategoricalEncoder:
        enc = cls(CategoricalFeature.model_validate(d["spec"]))
        offsets = np.load(directory / f"{d['vocab_file']}.offsets.npy", allow_pickle=False)
        data = np.load(directory / f"{d['vocab_file']}.bytes.npy", allow_pickle=False)
        v = pa.Array.from_buffers(pa.large_string(), len(offsets) - 1,
                                  [None, pa.py_buffer(offsets), pa.py_buffer(data)])
        enc.vocab_ = v.cast(pa.string())
        enc.counts_ = np.load(directory / f"counts_{enc.spec.name}.npy", allow_pickle=False)
        enc.oov_count_ = d["oov_count"]
        if d.get("boundaries") is not None:
            enc.boundaries_ = np.asarray(d["boundaries"], dtype=np.float64)
        return enc


class Reservoir:
    """A uniform sample of at most ``size`` values of a stream: every value draws a random
    key and the smallest keys are kept (deterministic for a seed and chunking)."""

    def __init__(self, size: int = 200_000, seed: int = 0):
        self.size = size
        self.rng = np.random.default_rng(seed)
        self.keys = np.empty(0)
        self.vals = np.empty(0)

    def add(self, x: np.ndarray) -> None:
        keys = np.concatenate([self.keys, self.rng.random(len(x))])
        vals = np.concatenate([self.vals, x])
        if len(keys) > self.size:
            keep = np.argpartition(keys, self.size)[: self.size]
            keys, vals = keys[keep], vals[keep]
        self.keys, self.vals = keys, vals

    def values(self) -> np.ndarray:
        return self.vals


def split_lists(values: pa.Array, spec: ListFeature) -> pa.ListArray:
    """A string column (delimited / free text) or a list column -> ``list<string>``, with
    missing values as empty lists and empty tokens dropped."""
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        lists = pc.fill_null(values, pa.scalar([], values.type))
        lists = lists.cast(pa.list_(pa.string()))
    else:
        text = pc.fill_null(as_string(values), "")
        if spec.kind == "text" and spec.tokenizer == "jieba":
            lists = _jieba_tokens(text)
        elif spec.kind == "text":
            lists = pc.split_pattern_regex(pc.utf8_lower(text), r"[^\pL\pN_]+")  # Unicode
        else:
            lists = pc.split_pattern(text, spec.delimiter)
    flat = pc.list_flatten(lists)
    is_list = pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
    if spec.kind == "sequence" and is_list:
        # positions matter (an item history and its category history must stay aligned):
        # a missing element of a list is kept, as the missing value
        return pa.ListArray.from_arrays(lists.offsets, pc.fill_null(flat, ""))
    keep = pc.fill_null(pc.not_equal(flat, ""), False).to_numpy(zero_copy_only=False)
    if keep.all():
        return lists
    rows = pc.list_parent_indices(lists).to_numpy()
    counts = np.bincount(rows[keep], minlength=len(lists))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pc.filter(flat, pa.array(keep)))


def _jieba_tokens(text: pa.Array) -> pa.ListArray:
    try:
        import jieba
    except ImportError:
        raise ImportError("tokenizer: jieba needs the jieba package: pip install jieba") from None
    # jieba segments one string at a time: this is the one per-row Python loop, and only
    # for Chinese text features.
    return pa.array([[t for t in jieba.lcut(s) if t.strip()] for s in text.to_pylist()],
                    pa.list_(pa.string()))


def pad_ids(flat_ids: np.ndarray, counts: np.ndarray, max_len: int) -> np.ndarray:
    """Per-row id lists -> ``[N, max_len]``: the last ``max_len`` ids of each row, right-
    aligned, left-padded with 0 (so the most recent event is always the last column).

    >>> pad_ids(np.array([5, 6, 7, 8]), np.array([3, 0, 1]), 2).tolist()
    [[6, 7], [0, 0], [0, 8]]
    """
    n = len(counts)
    ends = np.cumsum(counts)
    take = np.minimum(counts, max_len)
    first = ends - take
    pad = max_len - take
    col = np.arange(max_len)[None, :]
    valid = col >= pad[:, None]
    src = first[:, None] + col - pad[:, None]
    out = np.zeros((n, max_len), dtype=np.int64)
    out[valid] = flat_ids[src[valid]]
    return out


class ListEncoder:
    """A list feature -> ids ``[N, max_len]`` through its own or a shared vocabulary.

    A shared vocabulary (``share: item_id``) also counts the list's values when it is fitted,
    so items seen only in histories still get ids.

    >>> enc = ListEncoder(ListFeature(name="g", kind="bag", delimiter="|", max_len=3))
    >>> enc.partial_fit(pa.array(["a|b", "b", None])); enc.finalize()
    >>> enc.transform(pa.array(["b|a", "zz|b|a|b", None])).tolist()
    [[0, 2, 3], [2, 3, 2], [0, 0, 0]]
    """

    def __init__(self, spec: ListFeature, shared: CategoricalEncoder | None = None):
        self.spec = spec
        self.vocab = shared if shared is not None else CategoricalEncoder(spec.as_categorical())
        self.owns_vocab = shared is None
        self.lengths_: dict[str, float] | None = None
        self._len_sum = 0
        self._len_max = 0
        self._rows = 0

    def partial_fit(self, values: pa.Array) -> None:
        lists = split_lists(values, self.spec)
        lens = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
        self._len_sum += int(lens.sum())
        self._len_max = max(self._len_max, int(lens.max()) if len(lens) else 0)
        self._rows += len(lens)
        self.vocab.partial_fit(pc.list_flatten(lists))

    def finalize(self) -> None:
        if self.owns_vocab:
            self.vocab.finalize()
        self.lengths_ = {"mean": self._len_sum / self._rows if self._rows else 0.0,
                         "max": self._len_max}

    @property
    def cardinality(self) -> int:
        return self.vocab.cardinality

    def transform(self, values: pa.Array) -> np.ndarray:
        if self.lengths_ is None:
            raise NotFittedError(f"list feature {self.spec.name!r} is not fitted")
        lists = split_lists(values, self.spec)
        ids = self.vocab.transform(pc.list_flatten(lists))
        counts = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
        return pad_ids(ids, counts, self.spec.max_len)

    def state(self, directory: Path) -> dict[str, Any]:
        if self.lengths_ is None:
            raise NotFittedError(f"list feature {self.spec.name!r} is not fitted")
        return {"spec": self.spec.model_dump(mode="json"), "lengths": self.lengths_,
                "vocab": self.vocab.state(directory) if self.owns_vocab else None}

    @classmethod
    def from_state(cls, d: dict[str, Any], directory: Path,
                   shared: CategoricalEncoder | None) -> ListEncoder:
        enc = cls(ListFeature.model_validate(d["spec"]), shared)
        if d["vocab"] is not None:
            enc.vocab = CategoricalEncoder.from_state(d["vocab"], directory)
        enc.lengths_ = d["lengths"]
        return enc


class NumericEncoder:
    """fill missing -> clip -> signed log1p -> standardize; statistics from one streaming pass.

    >>> enc = NumericEncoder(NumericFeature(name="x", fill="mean", standardize=True))
    >>> enc.partial_fit(pa.array([1.0, 3.0, None])); enc.finalize()
    >>> enc.fill_, [round(v, 4) for v in enc.transform(pa.array([None, 3.0])).tolist()]
    (2.0, [0.0, 1.2247])
    """

    def __init__(self, spec: NumericFeature):
        self.spec = spec
        self._raw = (0, 0.0)  # count, mean of non-missing raw values (for fill: mean)
        self._shaped = (0, 0.0, 0.0)  # count, mean, M2 of non-missing shaped values
        self._n_missing = 0
        self.fill_: float | None = None
        self.mean_: float | None = None
        self.std_: float | None = None
        self.missing_rate_: float | None = None

    def _shape(self, x: np.ndarray) -> np.ndarray:
        """clip + log1p (no fill, no standardize): the part whose statistics we collect."""
        if self.spec.clip is not None:
            lo, hi = self.spec.clip
            x = np.clip(x, -np.inf if lo is None else lo, np.inf if hi is None else hi)
        if self.spec.log1p:
            x = np.sign(x) * np.log1p(np.abs(x))
        return x

    @staticmethod
    def _merge(a: tuple[int, float, float], b: tuple[int, float, float]
               ) -> tuple[int, float, float]:
        """Combine (count, mean, M2) of two parts without catastrophic cancellation."""
        na, ma, sa = a
        nb, mb, sb = b
        n = na + nb
        if n == 0:
            return 0, 0.0, 0.0
        delta = mb - ma
        return n, ma + delta * nb / n, sa + sb + delta * delta * na * nb / n

    def partial_fit(self, values: pa.Array) -> None:
        x = pc.drop_null(values).to_numpy(zero_copy_only=False).astype(np.float64)
        self._n_missing += len(values) - len(x)
        if not len(x):
            return
        n0, m0 = self._raw
        self._raw = (n0 + len(x), m0 + (float(x.mean()) - m0) * len(x) / (n0 + len(x)))
        t = self._shape(x)
        tm = float(t.mean())
        self._shaped = self._merge(self._shaped, (len(t), tm, float(np.square(t - tm).sum())))

    def finalize(self) -> None:
        n_raw, raw_mean = self._raw
        self.fill_ = (raw_mean if n_raw else 0.0) if self.spec.fill == "mean" \
            else float(self.spec.fill)
        # Missing values enter the statistics as the filled, shaped value.
        tf = float(self._shape(np.array([self.fill_]))[0])
        n, mean, m2 = self._merge(self._shaped, (self._n_missing, tf, 0.0))
        self.mean_ = mean
        self.std_ = float(np.sqrt(m2 / n)) if n else 0.0
        self.missing_rate_ = self._n_missing / n if n else 0.0

    def transform(self, values: pa.Array) -> np.ndarray:
        """Transformed values as float32, shape ``[len(values)]``."""
        if self.fill_ is None:
            raise NotFittedError(f"numeric feature {self.spec.name!r} is not fitted")
        x = pc.fill_null(values.cast(pa.float64()), self.fill_).to_numpy(zero_copy_only=False)
        x = self._shape(x)
        if self.spec.standardize:
            x = (x - self.mean_) / (self.std_ if self.std_ > 1e-12 else 1.0)
        return x.astype(np.float32)

    def state(self, directory: Path) -> dict[str, Any]:
        if self.fill_ is None:
            raise NotFittedError(f"numeric feature {self.spec.name!r} is not fitted")
        return {"spec": self.spec.model_dump(mode="json"), "fill": self.fill_, "mean": self.mean_,
                "std": self.std_, "missing_rate": self.missing_rate_}

    @classmethod
    def from_state(cls, d: dict[str, Any], directory: Path) -> NumericEncoder:
        enc = cls(NumericFeature.model_validate(d["spec"]))
        enc.fill_, enc.mean_, enc.std_ = d["fill"], d["mean"], d["std"]
        enc.missing_rate_ = d["missing_rate"]
        return enc
