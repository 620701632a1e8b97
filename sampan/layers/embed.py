"""Feature embedding shared by the linear / FM family: one fused lookup gives both the
first-order weight and the latent vector of every sparse field."""

from __future__ import annotations

import torch
from torch import nn

from sampan.batch import Batch
from sampan.embedding.collection import EmbeddingCollection
from sampan.schema import DataSchema


class FeatureEmbedding(nn.Module):
    """``Batch -> (linear [B, T], fields [B, F' + Nd, D] or None)``; ``F'`` counts sparse
    columns, bags and mean-pooled behaviour sequences (see :func:`embed_fields`).

    The fused table has ``T + D`` columns: the first ``T`` are each id's first-order weight per
    task (initialised to zero), the rest its latent vector. Dense features get a linear
    weight, and with ``embed_dense`` a learned vector scaled by their value, so FM-style
    interactions see them as fields too. Without ``first_order`` the table holds only the
    vectors and ``linear`` is ``None``.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("c", 5)])
    >>> lin, v = FeatureEmbedding(s, dim=4)(Batch(dense=torch.ones(2, 1),
    ...                                              sparse=torch.ones(2, 1, dtype=torch.long)))
    >>> lin.shape, v.shape
    (torch.Size([2, 1]), torch.Size([2, 2, 4]))
    """

    def __init__(self, schema: DataSchema, dim: int, init_std: float = 1e-2,
                 embed_dense: bool = True, first_order: bool = True):
        super().__init__()
        if not (dim or first_order):
            raise ValueError("FeatureEmbedding needs dim > 0 or first_order")
        self.dim = dim
        self.schema = schema
        self.tasks = schema.num_tasks if first_order else 0
        # the first-order weights start at zero
        self.embedding = EmbeddingCollection(schema.tables(self.tasks + dim), init_std,
                                             zero_columns=self.tasks)
        nd = schema.num_dense
        self.dense_linear = nn.Linear(nd, self.tasks, bias=False) if nd and first_order \
            else None
        if self.dense_linear is not None:
            nn.init.zeros_(self.dense_linear.weight)
        self.dense_embed = nn.Parameter(torch.randn(nd, dim) * init_std) \
            if (embed_dense and nd and dim) else None
        self.bias = nn.Parameter(torch.zeros(self.tasks)) if first_order else None

    @property
    def num_vector_fields(self) -> int:
        """Fields with a latent vector: ``F'`` (see :func:`embed_fields`) plus the numeric
        fields when they are embedded."""
        if not self.dim:
            return 0
        nd = 0 if self.dense_embed is None else self.dense_embed.shape[0]
        return self.schema.num_fields() + nd

    def forward(self, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        linear, v, numeric = self.parts(batch)
        if v is not None and numeric is not None:
            v = torch.cat([v, numeric], dim=1)
        return linear, v

    def parts(self, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                           torch.Tensor | None]:
        """``(linear [B, T], field vectors [B, F', D], numeric vectors [B, Nd, D])``: what
        ``forward`` returns before the two kinds of vectors are concatenated (a model that
        treats them apart, e.g. DeepFM, whose MLP takes the numbers themselves, saves the
        copy); ``None`` for what this embedding does not have."""
        e, _ = embed_fields(self.embedding, batch, self.schema)  # [B, F', T + D]
        if not self.dim:
            w, v = e, None
        elif not self.tasks:
            w, v = None, e
        else:  # split, not two slices: its backward is one cat instead of two zero-fills
            w, v = e.split([self.tasks, self.dim], dim=-1)
        linear = None
        if w is not None:
            linear = w.sum(dim=1) + self.bias
            if self.dense_linear is not None:
                linear = linear + self.dense_linear(batch.dense)
        if v is None or self.dense_embed is None:
            return linear, v, None
        return linear, v, batch.dense.unsqueeze(-1) * self.dense_embed


def first_order_part(model: nn.Module) -> FeatureEmbedding | None:
    """``model.features`` when it is a :class:`FeatureEmbedding` with first-order weights
    (an LR's alone, or beside latent vectors): what an LR warm start applies to (see
    :mod:`sampan.train.warm_start`); else ``None``."""
    fe = getattr(model, "features", None)
    if isinstance(fe, FeatureEmbedding) and fe.tasks:
        return fe
    return None


def lr_start_part(model: nn.Module) -> FeatureEmbedding | FieldInput | None:
    """Where an LR warm start puts the LR's id weights (columns ``0 .. T-1`` of each row of
    the returned part's table): the model's first-order terms (:func:`first_order_part`), or
    for a model without them whose output layer can read an LR through its field vectors
    (``model.lr_input()``, then ``model.start_from_lr(...)``; DCN and DCN-V2), that input;
    ``None`` when the model cannot start from an LR."""
    fe = first_order_part(model)
    if fe is not None:
        return fe
    lr_input = getattr(model, "lr_input", None)
    return lr_input() if callable(lr_input) else None


def start_readout_from_lr(inp: FieldInput, out: nn.Linear, bias: torch.Tensor,
                          dense_weight: torch.Tensor | None) -> None:
    """Set ``out`` (reading ``[x_0, ...]``, ``x_0 = inp(batch)``) to compute an LR whose id
    weights are already in the first ``T`` columns of ``inp``'s vectors: output ``t`` reads
    column ``t`` of every field's vector and the numeric features with the LR's weights,
    plus its bias; every other input of ``out`` starts at weight 0. With the layers between
    ``x_0`` and ``out`` starting as the identity (a cross network with zero weights), the
    model starts as that LR exactly, and every other weight learns what it leaves out."""
    tasks, dim, fields = bias.numel(), inp.dim, inp.schema.num_fields()
    with torch.no_grad():
        out.weight.zero_()
        cols = torch.arange(fields) * dim
        for t in range(tasks):
            out.weight[t, cols + t] = 1.0
            if dense_weight is not None:
                out.weight[t, fields * dim: fields * dim + dense_weight.shape[1]] = \
                    dense_weight[t]
        out.bias.copy_(bias)


def pool(vectors: torch.Tensor, ids: torch.Tensor, mode: str) -> torch.Tensor:
    """Masked pooling of ``vectors [B, L, D]`` over real ids (``ids != 0``) -> ``[B, D]``."""
    mask = (ids != 0).unsqueeze(-1).to(vectors.dtype)
    total = (vectors * mask).sum(dim=1)
    if mode == "sum":
        return total
    return total / mask.sum(dim=1).clamp_min(1.0)


def embed_fields(embedding: EmbeddingCollection, batch: Batch, schema: DataSchema,
                 attend: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One lookup for everything a model embeds.

    Returns ``fields [B, F', D]``: the sparse columns, then each bag pooled, then each
    behaviour sequence not in ``attend`` mean-pooled; and ``{name: [B, L, D]}`` for the
    sequences in ``attend`` (left to the model's attention).
    """
    lists = {s.name: batch.sequences[s.name] for s in schema.sequences} if schema.sequences \
        else None
    fields, looked = embedding.lookup(batch.sparse, lists)
    pooled = [pool(looked[s.name], batch.sequences[s.name], s.pooling or "mean")
              for s in schema.sequences if s.name not in attend]
    if pooled:
        fields = torch.cat([fields, torch.stack(pooled, dim=1)], dim=1)
    return fields, {name: looked[name] for name in attend}


class FieldInput(nn.Module):
    """The flat input of MLP-style models: ``Batch -> x_0 [B, F' * D + Nd]`` (every field's
    vector, bags and pooled sequences included, then the numeric features).

    >>> from sampan.schema import SparseFeatureSpec
    >>> layer = FieldInput(DataSchema(dense=["x"], sparse=[SparseFeatureSpec("c", 5)]), dim=4)
    >>> layer.out_dim, layer(Batch(dense=torch.ones(2, 1),
    ...                            sparse=torch.ones(2, 1, dtype=torch.long))).shape
    (5, torch.Size([2, 5]))
    """

    def __init__(self, schema: DataSchema, dim: int, init_std: float = 1e-2):
        super().__init__()
        self.schema = schema
        self.dim = dim
        # numeric features alone (PaddleRec's Census models) embed nothing
        tables = schema.tables(dim)
        self.embedding = EmbeddingCollection(tables, init_std) if tables else None
        self.out_dim = schema.num_fields() * dim + schema.num_dense

    def forward(self, batch: Batch) -> torch.Tensor:
        if self.embedding is None:
            return batch.dense
        fields, _ = embed_fields(self.embedding, batch, self.schema)
        return torch.cat([fields.flatten(1), batch.dense], dim=1)
