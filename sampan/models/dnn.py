"""DNN: an MLP over every field's embedding and the numeric features (the "embedding + MLP"
baseline of the CTR literature; PaddleRec's ``rank/dnn``)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import MLPModelConfig
from sampan.layers import MLP, FieldInput
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("dnn")
class DNN(nn.Module):
    """``Batch -> [B, T]``: ``MLP([e_1 .. e_F', dense])``, one output per task.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 3)])
    >>> DNN(s, DNN.Config(embedding_dim=4, mlp=[8]))(Batch(dense=torch.ones(2, 1),
    ...     sparse=torch.ones(2, 2, dtype=torch.long))).shape
    torch.Size([2, 1])
    """

    numeric_only = True  # takes numeric features alone (no categorical one)

    class Config(MLPModelConfig):
        name: Literal["dnn"] = Field("dnn", description="the model's registered name")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.input = FieldInput(schema, cfg.embedding_dim, cfg.embedding_init_std)
        self.mlp = MLP(self.input.out_dim, cfg.mlp, out=schema.num_tasks, dropout=cfg.dropout,
                       batch_norm=cfg.batch_norm)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return self.mlp.output_bias()

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.mlp(self.input(batch))
