"""Factorisation machine (Rendle, 2010): linear terms plus factorised pairwise interactions."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import FieldWeightsConfig, ModelConfig
from sampan.errors import ConfigError
from sampan.layers import FeatureEmbedding, FieldWeightedFM, bias_terms, pair_interaction
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("fm")
class FM(nn.Module):
    """``logit = linear + sum_{i<j} r_ij <v_i, v_j>`` over sparse fields (and numeric fields
    scaled by their value when ``embed_dense``); ``Batch -> [B, 1]``. ``r_ij`` are learned
    field-pair weights (FwFM, see :class:`~sampan.layers.fm.FieldWeightedFM`), or all 1
    (Rendle's FM) with ``field_weights: false``."""

    class Config(ModelConfig, FieldWeightsConfig):
        name: Literal["fm"] = Field("fm", description="the model's registered name")
        embed_dense: bool = Field(True, description="numeric features also enter the FM term "
                                  "as fields, each a learned vector scaled by its value")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        if schema.num_tasks != 1:
            raise ConfigError(f"fm predicts one label; got {schema.num_tasks}: {schema.labels}")
        self.features = FeatureEmbedding(schema, cfg.embedding_dim, cfg.embedding_init_std,
                                         embed_dense=cfg.embed_dense)
        self.pairs = FieldWeightedFM(self.features.num_vector_fields,
                                     cfg.field_weights_l1) if cfg.field_weights else None

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.features.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        linear, v, numeric = self.features.parts(batch)
        return linear + pair_interaction(self.pairs, *((v,) if numeric is None else (v, numeric)))
