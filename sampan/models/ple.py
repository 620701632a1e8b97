"""PLE (Tang et al., 2020): progressive layered extraction with task-specific and shared
experts (customised gate control at each level)."""

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


class CGC(nn.Module):
    """One extraction level: each task mixes its own experts and the shared ones; the shared
    output mixes all experts (except at the last level, which has no shared output)."""

    def __init__(self, dim: int, tasks: int, task_experts: int, shared_experts: int,
                 hidden: list[int], dropout: float, last: bool):
        super().__init__()
        self.tasks, self.k, self.last = tasks, task_experts, last

        def expert() -> MLP:
            return MLP(dim, hidden, dropout=dropout)

        self.task_experts = nn.ModuleList(nn.ModuleList(expert() for _ in range(task_experts))
                                          for _ in range(tasks))
        self.shared = nn.ModuleList(expert() for _ in range(shared_experts))
        self.task_gates = nn.ModuleList(Linear(dim, task_experts + shared_experts)
                                        for _ in range(tasks))
        self.shared_gate = None if last else Linear(dim, tasks * task_experts + shared_experts)
        self.out_dim = hidden[-1]

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``xs``: one input per task plus the shared input, each ``[B, d]``."""
        shared = [e(xs[-1]) for e in self.shared]
        own = [[e(xs[t]) for e in self.task_experts[t]] for t in range(self.tasks)]
        out = []
        for t in range(self.tasks):
            ex = torch.stack(own[t] + shared, dim=1)  # [B, k + s, H]
            w = torch.softmax(self.task_gates[t](xs[t]), dim=1).unsqueeze(1)
            out.append(torch.bmm(w, ex).squeeze(1))
        if self.shared_gate is not None:
            ex = torch.stack([h for hs in own for h in hs] + shared, dim=1)
            w = torch.softmax(self.shared_gate(xs[-1]), dim=1).unsqueeze(1)
            out.append(torch.bmm(w, ex).squeeze(1))
        return out


@register_model("ple")
class PLE(nn.Module):
    """``Batch -> [B, T]``: ``levels`` CGC layers, then one tower per task.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5)], labels=["click", "buy"])
    >>> PLE(s, PLE.Config(embedding_dim=4, expert_mlp=[8], tower_mlp=[4]))(Batch(
    ...     dense=torch.ones(3, 1), sparse=torch.ones(3, 1, dtype=torch.long))).shape
    torch.Size([3, 2])
    """

    numeric_only = True  # takes numeric features alone (no categorical one)

    class Config(ModelConfig):
        name: Literal["ple"] = Field("ple", description="the model's registered name")
        levels: int = Field(2, ge=1, description="number of stacked extraction (CGC) levels")
        task_experts: int = Field(1, ge=1, description="experts of each task at each level")
        shared_experts: int = Field(1, ge=1, description="experts shared by all tasks at each "
                                    "level")
        expert_mlp: list[int] = Field(default_factory=lambda: [256, 128], min_length=1,
                                      description="hidden layer sizes of each expert, first to "
                                      "last; the last is the width the gates mix")
        tower_mlp: list[int] = Field(default_factory=lambda: [64],
                                     description="hidden layer sizes of each task's tower over "
                                     "its last-level mixture")
        dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability after "
                               "each hidden layer of the experts and towers; 0: none")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.tasks = schema.num_tasks
        self.input = FieldInput(schema, cfg.embedding_dim, cfg.embedding_init_std)
        d = self.input.out_dim
        self.levels = nn.ModuleList()
        for level in range(cfg.levels):
            self.levels.append(CGC(d, self.tasks, cfg.task_experts, cfg.shared_experts,
                                   cfg.expert_mlp, cfg.dropout, last=level == cfg.levels - 1))
            d = cfg.expert_mlp[-1]
        self.towers = nn.ModuleList(MLP(d, cfg.tower_mlp, out=1, dropout=cfg.dropout)
                                    for _ in range(self.tasks))

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return [(p, 0) for tower in self.towers for p, _ in tower.output_bias()]

    def forward(self, batch: Batch) -> torch.Tensor:
        x = self.input(batch)
        xs = [x] * (self.tasks + 1)
        for level in self.levels:
            xs = level(xs)
        return torch.cat([tower(h) for tower, h in zip(self.towers, xs, strict=False)], dim=1)
