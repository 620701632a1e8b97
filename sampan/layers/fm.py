"""Factorisation-machine second-order interaction."""

from __future__ import annotations

import torch


def fm_interaction(v: torch.Tensor) -> torch.Tensor:
    """Sum of pairwise dot products of field vectors, ``v [B, F, D] -> [B, 1]``.

    Uses ``0.5 * ((sum_f v_f)^2 - sum_f v_f^2)`` summed over ``D``: O(F*D), not O(F^2*D).

    >>> v = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    >>> fm_interaction(v).item()   # (1*3+2*4) + (1*5+2*6) + (3*5+4*6)
    67.0
    """
    s = v.sum(dim=1)
    return 0.5 * (s.square() - v.square().sum(dim=1)).sum(dim=1, keepdim=True)
