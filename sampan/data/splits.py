"""Assigning rows to train / valid / test without holding the data in memory.

Both methods are functions of the global row index, so any chunking of the input gives the
same assignment.
"""

from __future__ import annotations

import numpy as np

from sampan.config import SplitConfig

TRAIN, VALID, TEST = 0, 1, 2
ROLE_CODES = {"train": TRAIN, "valid": VALID, "test": TEST}


def split_fractions(split: SplitConfig, carve: list[str]) -> dict[str, float]:
    """Fractions of the train source that go to each role in ``carve`` (renormalised).

    Roles that have their own files (not in ``carve``) take nothing from the train source.
    """
    raw = {r: getattr(split, r) for r in carve}
    total = sum(raw.values())
    return {r: v / total for r, v in raw.items()}


def assign(method: str, fractions: dict[str, float], seed: int, n_total: int, start: int,
           count: int) -> np.ndarray:
    """Role code (0 train, 1 valid, 2 test) for rows ``[start, start + count)``.

    ``sequential`` cuts the file in order (the first ``round(n * f_train)`` rows train, then
    valid, then test); ``random`` draws each row's role from a counter-based hash of its
    index and ``seed``.
    """
    idx = np.arange(start, start + count, dtype=np.uint64)
    codes = np.full(count, TRAIN, dtype=np.int8)
    order = [r for r in ("train", "valid", "test") if r in fractions]
    if method == "sequential":
        bounds = np.cumsum([round(n_total * fractions[r]) for r in order])
        bounds[-1] = n_total
        pos = np.searchsorted(bounds, idx.astype(np.int64), side="right")
        for k, r in enumerate(order):
            codes[pos == k] = ROLE_CODES[r]
        return codes
    u = uniform_hash(idx, seed)
    edges = np.cumsum([fractions[r] for r in order])
    pos = np.minimum(np.searchsorted(edges, u, side="right"), len(order) - 1)
    for k, r in enumerate(order):
        codes[pos == k] = ROLE_CODES[r]
    return codes


def uniform_hash(idx: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of ``idx`` mixed with ``seed``, mapped to floats in ``[0, 1)``."""
    with np.errstate(over="ignore"):
        z = idx.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
