"""DeepFM (Guo et al., 2017): an FM and an MLP sharing the same field embeddings."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import FieldWeightsConfig, MLPModelConfig
from sampan.errors import ConfigError
from sampan.layers import MLP, FeatureEmbedding, FieldWeightedFM, bias_terms, pair_interaction
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("deepfm")
class DeepFM(nn.Module):
    """``logit = linear + FM(v) + MLP([v_1 .. v_F, dense])``; ``Batch -> [B, 1]``.

    Shapes: ``v [B, F + Nd, D]`` (numeric fields embedded when ``embed_dense``), MLP input
    ``F * D + Nd``.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 3)])
    >>> m = DeepFM(s, DeepFM.Config(embedding_dim=4, mlp=[8]))
    >>> m(Batch(dense=torch.ones(2, 1), sparse=torch.ones(2, 2, dtype=torch.long))).shape
    torch.Size([2, 1])
    """

    class Config(MLPModelConfig, FieldWeightsConfig):
        name: Literal["deepfm"] = Field("deepfm", description="the model's registered name")
        embed_dense: bool = Field(True, description="numeric features also enter the FM term "
                                  "as fields, each a learned vector scaled by its value (the "
                                  "MLP reads the numbers either way)")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        if schema.num_tasks != 1:
            raise ConfigError(f"deepfm predicts one label; got {schema.num_tasks}: {schema.labels}")
        self.features = FeatureEmbedding(schema, cfg.embedding_dim, cfg.embedding_init_std,
                                         embed_dense=cfg.embed_dense)
        self.pairs = FieldWeightedFM(self.features.num_vector_fields,
                                     cfg.field_weights_l1) if cfg.field_weights else None
        in_dim = schema.num_fields() * cfg.embedding_dim + schema.num_dense
        self.mlp = MLP(in_dim, cfg.mlp, out=1, dropout=cfg.dropout, batch_norm=cfg.batch_norm,
                       zero_output=True)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.features.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        linear, v, numeric = self.features.parts(batch)
        deep_in = torch.cat([v.flatten(1), batch.dense], dim=1)
        fm = pair_interaction(self.pairs, *((v,) if numeric is None else (v, numeric)))
        return linear + fm + self.mlp(deep_in)
