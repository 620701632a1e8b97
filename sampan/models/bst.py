"""BST (Chen et al., 2019, Alibaba): a transformer over the behaviour sequence with the
target item appended, so every event attends to the candidate and to each other."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.embedding import EmbeddingCollection
from sampan.errors import ConfigError
from sampan.layers import MLP, embed_fields
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("bst")
class BST(nn.Module):
    """``Batch -> [B, T]``: MLP over ``[e_1 .. e_F', mean(h), h_target, mean(h) * e_target,
    dense]`` where ``h`` is the transformer output over ``[history, target]``.

    ``mean(h)`` pools the real (non-padding) positions; ``h_target`` is the output at the
    target's position, which has attended to every event. ``target`` and
    ``history`` default as in DIN (the only behaviour sequence and the feature it shares).
    """

    class Config(ModelConfig):
        name: Literal["bst"] = Field("bst", description="the model's registered name")
        target: str | None = Field(None, description="the sparse feature of the candidate item; "
                                   "None: the feature whose ids the history holds")
        history: str | None = Field(None, description="the behaviour sequence (a `kind: sequence` "
                                    "list) the transformer reads; None: the data's only one")
        layers: int = Field(1, ge=1, description="transformer encoder layers over the history "
                            "with the target appended")
        heads: int = Field(2, ge=1, description="attention heads per transformer layer; must "
                           "divide embedding_dim")
        mlp: list[int] = Field(default_factory=lambda: [256, 128],
                               description="the output MLP's hidden layer sizes, first to last")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability in the "
                               "transformer layers and after each MLP hidden layer; 0: none")
        input_norm: bool = Field(True, description="batch-normalise the MLP input (as DIN)")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.history, self.target_idx = schema.history_and_target("bst", cfg.history,
                                                                  cfg.target)
        if cfg.embedding_dim % cfg.heads:
            raise ConfigError(f"bst: embedding_dim {cfg.embedding_dim} must be divisible by "
                             f"heads {cfg.heads}")
        self.schema = schema
        d = cfg.embedding_dim
        self.embedding = EmbeddingCollection(schema.tables(d), cfg.embedding_init_std)
        max_len = next(s.max_len for s in schema.behaviour if s.name == self.history)
        self.position = nn.Parameter(torch.randn(max_len + 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, cfg.heads, dim_feedforward=4 * d,
                                           dropout=cfg.dropout, batch_first=True,
                                           norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        in_dim = (schema.num_fields() + 2) * d + schema.num_dense
        self.input_norm = nn.BatchNorm1d(in_dim) if cfg.input_norm else nn.Identity()
        self.mlp = MLP(in_dim, cfg.mlp, out=schema.num_tasks, dropout=cfg.dropout)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return self.mlp.output_bias()

    def forward(self, batch: Batch) -> torch.Tensor:
        e, hist = embed_fields(self.embedding, batch, self.schema, attend=(self.history,))
        seq = torch.cat([hist[self.history], e[:, self.target_idx].unsqueeze(1)], dim=1)
        real = torch.cat([batch.mask(self.history),
                          torch.ones_like(batch.mask(self.history)[:, :1])], dim=1)
        h = self.transformer(seq + self.position, src_key_padding_mask=~real)
        w = real.unsqueeze(-1).to(h.dtype)
        pooled = (h * w).sum(dim=1) / w.sum(dim=1)
        # the target's own output has attended to every event: it carries the match; the
        # pooled history times the target makes their agreement explicit (as in DIN / DIEN)
        target = e[:, self.target_idx]
        return self.mlp(self.input_norm(torch.cat([e.flatten(1), pooled, h[:, -1],
                                                   pooled * target, batch.dense], dim=1)))
