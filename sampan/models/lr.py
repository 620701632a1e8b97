"""Logistic regression: a bias, one weight per categorical id, one per numeric feature."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.layers import FeatureEmbedding, bias_terms
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("lr")
class LR(nn.Module):
    """``logit = b + sum_f w[id_f] + w_d . dense``; ``Batch -> [B, T]``.

    >>> from sampan.schema import SparseFeatureSpec
    >>> m = LR(DataSchema(dense=["x"], sparse=[SparseFeatureSpec("c", 4)]), LR.Config())
    >>> m(Batch(dense=torch.zeros(3, 1), sparse=torch.zeros(3, 1, dtype=torch.long))).shape
    torch.Size([3, 1])
    """

    class Config(ModelConfig):
        name: Literal["lr"] = Field("lr", description="the model's registered name")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.features = FeatureEmbedding(schema, dim=0, init_std=cfg.embedding_init_std)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.features.bias)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.features(batch)[0]
