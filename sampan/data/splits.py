"""Assigning rows to train / valid / test without holding the data in memory.

Both methods are functions of the global row index, so any chunking of the input gives the
same assignment.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from sampan.config import SplitConfig
from sampan.errors import ConfigError

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


class Splitter:
    """Role codes for the rows of staged chunks of the train source.

    ``sequential`` / ``random`` use the row index; ``time`` compares ``split.column`` with
    two boundaries (``[valid_from, test_from]``: explicit, or the time quantiles at the
    train and train+valid fractions, fitted from a sample of the column); ``group`` hashes
    the value of ``split.column`` so a group (a user) never straddles two splits.
    """

    def __init__(self, split: SplitConfig, fractions: dict[str, float], n_total: int,
                 times: np.ndarray | None = None,
                 held_out: tuple[np.ndarray, np.ndarray] | None = None):
        self.split, self.fractions, self.n_total = split, fractions, n_total
        self.boundaries: tuple[float, float] | None = None
        # leave_one_out: the sorted row indices of the valid and of the test rows
        self.held_out = held_out
        if split.method == "leave_one_out" and held_out is None:
            raise ConfigError("a leave_one_out split needs each user's last rows "
                              "(leave_one_out_rows)")
        if split.method == "time":
            if split.boundaries is not None:
                self.boundaries = (float(split.boundaries[0]), float(split.boundaries[1]))
            else:
                if times is None or not len(times):
                    raise ConfigError("a time split needs the timestamps of the train source")
                f_train = fractions.get("train", 1.0)
                f_valid = fractions.get("valid", 0.0)
                f_test = fractions.get("test", 0.0)
                # a role that takes nothing from the train source gets no rows at all
                b1 = float(np.quantile(times, f_train)) if f_valid + f_test > 0 else np.inf
                b2 = float(np.quantile(times, min(1.0, f_train + f_valid))) if f_test > 0 \
                    else np.inf
                self.boundaries = (b1, b2)

    def codes(self, table: pa.Table, start: int) -> np.ndarray:
        n = table.num_rows
        method = self.split.method
        if method in ("sequential", "random"):
            return assign(method, self.fractions, self.split.seed, self.n_total, start, n)
        if method == "leave_one_out":
            idx = np.arange(start, start + n, dtype=np.int64)
            codes = np.full(n, TRAIN, dtype=np.int8)
            for rows, code in zip(self.held_out, (VALID, TEST), strict=True):
                codes[_member(idx, rows)] = code
            return codes
        values = table.column(self.split.column).combine_chunks()
        if method == "time":
            t = values.to_numpy(zero_copy_only=False).astype(np.float64)
            b1, b2 = self.boundaries
            codes = np.where(t < b1, TRAIN, np.where(t < b2, VALID, TEST)).astype(np.int8)
            return codes
        from sampan.data.transforms import stable_hash

        u = uniform_hash(stable_hash(values), self.split.seed)
        order = [r for r in ("train", "valid", "test") if r in self.fractions]
        edges = np.cumsum([self.fractions[r] for r in order])
        pos = np.minimum(np.searchsorted(edges, u, side="right"), len(order) - 1)
        codes = np.empty(n, dtype=np.int8)
        for k, r in enumerate(order):
            codes[pos == k] = ROLE_CODES[r]
        return codes


def _member(idx: np.ndarray, sorted_rows: np.ndarray) -> np.ndarray:
    """Which of ``idx`` are in ``sorted_rows`` (ascending, unique)."""
    if not len(sorted_rows):
        return np.zeros(len(idx), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_rows, idx), len(sorted_rows) - 1)
    return sorted_rows[at] == idx


class LeaveOneOut:
    """Each user's last two rows, found chunk by chunk: :meth:`add` every chunk of the train
    source in order, then :meth:`rows` gives ``(valid rows, test rows)``: for each user with
    3 or more rows, the row index of the second-to-last and of the last, by ``order`` (ties
    and no order: file order). Memory: two rows per user.

    >>> loo = LeaveOneOut()
    >>> loo.add(np.array([7, 7, 9, 7]), None, 0)
    >>> loo.add(np.array([7, 9, 9, 5]), None, 4)
    >>> [r.tolist() for r in loo.rows()]  # user 5 has one row: train only
    [[3, 5], [4, 6]]
    >>> loo = LeaveOneOut()
    >>> loo.add(np.array([1, 1, 1]), np.array([30.0, 10.0, 20.0]), 0)
    >>> [r.tolist() for r in loo.rows()]  # by time: row 2 (t=20) valid, row 0 (t=30) test
    [[2], [0]]
    """

    def __init__(self) -> None:
        self.user = np.empty(0, np.uint64)
        self.time = np.empty(0, np.float64)
        self.row = np.empty(0, np.int64)
        self.count = np.empty(0, np.int64)

    def add(self, users: np.ndarray, times: np.ndarray | None, start: int) -> None:
        n = len(users)
        row = np.arange(start, start + n, dtype=np.int64)
        t = row.astype(np.float64) if times is None else np.asarray(times, np.float64)
        u = np.concatenate([self.user, users.astype(np.uint64)])
        tt = np.concatenate([self.time, t])
        rr = np.concatenate([self.row, row])
        cc = np.concatenate([self.count, np.zeros(n, np.int64)])  # a kept row's tally
        order = np.lexsort((rr, tt, u))  # by user, then time, then file order
        u, tt, rr, cc = u[order], tt[order], rr[order], cc[order]
        first = np.concatenate([[True], u[1:] != u[:-1]]) if len(u) else np.zeros(0, bool)
        group = np.cumsum(first) - 1
        starts = np.flatnonzero(first)
        ends = np.append(starts[1:], len(u))
        # rows seen per user: the new ones plus those the kept rows stood for
        new = np.bincount(group, weights=(cc == 0), minlength=len(starts)).astype(np.int64)
        carried = np.zeros(len(starts), np.int64)
        np.maximum.at(carried, group, cc)
        total = new + carried
        keep = np.arange(len(u)) >= ends[group] - 2  # the last two of each user
        self.user, self.time, self.row = u[keep], tt[keep], rr[keep]
        self.count = total[group[keep]]

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        u = self.user
        if not len(u):
            return np.empty(0, np.int64), np.empty(0, np.int64)
        last = np.append(u[1:] != u[:-1], True)
        second = np.append(u[:-1] == u[1:], False)  # its next row is the user's last
        enough = self.count >= 3
        return np.sort(self.row[second & enough]), np.sort(self.row[last & enough])
