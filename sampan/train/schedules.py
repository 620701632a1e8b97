"""Learning-rate schedules as pure functions of the step (nothing to checkpoint but the step)."""

from __future__ import annotations

import math


def lr_factor(step: int, total: int, warmup: int = 0, kind: str = "cosine",
              min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate before optimizer step ``step`` (0-based).

    Linear warmup from ``1/warmup`` to 1 over ``warmup`` steps, then constant or a half-cosine
    decay to ``min_ratio`` at ``total``.

    >>> [round(lr_factor(s, 10, warmup=2), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind in ("constant", "plateau"):  # plateau: the Trainer halves the base on its own
        return 1.0
    if kind != "cosine":
        raise ValueError(f"unknown schedule {kind!r}; expected constant, cosine or plateau")
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
