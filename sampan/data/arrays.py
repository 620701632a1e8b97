"""The processed dataset on disk, opened: :class:`Store` and its splits' arrays (built by
:func:`sampan.data.store.build_store`).

Layout of ``<run>/data``::

    manifest.json          schema, rows per split, sources, reject counts, what was fitted on
    rejects.jsonl          every rejected raw row: file, line, reason, column, text
    pipeline/              the fitted FeaturePipeline (pipeline.json + vocab .npy files)
    train/ valid/ test/    one .npy per Batch field, rows aligned:
        dense.npy  [N, Nd] float32      sparse.npy [N, F] int32 (int64 for > 2^31 ids)
        labels.npy [N, T]  float32      group.npy  [N] int64   (when features.group is set)
        oracle.npy [N]     float64      (when data.oracle_column is set)

The arrays are opened memory-mapped, so the loader slices them without reading a whole
split into memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sampan.data.pipeline import FeaturePipeline
from sampan.errors import DataError
from sampan.schema import DataSchema

SPLITS = ("train", "valid", "test")
FIELDS = ("dense", "sparse", "labels", "group", "oracle")


@dataclass
class SplitArrays:
    """Row-aligned arrays of one split (memory-mapped when loaded from disk)."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray | None = None
    group: np.ndarray | None = None
    oracle: np.ndarray | None = None
    sequences: dict[str, np.ndarray] | None = None  # name -> [N, L] int64, 0 = padding
    line: np.ndarray | None = None  # source line numbers (files read for eval / predict)

    def __len__(self) -> int:
        return int(self.sparse.shape[0])

    def nbytes(self) -> int:
        """Bytes of the arrays a batch is made of (``line`` is not)."""
        arrays = [self.dense, self.sparse, self.labels, self.group, self.oracle,
                  *(self.sequences or {}).values()]
        return sum(a.nbytes for a in arrays if a is not None)

    def positive_rows(self) -> np.ndarray:
        """Indices of the rows whose first label is 1 (every row without labels)."""
        if self.labels is None:
            return np.arange(len(self))
        return np.flatnonzero(np.asarray(self.labels[:, 0]) > 0.5)

    def take(self, rows: np.ndarray) -> SplitArrays:
        """The rows ``rows`` (indices or a boolean mask) of every array, as a new in-memory
        split."""
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.ascontiguousarray(a[rows])

        return SplitArrays(dense=pick(self.dense), sparse=pick(self.sparse),
                           labels=pick(self.labels), group=pick(self.group),
                           oracle=pick(self.oracle), line=pick(self.line),
                           sequences={k: pick(v) for k, v in self.sequences.items()}
                           if self.sequences else None)

    @classmethod
    def load(cls, directory: Path, mmap: bool = True) -> SplitArrays:
        mode = "r" if mmap else None
        arrays = {f: np.load(directory / f"{f}.npy", mmap_mode=mode, allow_pickle=False)
                  for f in FIELDS if (directory / f"{f}.npy").exists()}
        seqs = {p.name[4:-4]: np.load(p, mmap_mode=mode, allow_pickle=False)
                for p in sorted(directory.glob("seq_*.npy"))}
        return cls(**arrays, sequences=seqs or None)

    @classmethod
    def concat(cls, parts: list[dict[str, np.ndarray]], oracle: str | None) -> SplitArrays:
        def cat(key: str) -> np.ndarray | None:
            if not parts or key not in parts[0]:
                return None
            return np.concatenate([p[key] for p in parts])

        if not parts:
            raise DataError("no rows left to use after reading the input")
        seqs = {k: np.concatenate([p["sequences"][k] for p in parts])
                for k in parts[0].get("sequences", {})}
        return cls(dense=cat("dense"), sparse=cat("sparse"), labels=cat("labels"),
                   group=cat("group"), oracle=cat(oracle) if oracle else None,
                   sequences=seqs or None)


@dataclass
class Store:
    """An opened processed dataset: schema, pipeline and the three splits."""

    root: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, root: str | Path) -> Store:
        root = Path(root)
        path = root / "manifest.json"
        if not path.exists():
            raise DataError(f"{root} holds no processed data (no manifest.json)")
        return cls(root, json.loads(path.read_text()))

    @property
    def schema(self) -> DataSchema:
        return DataSchema.from_json(self.manifest["schema"])

    def split(self, name: str) -> SplitArrays | None:
        if self.manifest["splits"][name]["rows"] == 0:
            return None
        return SplitArrays.load(self.root / name)

    def pipeline(self) -> FeaturePipeline:
        return FeaturePipeline.load(self.root / "pipeline")
