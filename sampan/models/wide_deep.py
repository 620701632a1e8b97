"""Wide & Deep (Cheng et al., 2016): a linear model and an MLP trained jointly."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import MLPModelConfig
from sampan.layers import MLP, FeatureEmbedding, bias_terms
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("wide_deep")
class WideDeep(nn.Module):
    """``logit = wide (first-order weights) + MLP([e_1 .. e_F', dense])``; ``Batch -> [B, T]``.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 3)])
    >>> m = WideDeep(s, WideDeep.Config(embedding_dim=4, mlp=[8]))
    >>> m(Batch(dense=torch.ones(2, 1), sparse=torch.ones(2, 2, dtype=torch.long))).shape
    torch.Size([2, 1])
    """

    class Config(MLPModelConfig):
        name: Literal["wide_deep"] = Field("wide_deep", description="the model's registered "
                                           "name")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.features = FeatureEmbedding(schema, cfg.embedding_dim, cfg.embedding_init_std,
                                         embed_dense=False)
        self.num_fields = schema.num_fields()
        self.mlp = MLP(self.num_fields * cfg.embedding_dim + schema.num_dense, cfg.mlp,
                       out=schema.num_tasks, dropout=cfg.dropout, batch_norm=cfg.batch_norm,
                       zero_output=True)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.features.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        wide, v = self.features(batch)
        return wide + self.mlp(torch.cat([v.flatten(1), batch.dense], dim=1))
