"""Target attention over a behaviour sequence (DIN's local activation unit; DIEN reuses it)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from sampan.layers.mlp import MLP


class TargetAttention(nn.Module):
    """Weights ``[B, L]`` from an MLP over ``[q, k, q - k, q * k]`` for a query ``q [B, D]``
    and keys ``k [B, L, D]`` (``forward``, the one entry point, so that ``torch.compile`` of
    this module covers the MLP and the normalisation).

    ``normalization="none"`` gives the raw scores, as in the DIN paper: the pooled vector
    (:meth:`pool`) keeps the intensity of interest. ``"softmax"`` gives weights summing to 1
    (DIEN's attention, and DIN's default here). Padded positions (``mask`` False) get weight
    0 in both.

    The MLP's first layer is computed as ``[q, k, q * k] @ [W_q + W_d, W_k - W_d, W_p]^T``,
    which equals ``[q, k, q - k, q * k] @ [W_q, W_k, W_d, W_p]^T``: the same parameters (and
    state_dict), a quarter fewer multiply-adds on the ``B x L`` rows, and no ``q - k`` copy.

    >>> att = TargetAttention(4, [8], "relu")
    >>> q, k, mask = torch.randn(2, 4), torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> w = att(q, k, mask.bool())
    >>> w.shape, w.sum(1).tolist()
    (torch.Size([2, 3]), [1.0, 1.0])
    """

    def __init__(self, dim: int, hidden: list[int], act: str,
                 normalization: Literal["softmax", "none"] = "softmax"):
        super().__init__()
        if normalization not in ("softmax", "none"):
            raise ValueError(f"normalization must be 'softmax' or 'none', got {normalization!r}")
        self.dim = dim
        self.normalization = normalization
        self.mlp = MLP(4 * dim, hidden, out=1, act=act)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Raw scores ``[B, L]`` (no mask)."""
        first, rest = self.mlp.net[0], self.mlp.net[1:]
        wq, wk, wd, wp = first.weight.split(self.dim, dim=1)
        weight = torch.cat([wq + wd, wk - wd, wp], dim=1)  # [H, 3D]: tiny
        qe = q.unsqueeze(1).expand_as(k)
        x = torch.cat([qe, k, qe * k], dim=-1)
        return rest(first(x, weight)).squeeze(-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q [B, D]``, ``k [B, L, D]``, ``mask [B, L]`` (True = real event) -> weights
        ``[B, L]`` (softmax: summing to 1 over the real positions, all 0 for an empty row)."""
        s = self.scores(q, k)
        if self.normalization == "none":
            return s * mask.to(k.dtype)
        w = torch.softmax(s.float().masked_fill(~mask, float("-inf")), dim=1)
        return torch.nan_to_num(w, nan=0.0).to(k.dtype)

    @staticmethod
    def pool(w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``sum_l w[b, l] k[b, l]``: ``[B, L]``, ``[B, L, D]`` -> ``[B, D]``."""
        return torch.bmm(w.unsqueeze(1), k).squeeze(1)
