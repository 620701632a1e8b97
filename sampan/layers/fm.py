"""Factorisation-machine second-order interaction: Rendle's (every field pair weighted 1) and
the field-weighted one (FwFM: a learned weight per field pair)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The learning-rate multiplier of the field-pair weights: each must be able to move by about
# 1 (keep a pair, or drop it) within the first few hundred steps, while the embeddings around
# it learn at the run's rate; at 1x (lr 1e-3) the weights barely leave 1 before the run
# stops, and the model stays the plain FM.
PAIR_WEIGHT_LR = 10.0


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


class FieldWeightedFM(nn.Module):
    """Field-weighted FM interaction (FwFM, Pan et al. 2018): ``sum_{f<g} r_fg <v_f, v_g>``
    with one learned weight ``r_fg`` per pair of fields; ``v [B, F, D] -> [B, 1]`` (fields
    in parts, as :func:`fm_interaction`).

    The weights start at 1, where this is Rendle's FM, and learn at ``PAIR_WEIGHT_LR`` times
    the run's rate (``lr_multiplier`` on the parameter, read by the trainer's optimizer).
    Why it is the default of ``fm`` and ``deepfm``: in a plain FM every field's vector serves
    every pair it is in, so a few pairs that interact among many that do not are learned
    through the noise of all the others; the pair weights let the model keep those few. On
    the defaults benchmark's world with 44 fields and 10 true pairs, the six largest of the
    946 learned weights are true pairs.

    ``l1`` (``model.field_weights_l1``: 0.1 in ``fm`` and ``deepfm``) pulls the weights
    toward 0: after every step each one moves toward 0 by ``l1`` times its learning rate and
    stops there (a proximal L1 step; ``l1_shrink`` on the parameter, applied by the trainer,
    see :func:`sampan.train.compute.l1_shrink_targets`). An Adam step moves a weight by up
    to its learning rate, so a pair whose gradient keeps its sign holds its weight, and one
    whose gradient is noise ends at 0, where it stops adding that noise to every
    prediction. Without it, the weights of pairs that do not interact wander around their
    start of 1.

    >>> v = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    >>> FieldWeightedFM(3)(v).item()   # weights 1: the plain FM
    67.0
    """

    def __init__(self, num_fields: int, l1: float = 0.0):
        super().__init__()
        self.num_fields = num_fields
        self.weight = nn.Parameter(torch.ones(num_fields, num_fields))
        self.weight.lr_multiplier = PAIR_WEIGHT_LR  # type: ignore[attr-defined]
        if l1 > 0:
            self.weight.l1_shrink = l1  # type: ignore[attr-defined]
        self.register_buffer("upper", torch.ones(num_fields, num_fields).triu(1),
                             persistent=False)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              *args: Any) -> None:
        # a model saved before FM had field weights is this one with every weight 1
        state_dict.setdefault(prefix + "weight", torch.ones_like(self.weight))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def pair_weights(self) -> torch.Tensor:
        """``[F, F]``: ``r_fg`` above the diagonal, zero elsewhere."""
        return self.weight * self.upper

    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        v = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if v.shape[1] != self.num_fields:
            raise ValueError(f"FieldWeightedFM was built for {self.num_fields} fields, got "
                             f"{v.shape[1]}")
        vt = v.transpose(1, 2)  # [B, D, F]: one [B*D, F] x [F, F] GEMM
        return (torch.matmul(vt, self.pair_weights().to(v.dtype)) * vt).sum(dim=(1, 2)
                                                                             ).unsqueeze(1)


def pair_interaction(pairs: FieldWeightedFM | None, *parts: torch.Tensor) -> torch.Tensor:
    """The second-order term of the FM family: ``pairs`` (field-weighted) when the model has
    one, else Rendle's :func:`fm_interaction`."""
    return pairs(*parts) if pairs is not None else fm_interaction(*parts)
