"""List features (bags, sequences, text): splitting, tokenising, padding and the encoder
that shares or owns a vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.config import ListFeature
from sampan.data.hashing import as_string
from sampan.data.transforms import (
    CategoricalEncoder,
    NotFittedError,
)


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


def pad_ids(flat_ids: np.ndarray, counts: np.ndarray, max_len: int,
            keep: str = "last") -> np.ndarray:
    """Per-row id lists -> ``[N, max_len]``: the last (or, with ``keep="first"``, the first)
    ``max_len`` ids of each row, right-aligned, left-padded with 0 (so the most recent event
    is always the last column).

    >>> pad_ids(np.array([5, 6, 7, 8]), np.array([3, 0, 1]), 2).tolist()
    [[6, 7], [0, 0], [0, 8]]
    >>> pad_ids(np.array([5, 6, 7, 8]), np.array([3, 0, 1]), 2, keep="first").tolist()
    [[5, 6], [0, 0], [0, 8]]
    """
    n = len(counts)
    ends = np.cumsum(counts)
    take = np.minimum(counts, max_len)
    first = ends - counts if keep == "first" else ends - take
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

    def merge(self, other: ListEncoder) -> None:
        """Add what ``other`` fitted on other rows (a shared vocabulary is merged by its
        own feature)."""
        self._len_sum += other._len_sum
        self._len_max = max(self._len_max, other._len_max)
        self._rows += other._rows
        if self.owns_vocab:
            self.vocab.merge(other.vocab)

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
        return pad_ids(ids, counts, self.spec.max_len, self.spec.keep)

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
