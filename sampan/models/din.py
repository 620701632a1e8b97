"""DIN (Zhou et al., 2018): the user's behaviour history pooled by attention to the target."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.embedding import EmbeddingCollection
from sampan.layers import MLP, TargetAttention, embed_fields
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("din")
class DIN(nn.Module):
    """``Batch -> [B, T]``: MLP over ``[e_1 .. e_F, interest, interest * e_target, dense]``
    where ``interest`` is the history pooled by attention to the target.

    ``target`` is the sparse feature of the candidate item and ``history`` the sequence of
    that item's table (both default to the schema's only sequence and its table).
    """

    class Config(ModelConfig):
        name: Literal["din"] = Field("din", description="the model's registered name")
        target: str | None = Field(None, description="the sparse feature of the candidate item; "
                                   "None: the feature whose ids the history holds")
        history: str | None = Field(None, description="the behaviour sequence (a `kind: sequence` "
                                    "list) pooled by attention; None: the data's only one")
        attention_mlp: list[int] = Field(default_factory=lambda: [80, 40],
                                         description="hidden layer sizes of the attention MLP "
                                         "that scores each history event against the target")
        mlp: list[int] = Field(default_factory=lambda: [200, 80],
                               description="the output MLP's hidden layer sizes, first to last")
        activation: Literal["dice", "prelu", "relu", "sigmoid"] = Field(
            "dice", description="activation of the output MLP's hidden layers (sigmoid: "
            "PaddleRec's DIN)")
        attention_activation: Literal["dice", "prelu", "relu", "sigmoid"] = Field(
            "dice", description="activation of the attention MLP's hidden layers")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability after "
                               "each hidden layer of the output MLP; 0: none")
        batch_norm: bool = Field(False, description="batch normalisation after each hidden "
                                 "layer's linear map in the output MLP, before its activation")
        attention_normalization: Literal["softmax", "none"] = Field(
            "softmax", description="softmax: attention weights sum to 1 over the history "
            "(better on the real datasets here); none: the paper's raw weights")
        input_norm: bool = Field(True, description="batch-normalise the MLP input (as the "
                                 "authors' code does): the pooled interest and the small "
                                 "initial embeddings then learn at a useful scale")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.history, self.target_idx = schema.history_and_target("din", cfg.history,
                                                                  cfg.target)
        self.schema = schema
        self.embedding = EmbeddingCollection(schema.tables(cfg.embedding_dim),
                                             cfg.embedding_init_std)
        self.attention = TargetAttention(cfg.embedding_dim, cfg.attention_mlp,
                                         cfg.attention_activation,
                                         cfg.attention_normalization)
        # other sequences and bags are pooled into fields; the history is attended
        d = (schema.num_fields() + 1) * cfg.embedding_dim + schema.num_dense
        self.input_norm = nn.BatchNorm1d(d) if cfg.input_norm else nn.Identity()
        self.mlp = MLP(d, cfg.mlp, out=schema.num_tasks, dropout=cfg.dropout,
                       batch_norm=cfg.batch_norm, act=cfg.activation)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return self.mlp.output_bias()

    def forward(self, batch: Batch) -> torch.Tensor:
        e, hist = embed_fields(self.embedding, batch, self.schema, attend=(self.history,))
        keys, mask = hist[self.history], batch.sequences[self.history] != 0
        # softmax: weights sum to 1 over the real events; none: the paper's raw weights (the
        # pooled vector keeps the intensity of interest)
        target = e[:, self.target_idx]
        interest = self.attention.pool(self.attention(target, keys, mask), keys)
        # the interest-target product joins the MLP input, as in the authors' code
        return self.mlp(self.input_norm(torch.cat([e.flatten(1), interest, interest * target,
                                                   batch.dense], dim=1)))
