"""Ids from values: a stable 64-bit hash (FNV-1a over the UTF-8 text), values as text, and
an index from values to their vocabulary position."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)



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
