"""FiBiNET (Huang et al., 2019): field importance by squeeze-excitation and bilinear field
interactions, on both the raw and the re-weighted embeddings."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import MLPModelConfig
from sampan.layers import MLP, FeatureEmbedding, Linear, bias_terms
from sampan.models.registry import register_model
from sampan.schema import DataSchema


class SENet(nn.Module):
    """Squeeze (mean over D) -> excitation (F -> F/r -> F, ReLU) -> re-weight the fields."""

    def __init__(self, fields: int, reduction: int):
        super().__init__()
        hidden = max(1, fields // reduction)
        self.excite = nn.Sequential(Linear(fields, hidden), nn.ReLU(), Linear(hidden, fields),
                                    nn.ReLU())

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return v * self.excite(v.mean(dim=2)).unsqueeze(-1)


class Bilinear(nn.Module):
    """``p_ij = (v_i W) * v_j`` for every field pair ``i < j`` (one shared ``W``, the paper's
    field-all type): ``[B, F, D] -> [B, F(F-1)/2, D]``."""

    def __init__(self, fields: int, dim: int):
        super().__init__()
        self.w = Linear(dim, dim, bias=False)
        i, j = torch.triu_indices(fields, fields, offset=1)
        self.register_buffer("i", i, persistent=False)
        self.register_buffer("j", j, persistent=False)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.w(v)[:, self.i] * v[:, self.j]


@register_model("fibinet")
class FiBiNET(nn.Module):
    """``logit = linear + MLP([Bilinear(v), Bilinear(SENet(v)), dense])``; ``Batch -> [B, T]``.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 3)])
    >>> FiBiNET(s, FiBiNET.Config(embedding_dim=4, mlp=[8]))(Batch(dense=torch.ones(2, 1),
    ...     sparse=torch.ones(2, 2, dtype=torch.long))).shape
    torch.Size([2, 1])
    """

    class Config(MLPModelConfig):
        name: Literal["fibinet"] = Field("fibinet", description="the model's registered name")
        reduction: int = Field(3, ge=1, description="reduction ratio of the squeeze-excitation "
                               "network: its hidden layer has fields / reduction units (at "
                               "least 1)")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.features = FeatureEmbedding(schema, cfg.embedding_dim, cfg.embedding_init_std,
                                         embed_dense=False)
        f = schema.num_fields()
        self.senet = SENet(f, cfg.reduction)
        self.bilinear = Bilinear(f, cfg.embedding_dim)
        self.bilinear_se = Bilinear(f, cfg.embedding_dim)
        pairs = f * (f - 1) // 2
        self.mlp = MLP(2 * pairs * cfg.embedding_dim + schema.num_dense, cfg.mlp,
                       out=schema.num_tasks, dropout=cfg.dropout, batch_norm=cfg.batch_norm)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.features.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        linear, v = self.features(batch)
        p = self.bilinear(v).flatten(1)
        q = self.bilinear_se(self.senet(v)).flatten(1)
        return linear + self.mlp(torch.cat([p, q, batch.dense], dim=1))
