"""Multi-layer perceptron block."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``[B, in] -> [B, hidden[-1]]`` (or ``[B, out]`` when ``out`` is given).

    Each hidden layer is Linear -> (BatchNorm) -> ReLU -> (Dropout).

    >>> MLP(8, [16, 4], out=1)(torch.zeros(2, 8)).shape
    torch.Size([2, 1])
    """

    def __init__(self, in_dim: int, hidden: list[int], out: int | None = None,
                 dropout: float = 0.0, batch_norm: bool = False):
        super().__init__()
        layers: list[nn.Module] = []
        d = in_dim
        for h in hidden:
            layers.append(nn.Linear(d, h))
            if batch_norm:
                layers.append(nn.BatchNorm1d(h))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            d = h
        if out is not None:
            layers.append(nn.Linear(d, out))
            d = out
        self.out_dim = d
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
