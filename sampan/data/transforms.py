"""Column transforms with a streaming ``partial_fit`` / ``finalize`` / ``transform`` life cycle.

Fitted state ends in ``_``, is set only by fitting, and is saved as JSON plus ``.npy`` files
(never pickle). ``transform`` before fitting raises :class:`NotFittedError`. Every method works
on whole Arrow / NumPy columns; nothing loops over rows in Python. Hashing lives in
:mod:`~sampan.data.hashing`, list features in :mod:`~sampan.data.lists`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.config import CategoricalFeature, NumericFeature
from sampan.data.hashing import ValueIndex, as_string, stable_hash  # noqa: F401  (importable from here)

PAD_ID = 0
OOV_ID = 1
FIRST_VOCAB_ID = 2

class NotFittedError(RuntimeError):
    """``transform`` was called before the transform was fitted."""


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
        # a dynamic feature in an export bundle: its table's keys -> rows, frozen (sorted)
        self.frozen_: tuple[np.ndarray, np.ndarray] | None = None

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
        if not self.spec.vocab or self.spec.dynamic is not None:
            return
        vc = pc.value_counts(pc.fill_null(self._prepare(values), ""))
        self._parts.append(pa.table({"v": vc.field("values"), "c": vc.field("counts")}))
        self._pending += len(vc)
        # Merge the partial counts once they outgrow the merged table: memory stays
        # proportional to the vocabulary, not to the rows read.
        self._compact()

    def _compact(self) -> None:
        if self._pending > max(100_000, 2 * self._merged_size):
            self._parts = [self._merged()]
            self._merged_size = self._pending = len(self._parts[0])

    def merge(self, other: CategoricalEncoder) -> None:
        """Add the counts (or the sample) ``other`` fitted on other rows of the same
        feature: the vocabulary comes out as one encoder fitted on both would make it."""
        if self._sample is not None:
            self._sample.merge(other._sample)
            return
        self._parts += other._parts
        self._pending += sum(len(p) for p in other._parts)
        self._compact()

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
        if not self.spec.vocab or self._sample is not None or self.spec.dynamic is not None:
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
        if self.spec.dynamic is not None:  # the default row, then the capacity
            return self.spec.dynamic.capacity + 1
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
        if self.spec.dynamic is not None:  # stable 64-bit keys; 0 is padding, never a key
            keys = stable_hash(values, seed=0).view(np.int64)
            keys[keys == 0] = 1
            return keys if self.frozen_ is None else self._frozen_rows(keys)
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

    def _frozen_rows(self, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` in the frozen map; -1 for keys without one (the graph reads the
        default row for them, and they are not padding, which stays 0)."""
        fk, fr = self.frozen_  # type: ignore[misc]
        pos = np.minimum(np.searchsorted(fk, keys), max(len(fk) - 1, 0))
        hit = (fk[pos] == keys) if len(fk) else np.zeros(len(keys), dtype=bool)
        return np.where(hit, fr[pos] if len(fr) else 0, -1).astype(np.int64)

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
        if d.get("frozen_map") is not None:
            enc.frozen_ = (np.load(directory / f"{d['frozen_map']}.keys.npy", allow_pickle=False),
                           np.load(directory / f"{d['frozen_map']}.rows.npy", allow_pickle=False))
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

    def reseed(self, seed: Any) -> None:
        """Draw the keys of the values still to come from ``seed`` (a part of a stream
        sampled apart from the others needs keys independent of theirs)."""
        self.rng = np.random.default_rng(seed)

    def merge(self, other: Reservoir) -> None:
        """Keep the ``size`` smallest keys of both: a uniform sample of both streams
        (the same values as one reservoir when both together hold at most ``size``)."""
        keys = np.concatenate([self.keys, other.keys])
        vals = np.concatenate([self.vals, other.vals])
        if len(keys) > self.size:
            keep = np.argpartition(keys, self.size)[: self.size]
            keys, vals = keys[keep], vals[keep]
        self.keys, self.vals = keys, vals


class NumericEncoder:
    """fill missing -> clip -> signed log1p -> standardize; statistics from one streaming pass.

    >>> enc = NumericEncoder(NumericFeature(name="x", fill="mean", standardize=True))
    >>> enc.partial_fit(pa.array([1.0, 3.0, None])); enc.finalize()
    >>> enc.fill_, [round(v, 4) for v in enc.transform(pa.array([None, 3.0])).tolist()]
    (2.0, [0.0, 1.2247])
    """

    def __init__(self, spec: NumericFeature):
        self.spec = spec
        self._shaped = (0, 0.0, 0.0)  # count, mean, M2 of non-missing shaped values
        # each chunk's (count, mean, M2), in order: merging fits of parts folds them in
        # the order one fit over every chunk would, to the last bit
        self._chunks: list[tuple[int, float, float]] = []
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
        t = self._shape(x)
        tm = float(t.mean())
        chunk = (len(t), tm, float(np.square(t - tm).sum()))
        self._chunks.append(chunk)
        self._shaped = self._merge(self._shaped, chunk)

    def merge(self, other: NumericEncoder) -> None:
        """Add the statistics ``other`` fitted on the rows after this one's."""
        for chunk in other._chunks:
            self._shaped = self._merge(self._shaped, chunk)
        self._chunks += other._chunks
        self._n_missing += other._n_missing

    def _unshape(self, t: float) -> float:
        """The raw value whose :meth:`_shape` is ``t`` (``t`` within the clip range)."""
        return float(np.sign(t) * np.expm1(abs(t))) if self.spec.log1p else t

    def finalize(self) -> None:
        self._chunks = []  # fitted: nothing more is merged into it
        n_shaped, shaped_mean, _ = self._shaped
        # fill "mean": the value the mean of the shaped (clipped, log1p'd) train values comes
        # from, so a missing value enters at the average the model sees (0 once
        # standardized) and the bucket twin's missing id carries what missing means; the raw
        # mean of a heavy-tailed count would put it far up the tail
        self.fill_ = (self._unshape(shaped_mean) if n_shaped else 0.0) \
            if self.spec.fill == "mean" else float(self.spec.fill)
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
