"""xDeepFM (Lian et al., 2018): a Compressed Interaction Network for explicit vector-wise
high-order crosses, plus a linear part and an MLP."""

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


class CIN(nn.Module):
    """``X^k_h = sum_{i,j} W^k_{h,i,j} (X^{k-1}_i * X^0_j)`` over fields, sum-pooled over D.

    ``[B, m, D] -> [B, sum(layers)]``.
    """

    def __init__(self, fields: int, layers: list[int]):
        super().__init__()
        self.convs = nn.ModuleList()
        h = fields
        for size in layers:
            self.convs.append(Linear(h * fields, size))
            h = size
        self.out_dim = sum(layers)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        b, m, d = x0.shape
        x, pooled = x0, []
        for conv in self.convs:
            z = torch.einsum("bhd,bmd->bdhm", x, x0).reshape(b, d, -1)  # [B, D, H*m]
            x = torch.relu(conv(z)).transpose(1, 2)  # [B, H_k, D]
            pooled.append(x.sum(dim=2))
        return torch.cat(pooled, dim=1)


@register_model("xdeepfm")
class XDeepFM(nn.Module):
    """``logit = linear + out(CIN(v)) + MLP([v, dense])``; ``Batch -> [B, T]``.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 3)])
    >>> XDeepFM(s, XDeepFM.Config(embedding_dim=4, mlp=[8], cin=[4]))(Batch(
    ...     dense=torch.ones(2, 1), sparse=torch.ones(2, 2, dtype=torch.long))).shape
    torch.Size([2, 1])
    """

    class Config(MLPModelConfig):
        name: Literal["xdeepfm"] = Field("xdeepfm", description="the model's registered name")
        cin: list[int] = Field(default_factory=lambda: [64, 64],
                               description="feature maps of each CIN layer, first to last; each "
                               "layer's sum-pooled maps feed the output")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.features = FeatureEmbedding(schema, cfg.embedding_dim, cfg.embedding_init_std,
                                         embed_dense=False)
        f = schema.num_fields()
        self.cin = CIN(f, cfg.cin)
        self.cin_out = Linear(self.cin.out_dim, schema.num_tasks)
        self.mlp = MLP(f * cfg.embedding_dim + schema.num_dense, cfg.mlp, out=schema.num_tasks,
                       dropout=cfg.dropout, batch_norm=cfg.batch_norm)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.features.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        linear, v = self.features(batch)
        deep = self.mlp(torch.cat([v.flatten(1), batch.dense], dim=1))
        return linear + self.cin_out(self.cin(v)) + deep
