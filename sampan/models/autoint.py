"""AutoInt (Song et al., 2019): multi-head self-attention across fields learns feature
interactions; with an MLP beside it (``mlp`` not empty) it is AutoInt+."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.layers import MLP, FeatureEmbedding, Linear, bias_terms
from sampan.models.registry import register_model
from sampan.schema import DataSchema


class InteractingLayer(nn.Module):
    """Self-attention over fields with a residual projection: ``[B, F, d] -> [B, F, H*a]``."""

    def __init__(self, dim: int, heads: int, att_dim: int):
        super().__init__()
        self.heads, self.att_dim = heads, att_dim
        self.qkv = Linear(dim, 3 * heads * att_dim, bias=False)
        self.res = Linear(dim, heads * att_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, f, _ = x.shape
        q, k, v = self.qkv(x).view(b, f, 3, self.heads, self.att_dim).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # [B, H, F, a]
        out = out.transpose(1, 2).reshape(b, f, self.heads * self.att_dim)
        return torch.relu(out + self.res(x))


@register_model("autoint")
class AutoInt(nn.Module):
    """``Batch -> [B, T]``: attention layers over the fields (numeric features embedded as
    fields), flattened into a linear output, plus an optional MLP (AutoInt+) and, with
    ``linear`` (the default), a first-order term over the raw features.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 3)])
    >>> AutoInt(s, AutoInt.Config(embedding_dim=4, mlp=[8]))(Batch(dense=torch.ones(2, 1),
    ...     sparse=torch.ones(2, 2, dtype=torch.long))).shape
    torch.Size([2, 1])
    """

    class Config(ModelConfig):
        name: Literal["autoint"] = Field("autoint", description="the model's registered name")
        attention_layers: int = Field(3, ge=1, description="number of stacked self-attention "
                                      "(interacting) layers over the fields")
        heads: int = Field(2, ge=1, description="attention heads per interacting layer")
        attention_dim: int = Field(16, ge=1, description="length of each head's query, key and "
                                   "value vectors; a layer outputs heads x attention_dim per "
                                   "field")
        mlp: list[int] = Field(default_factory=lambda: [256, 128],
                               description="[] for plain AutoInt; layers for AutoInt+")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability after "
                               "each hidden layer of the MLP (AutoInt+); 0: none")
        linear: bool = Field(True, description="add a first-order (logistic-regression) term "
                             "over the same features, as DeepFM and xDeepFM have")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.schema = schema
        d = cfg.embedding_dim
        self.features = FeatureEmbedding(schema, d, cfg.embedding_init_std, embed_dense=True,
                                         first_order=cfg.linear)
        f = schema.num_fields() + schema.num_dense
        layers, width = [], d
        for _ in range(cfg.attention_layers):
            layers.append(InteractingLayer(width, cfg.heads, cfg.attention_dim))
            width = cfg.heads * cfg.attention_dim
        self.attention = nn.Sequential(*layers)
        self.out = Linear(f * width, schema.num_tasks)
        self.mlp = MLP(f * d, cfg.mlp, out=schema.num_tasks, dropout=cfg.dropout) \
            if cfg.mlp else None

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.out.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        linear, x = self.features(batch)
        logit = self.out(self.attention(x).flatten(1))
        if linear is not None:
            logit = logit + linear
        return logit + self.mlp(x.flatten(1)) if self.mlp is not None else logit
