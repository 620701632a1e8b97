"""``Batch``: what a model takes, in torch alone (importing a model imports no data code).

>>> import torch
>>> b = Batch(dense=torch.zeros(2, 3), sparse=torch.zeros(2, 4, dtype=torch.long))
>>> b.size
2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch


@dataclass
class Batch:
    """One batch of the DESIGN contract.

    ``dense [B, Nd] f32`` · ``sparse [B, F] i64`` · ``labels [B, T] f32`` ·
    ``group [B] i64`` (for GAUC; optional) · ``oracle [B] f64`` (synthetic data only).
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor | None = None
    group: torch.Tensor | None = None
    oracle: torch.Tensor | None = None
    sequences: dict[str, torch.Tensor] | None = None  # name -> ids [B, L], 0 = padding

    @property
    def size(self) -> int:
        return int(self.sparse.shape[0])

    def mask(self, name: str) -> torch.Tensor:
        """``[B, L]`` True where list feature ``name`` holds a value (False = padding)."""
        return self.sequences[name] != 0

    def lengths(self, name: str) -> torch.Tensor:
        """``[B]`` number of values of list feature ``name`` in each row."""
        return self.mask(name).sum(dim=1)

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """A new Batch with ``fn`` applied to every tensor (sequences included)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, dict):
                out[f.name] = {k: fn(t) for k, t in v.items()}
            else:
                out[f.name] = None if v is None else fn(v)
        return Batch(**out)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self.apply(lambda t: t.pin_memory())
