"""Factorisation machine (Rendle, 2010): linear terms plus factorised pairwise interactions."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.errors import ConfigError
from sampan.layers import FeatureEmbedding, bias_terms, fm_interaction
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("fm")
class FM(nn.Module):
    """``logit = linear + sum_{i<j} <v_i, v_j>`` over sparse fields (and numeric fields
    scaled by their value when ``embed_dense``); ``Batch -> [B, 1]``."""

    class Config(ModelConfig):
        name: Literal["fm"] = "fm"
        embed_dense: bool = True

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        if schema.num_tasks != 1:
            raise ConfigError(f"fm predicts one label; got {schema.num_tasks}: {schema.labels}")
        self.features = FeatureEmbedding(schema, cfg.embedding_dim, cfg.embedding_init_std,
                                         embed_dense=cfg.embed_dense)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.features.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        linear, v, numeric = self.features.parts(batch)
        return linear + (fm_interaction(v) if numeric is None else fm_interaction(v, numeric))
