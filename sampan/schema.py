"""What the model sees: typed descriptions of the transformed features and embedding tables.

A :class:`DataSchema` is produced by the fitted :class:`~sampan.data.pipeline.FeaturePipeline`
and saved with the processed data; models are built from it, never from raw columns.

Legend used in shapes across Sampan: ``B`` batch, ``F`` sparse fields, ``Nd`` dense features,
``D`` embedding dim, ``T`` tasks (labels), ``L`` sequence length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class SparseFeatureSpec:
    """One categorical field after encoding: ids are in ``[0, cardinality)``."""

    name: str
    cardinality: int


@dataclass(frozen=True)
class SequenceFeatureSpec:
    """A behaviour sequence ``[B, L]`` of ids of sparse feature ``table`` (it shares that
    feature's embedding rows). Id 0 is padding; the most recent event is last."""

    name: str
    max_len: int
    table: str


@dataclass(frozen=True)
class TableSpec:
    """An embedding table: ``rows`` x ``dim``, looked up by the listed features.

    Several tables of one dim are fused into a single tensor by
    :class:`~sampan.embedding.EmbeddingCollection`; the spec stays the logical view.
    """

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]


@dataclass
class DataSchema:
    """The Batch contract for one dataset: column order of ``dense``, ``sparse`` and ``labels``."""

    dense: list[str] = field(default_factory=list)
    sparse: list[SparseFeatureSpec] = field(default_factory=list)
    labels: list[str] = field(default_factory=lambda: ["label"])
    has_group: bool = False
    sequences: list[SequenceFeatureSpec] = field(default_factory=list)

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    @property
    def num_sparse(self) -> int:
        return len(self.sparse)

    @property
    def num_tasks(self) -> int:
        return len(self.labels)

    def tables(self, dim: int) -> list[TableSpec]:
        """One table per sparse feature, all of dimension ``dim``; sequences join the table
        of the feature they share."""
        shared: dict[str, list[str]] = {}
        known = {f.name for f in self.sparse}
        for s in self.sequences:
            if s.table not in known:
                raise ValueError(f"sequence {s.name!r} shares table {s.table!r}, which is not "
                                 f"a sparse feature; known: {sorted(known)}")
            shared.setdefault(s.table, []).append(s.name)
        return [TableSpec(f.name, f.cardinality, dim, (f.name, *shared.get(f.name, [])))
                for f in self.sparse]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DataSchema:
        return cls(
            dense=list(d["dense"]),
            sparse=[SparseFeatureSpec(**s) for s in d["sparse"]],
            labels=list(d["labels"]),
            has_group=bool(d.get("has_group", False)),
            sequences=[SequenceFeatureSpec(**s) for s in d.get("sequences", [])],
        )
