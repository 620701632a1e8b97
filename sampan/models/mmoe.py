"""MMoE (Ma et al., 2018): experts shared by all tasks, mixed per task by its own gate."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import ModelConfig
from sampan.layers import MLP, FieldInput, Linear
from sampan.models.registry import register_model
from sampan.schema import DataSchema


@register_model("mmoe")
class MMoE(nn.Module):
    """``Batch -> [B, T]``: ``tower_t(sum_e softmax(gate_t(x))_e * expert_e(x))`` for each task
    ``t`` (one label column each), ``x = [e_1 .. e_F', dense]``.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5)], labels=["click", "buy"])
    >>> MMoE(s, MMoE.Config(embedding_dim=4, expert_mlp=[8], tower_mlp=[4]))(Batch(
    ...     dense=torch.ones(3, 1), sparse=torch.ones(3, 1, dtype=torch.long))).shape
    torch.Size([3, 2])
    """

    numeric_only = True  # takes numeric features alone (no categorical one)

    class Config(ModelConfig):
        name: Literal["mmoe"] = Field("mmoe", description="the model's registered name")
        experts: int = Field(4, ge=1, description="number of expert MLPs shared by all tasks")
        expert_mlp: list[int] = Field(default_factory=lambda: [256, 128], min_length=1,
                                      description="hidden layer sizes of each expert, first to "
                                      "last; the last is the width the gates mix")
        tower_mlp: list[int] = Field(default_factory=lambda: [64],
                                     description="hidden layer sizes of each task's tower over "
                                     "its mixture of experts")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability after "
                               "each hidden layer of the experts and towers; 0: none")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.input = FieldInput(schema, cfg.embedding_dim, cfg.embedding_init_std)
        d = self.input.out_dim
        self.experts = nn.ModuleList(MLP(d, cfg.expert_mlp, dropout=cfg.dropout)
                                     for _ in range(cfg.experts))
        self.gates = nn.ModuleList(Linear(d, cfg.experts) for _ in range(schema.num_tasks))
        self.towers = nn.ModuleList(MLP(cfg.expert_mlp[-1], cfg.tower_mlp, out=1,
                                        dropout=cfg.dropout) for _ in range(schema.num_tasks))

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return [(p, 0) for tower in self.towers for p, _ in tower.output_bias()]

    def forward(self, batch: Batch) -> torch.Tensor:
        x = self.input(batch)
        experts = torch.stack([e(x) for e in self.experts], dim=1)  # [B, E, H]
        out = []
        for gate, tower in zip(self.gates, self.towers, strict=True):
            w = torch.softmax(gate(x), dim=1).unsqueeze(1)  # [B, 1, E]
            out.append(tower(torch.bmm(w, experts).squeeze(1)))
        return torch.cat(out, dim=1)
