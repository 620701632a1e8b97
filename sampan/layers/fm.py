"""Factorisation-machine second-order interaction."""

from __future__ import annotations

from typing import Any

import torch


def _interaction(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the field vectors [B, D], FM output [B, 1])`` of fields given in parts."""
    s = parts[0].sum(dim=1)
    sq = torch.linalg.vector_norm(parts[0].flatten(1), dim=1).square()
    for p in parts[1:]:
        s = s + p.sum(dim=1)
        sq = sq + torch.linalg.vector_norm(p.flatten(1), dim=1).square()
    return s, (0.5 * (s.square().sum(dim=1) - sq)).unsqueeze(1)


class _FMInteraction(torch.autograd.Function):
    """The FM term with its gradient in one pass per part: ``d out / d v_f = s - v_f``."""

    @staticmethod
    def forward(ctx: Any, *parts: torch.Tensor) -> torch.Tensor:
        s, out = _interaction(parts)
        ctx.save_for_backward(s, *parts)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        s, *parts = ctx.saved_tensors
        sg = (s * g).unsqueeze(1)  # [B, 1, D]
        g3 = g.view(-1, 1, 1)
        return tuple(torch.addcmul(sg, p, g3, value=-1.0) if ctx.needs_input_grad[i] else None
                     for i, p in enumerate(parts))


def fm_interaction(*parts: torch.Tensor) -> torch.Tensor:
    """Sum of pairwise dot products of field vectors, ``v [B, F, D] -> [B, 1]``; the fields
    may come in several parts (``[B, F_1, D], [B, F_2, D], ...``), as if concatenated.

    Uses ``0.5 * (||sum_f v_f||^2 - sum_f ||v_f||^2)``: O(F*D), not O(F^2*D), with one pass
    over the vectors forward and one backward (no ``[B, F, D]`` temporaries), and no copy to
    concatenate parts.

    >>> v = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    >>> fm_interaction(v).item()   # (1*3+2*4) + (1*5+2*6) + (3*5+4*6)
    67.0
    >>> fm_interaction(v[:, :1], v[:, 1:]).item()
    67.0
    """
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        v = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        s = v.sum(dim=1)  # the plain formula: what exported and compiled graphs trace
        return 0.5 * (s.square() - v.square().sum(dim=1)).sum(dim=1, keepdim=True)
    if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        return _FMInteraction.apply(*parts)
    return _interaction(parts)[1]
