"""Target attention over a behaviour sequence (DIN's local activation unit; DIEN reuses it)."""

from __future__ import annotations

import torch
from torch import nn

from sampan.layers.mlp import MLP


class TargetAttention(nn.Module):
    """Scores ``[B, L]`` from an MLP over ``[q, k, q - k, q * k]`` for a query ``q [B, D]``
    and keys ``k [B, L, D]``.

    ``forward`` pools the keys with the raw scores, as in the DIN paper: the weights are not
    normalised, so the pooled vector keeps the intensity of interest. ``softmax`` gives
    weights summing to 1 (DIEN's attention, and DIN's default here). Padded positions
    (``mask`` False) get weight 0 in both.
    """

    def __init__(self, dim: int, hidden: list[int], act: str):
        super().__init__()
        self.mlp = MLP(4 * dim, hidden, out=1, act=act)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        qe = q.unsqueeze(1).expand_as(k)
        return self.mlp(torch.cat([qe, k, qe - k, qe * k], dim=-1)).squeeze(-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [B, D]``, ``k [B, L, D]``, ``mask [B, L]`` (True = real event) -> ``[B, D]``."""
        w = self.scores(q, k) * mask.to(k.dtype)
        return torch.bmm(w.unsqueeze(1), k).squeeze(1)

    def softmax(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Weights ``[B, L]`` summing to 1 over the real positions (all 0 for an empty row)."""
        s = self.scores(q, k).float().masked_fill(~mask, float("-inf"))
        w = torch.softmax(s, dim=1)
        return torch.nan_to_num(w, nan=0.0).to(k.dtype)
