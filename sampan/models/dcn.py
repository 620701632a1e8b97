"""DCN (Wang et al., 2017): a cross network of rank-one crosses beside an MLP."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from sampan.batch import Batch
from sampan.config import MLPModelConfig
from sampan.layers import MLP, FieldInput, Linear, bias_terms
from sampan.layers.embed import start_readout_from_lr
from sampan.models.registry import register_model
from sampan.schema import DataSchema


class CrossNet(nn.Module):
    """``x_{l+1} = x_0 (x_l . w_l) + b_l + x_l``; ``[B, d] -> [B, d]``."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(dim) * dim**-0.5)
                                  for _ in range(layers))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(dim)) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        return self.forward_with_penalty(x0, penalty=False)[0]

    def forward_with_penalty(self, x0: torch.Tensor, penalty: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output and ``sum_l sum_batch ||x_l * w_l||^2`` (the penalty PaddleRec's DCN
        weighs by ``l2_reg_cross``; ``None`` unless ``penalty``)."""
        x, total = x0, None
        for w, b in zip(self.w, self.b, strict=True):
            if penalty:
                term = (x * w).square().sum()
                total = term if total is None else total + term
            x = x0 * (x @ w).unsqueeze(1) + b + x
        return x, total

    def start_as_identity(self) -> None:
        """Zero every ``w_l`` and ``b_l``: ``CrossNet(x_0) = x_0`` until the crosses learn
        (``w_l`` still gets a gradient, ``x_l`` times ``x_0``'s)."""
        with torch.no_grad():
            for w, b in zip(self.w, self.b, strict=True):
                w.zero_()
                b.zero_()


@register_model("dcn")
class DCN(nn.Module):
    """``Batch -> [B, T]``: ``out([CrossNet(x_0), MLP(x_0)])`` with ``x_0 = [e_1 .. e_F', dense]``.

    >>> from sampan.schema import SparseFeatureSpec
    >>> s = DataSchema(dense=["x"], sparse=[SparseFeatureSpec("a", 5), SparseFeatureSpec("b", 3)])
    >>> DCN(s, DCN.Config(embedding_dim=4, mlp=[8]))(Batch(dense=torch.ones(2, 1),
    ...     sparse=torch.ones(2, 2, dtype=torch.long))).shape
    torch.Size([2, 1])
    """

    numeric_only = True  # takes numeric features alone (no categorical one)

    class Config(MLPModelConfig):
        name: Literal["dcn"] = Field("dcn", description="the model's registered name")
        cross_layers: int = Field(3, ge=1, description="number of cross layers in the cross "
                                  "network beside the MLP")
        cross_l2: float = Field(0.0, ge=0.0, description="adds cross_l2 times the sum over "
                                "cross layers and rows of ||x_l * w_l||^2 to the training "
                                "loss (PaddleRec's l2_reg_cross); 0: none")

    def __init__(self, schema: DataSchema, cfg: Config):
        super().__init__()
        self.cross_l2 = cfg.cross_l2
        self.input = FieldInput(schema, cfg.embedding_dim, cfg.embedding_init_std)
        d = self.input.out_dim
        self.cross = CrossNet(d, cfg.cross_layers)
        self.mlp = MLP(d, cfg.mlp, dropout=cfg.dropout, batch_norm=cfg.batch_norm)
        self.out = Linear(d + self.mlp.out_dim, schema.num_tasks)

    def output_bias(self) -> list[tuple[nn.Parameter, int]]:
        """The parameter added unchanged to each logit (the task starts it at the base rate)."""
        return bias_terms(self.out.bias)

    def lr_input(self) -> FieldInput | None:
        """What an LR warm start fills (:func:`~sampan.layers.embed.lr_start_part`): the
        field vectors, whose first columns take the LR's id weights while the output layer
        reads them through the cross network, started as the identity (``None`` when the
        vectors are narrower than the tasks)."""
        return self.input if self.input.dim >= self.out.weight.shape[0] else None

    def start_from_lr(self, bias: torch.Tensor, dense_weight: torch.Tensor | None) -> None:
        """Make the model the LR whose id weights :func:`lr_input`'s vectors now hold."""
        self.cross.start_as_identity()
        start_readout_from_lr(self.input, self.out, bias, dense_weight)

    def forward(self, batch: Batch) -> torch.Tensor:
        x0 = self.input(batch)
        return self.out(torch.cat([self.cross(x0), self.mlp(x0)], dim=1))

    def forward_with_aux(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits and, with ``cross_l2 > 0``, the cross penalty the task adds to its
        training loss."""
        if not self.cross_l2 or not self.training:
            return self(batch), None
        x0 = self.input(batch)
        cross, penalty = self.cross.forward_with_penalty(x0)
        return self.out(torch.cat([cross, self.mlp(x0)], dim=1)), self.cross_l2 * penalty
