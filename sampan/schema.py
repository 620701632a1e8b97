"""What the model sees: typed descriptions of the transformed features and embedding tables.

A :class:`DataSchema` is produced by the fitted :class:`~sampan.data.pipeline.FeaturePipeline`
and saved with the processed data; models are built from it, never from raw columns.

Legend used in shapes across Sampan: ``B`` batch, ``F`` sparse fields, ``Nd`` dense features,
``D`` embedding dim, ``T`` tasks (labels), ``L`` sequence length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sampan.errors import ConfigError


@dataclass(frozen=True)
class DynamicSpec:
    """A dynamic table: no fitted vocabulary; the feature's values are 64-bit keys (0:
    padding), and a key gets a row of the table's ``capacity`` when it is admitted (seen
    ``min_count`` times, then with ``probability``), losing it to eviction (``policy``
    ``lfu``, ``lru`` or ``ttl`` with ``ttl_steps``) when the table is full. Row 0 is the
    shared default row of every key without one. See :mod:`sampan.embedding.dynamic`."""

    capacity: int
    min_count: int = 1
    probability: float = 1.0
    policy: str = "lfu"
    ttl_steps: int | None = None
    evict_fraction: float = 0.01


@dataclass(frozen=True)
class SparseFeatureSpec:
    """One categorical field after encoding: ids are in ``[0, cardinality)``; with
    ``dynamic``, 64-bit keys mapped to the ``cardinality = capacity + 1`` rows. ``binned``:
    its ids are bins of a number (``bucketize``, or a numeric column's bucket twin), which
    the exact LR of the warm start regularises with an L2 strength of their own."""

    name: str
    cardinality: int
    dynamic: DynamicSpec | None = None
    binned: bool = False


@dataclass(frozen=True)
class SequenceFeatureSpec:
    """A list feature ``[B, L]`` of ids into table ``table`` (a sparse feature's name when it
    shares that feature's rows, else its own). Id 0 is padding.

    ``pooling`` ``None``: a behaviour sequence (most recent last) that attention models
    attend over and other models mean-pool; ``"sum"`` / ``"mean"``: a bag pooled into one
    field for every model.
    """

    name: str
    max_len: int
    table: str
    pooling: str | None = None

    @property
    def is_bag(self) -> bool:
        return self.pooling is not None


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
    field: bool = True  # the table's first feature is a column of Batch.sparse
    # where the table is allocated (None: torch's default device); "meta" defers it to a
    # data-parallel strategy, which materialises each process's rows (see DataSchema)
    device: str | None = None
    dynamic: DynamicSpec | None = None  # rows = capacity + 1, keys mapped to them


@dataclass
class DataSchema:
    """The Batch contract for one dataset: column order of ``dense``, ``sparse`` and ``labels``."""

    dense: list[str] = field(default_factory=list)
    sparse: list[SparseFeatureSpec] = field(default_factory=list)
    labels: list[str] = field(default_factory=lambda: ["label"])
    has_group: bool = False
    sequences: list[SequenceFeatureSpec] = field(default_factory=list)
    # Tables of list features with their own vocabulary (not a column of Batch.sparse).
    own_tables: list[SparseFeatureSpec] = field(default_factory=list)
    # Not data, never saved: where models built from this schema allocate their embedding
    # tables (each TableSpec's device). A distributed run builds with "meta" (see
    # :meth:`with_table_device`), so that no process allocates a whole table, and its
    # strategy then materialises only the rows the process keeps.
    table_device: str | None = field(default=None, compare=False, repr=False)

    def with_table_device(self, device: str | None) -> DataSchema:
        """This schema, with models built from it allocating their tables on ``device``."""
        return replace(self, table_device=device)

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    @property
    def num_sparse(self) -> int:
        return len(self.sparse)

    @property
    def num_tasks(self) -> int:
        return len(self.labels)

    @property
    def bags(self) -> list[SequenceFeatureSpec]:
        return [s for s in self.sequences if s.is_bag]

    @property
    def behaviour(self) -> list[SequenceFeatureSpec]:
        return [s for s in self.sequences if not s.is_bag]

    def num_fields(self, pooled_sequences: bool = True) -> int:
        """Fields a model sees: sparse columns + bags (+ mean-pooled behaviour sequences)."""
        return self.num_sparse + len(self.bags) + (len(self.behaviour) if pooled_sequences
                                                   else 0)

    def tables(self, dim: int) -> list[TableSpec]:
        """One table per sparse feature, all of dimension ``dim``; sequences join the table
        of the feature they share."""
        shared: dict[str, list[str]] = {}
        own = {t.name for t in self.own_tables}
        known = {f.name for f in self.sparse} | own
        for s in self.sequences:
            if s.table not in known:
                raise ConfigError(f"sequence {s.name!r} uses table {s.table!r}, which is not "
                                 f"a sparse feature or a list feature's own table; known: "
                                 f"{sorted(known)}")
            if s.table != s.name:
                shared.setdefault(s.table, []).append(s.name)
        dev = self.table_device
        return [TableSpec(f.name, f.cardinality, dim, (f.name, *shared.get(f.name, [])),
                          device=dev, dynamic=f.dynamic) for f in self.sparse] + \
            [TableSpec(t.name, t.cardinality, dim, (t.name, *shared.get(t.name, [])),
                       field=False, device=dev, dynamic=t.dynamic) for t in self.own_tables]

    def history_and_target(self, model: str, history: str | None,
                           target: str | None) -> tuple[str, int]:
        """Resolve a target-attention model's behaviour sequence and candidate feature.

        ``history`` defaults to the only behaviour sequence, ``target`` to the sparse feature
        whose ids the history holds. Returns the history's name and the target's column in
        ``Batch.sparse``; anything inconsistent fails naming the model and the options.
        """
        seqs = {s.name: s for s in self.behaviour}
        if not seqs:
            raise ConfigError(f"{model} needs a behaviour sequence (features.lists with kind: "
                             "sequence) in the data schema")
        name = history or (next(iter(seqs)) if len(seqs) == 1 else None)
        if name not in seqs:
            raise ConfigError(f"{model}: model.history must name one of the sequences "
                             f"{sorted(seqs)}, got {history!r}")
        target = target or seqs[name].table
        names = [f.name for f in self.sparse]
        if target not in names:
            raise ConfigError(f"{model}: model.target {target!r} is not a sparse feature: "
                             f"{names}")
        if seqs[name].table != target:
            raise ConfigError(f"{model}: the history {name!r} holds ids of {seqs[name].table!r}"
                             f", not of the target {target!r}; share the target's vocabulary")
        return name, names.index(target)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        del d["table_device"]  # how this process builds, not what the data is
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DataSchema:
        return cls(
            dense=list(d["dense"]),
            sparse=[_sparse_spec(s) for s in d["sparse"]],
            labels=list(d["labels"]),
            has_group=bool(d.get("has_group", False)),
            sequences=[SequenceFeatureSpec(**s) for s in d.get("sequences", [])],
            own_tables=[_sparse_spec(s) for s in d.get("own_tables", [])],
        )


def _sparse_spec(d: dict[str, Any]) -> SparseFeatureSpec:
    dyn = d.get("dynamic")
    return SparseFeatureSpec(d["name"], d["cardinality"],
                             DynamicSpec(**dyn) if dyn is not None else None,
                             bool(d.get("binned", False)))
