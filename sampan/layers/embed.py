"""Feature embedding shared by the linear / FM family: one fused lookup gives both the
first-order weight and the latent vector of every sparse field."""

from __future__ import annotations

import torch
from torch import nn

from sampan.data.loader import Batch
from sampan.embedding.collection import EmbeddingCollection
from sampan.schema import DataSchema


class FeatureEmbedding(nn.Module):
    """``Batch -> (linear [B, T], fields [B, F + Nd, D] or None)``.

    The fused table has ``T + D`` columns: the first ``T`` are each id's first-order weight per
    task (initialised to zero), the rest its latent vector. Dense features get a linear
    weight, and with ``embed_dense`` a learned vector scaled by their value, so FM-style
    interactions see them as fields too.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("c", 5)])
    >>> lin, v = FeatureEmbedding(s, dim=4)(Batch(dense=torch.ones(2, 1),
    ...                                              sparse=torch.ones(2, 1, dtype=torch.long)))
    >>> lin.shape, v.shape
    (torch.Size([2, 1]), torch.Size([2, 2, 4]))
    """

    def __init__(self, schema: DataSchema, dim: int, init_std: float = 1e-2,
                 embed_dense: bool = True):
        super().__init__()
        self.dim = dim
        self.tasks = schema.num_tasks
        self.embedding = EmbeddingCollection(schema.tables(self.tasks + dim), init_std)
        with torch.no_grad():
            self.embedding.weight[:, : self.tasks].zero_()
        nd = schema.num_dense
        self.dense_linear = nn.Linear(nd, self.tasks, bias=False) if nd else None
        if self.dense_linear is not None:
            nn.init.zeros_(self.dense_linear.weight)
        self.dense_embed = nn.Parameter(torch.randn(nd, dim) * init_std) \
            if (embed_dense and nd and dim) else None
        self.bias = nn.Parameter(torch.zeros(self.tasks))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        e = self.embedding(batch.sparse)  # [B, F, T + D]
        if not self.dim:
            w = e
        else:  # split, not two slices: its backward is one cat instead of two zero-fills
            w, v = e.split([self.tasks, self.dim], dim=-1)
        linear = w.sum(dim=1) + self.bias
        if self.dense_linear is not None:
            linear = linear + self.dense_linear(batch.dense)
        if not self.dim:
            return linear, None
        if self.dense_embed is not None:
            v = torch.cat([v, batch.dense.unsqueeze(-1) * self.dense_embed], dim=1)
        return linear, v
