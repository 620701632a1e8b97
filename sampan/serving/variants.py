"""Sticky assignment of units (users) to the arms of an A/B experiment.

A unit's bucket is a salted hash: ``bucket = H(salt, unit) mod 10,000``, with the experiment's
name as the salt. ``H`` is BLAKE2b, not Python's ``hash``, so every process, worker and
restart computes the same bucket. Each arm owns a set of buckets, as many as its weight's
share of 10,000; the unit's arm is its bucket's owner.

The owners come from the weights alone at the start (contiguous ranges in the order the arms
are given), so ``--workers N`` processes and a restarted server agree without talking. A
weight change (:meth:`Allocation.reweighted`) moves only the buckets that must move, and only
from arms that shrink to arms that grow: going 90/10 -> 80/20 moves 1,000 buckets of control
to the candidate and none the other way (each shrinking arm gives up its highest buckets,
the growing arms take the lowest of those). A changed allocation is saved
(:meth:`Allocation.save`) for the other processes and the next start to read.

>>> a = Allocation.from_weights([("control", 90), ("candidate", 10)])
>>> a.counts()
{'control': 9000, 'candidate': 1000}
>>> b = a.reweighted({"control": 80, "candidate": 20})
>>> moved = [(x, y) for x, y in zip(a.owner_names(), b.owner_names()) if x != y]
>>> len(moved), set(moved)
(1000, {('control', 'candidate')})
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sampan.errors import ConfigError

BUCKETS = 10_000


def bucket_of(salt: str, unit: str) -> int:
    """The unit's bucket in ``[0, 10,000)``: the same in every process and on every run."""
    digest = hashlib.blake2b(f"{salt}\x1f{unit}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % BUCKETS


def parse_variant(text: str) -> tuple[str, str, float]:
    """``NAME=SOURCE:WEIGHT`` (a bundle or a watched folder, and a share of traffic) as
    ``(name, source, weight)``."""
    name, eq, rest = text.partition("=")
    source, colon, weight = rest.rpartition(":")
    try:
        w = float(weight)
    except ValueError:
        w = -1.0
    if not eq or not name or not colon or not source or w < 0:
        raise ConfigError(f"--variant {text!r}: expected NAME=BUNDLE_OR_WATCH_DIR:WEIGHT, "
                          "e.g. control=bundles/deepfm:90 (a weight of 0 or more)")
    return name, source, w


def _shares(weights: Sequence[float]) -> list[int]:
    """Bucket counts proportional to ``weights`` that add up to 10,000 (largest remainders
    get the rounding; ties to the earlier arm)."""
    total = float(sum(weights))
    exact = [BUCKETS * w / total for w in weights]
    counts = [int(x) for x in exact]
    left = BUCKETS - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


class Allocation:
    """Which arm owns each of the 10,000 buckets."""

    def __init__(self, names: Sequence[str], weights: Sequence[float], owner: np.ndarray):
        self.names = list(names)
        self.weights = [float(w) for w in weights]
        self.owner = np.asarray(owner, dtype=np.int16)  # bucket -> arm index

    @classmethod
    def from_weights(cls, arms: Sequence[tuple[str, float]]) -> Allocation:
        names = [n for n, _ in arms]
        weights = [float(w) for _, w in arms]
        if not names:
            raise ConfigError("an experiment needs at least one arm")
        if len(set(names)) != len(names):
            raise ConfigError(f"arm names must differ; got {names}")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"arm weights must be 0 or more and not all 0; got {weights}")
        counts = _shares(weights)
        owner = np.repeat(np.arange(len(names), dtype=np.int16), counts)
        return cls(names, weights, owner)

    def arm_of_bucket(self, bucket: int) -> str:
        return self.names[int(self.owner[bucket])]

    def arm_of(self, salt: str, unit: str) -> str:
        return self.arm_of_bucket(bucket_of(salt, unit))

    def counts(self) -> dict[str, int]:
        c = np.bincount(self.owner, minlength=len(self.names))
        return {n: int(k) for n, k in zip(self.names, c, strict=True)}

    def owner_names(self) -> list[str]:
        return [self.names[i] for i in self.owner]

    def shares(self) -> dict[str, float]:
        """Each arm's share of the buckets (the traffic it should get)."""
        return {n: k / BUCKETS for n, k in self.counts().items()}

    def reweighted(self, weights: dict[str, float]) -> Allocation:
        """The allocation for new ``weights`` (every arm named, the same arms): each arm
        that shrinks gives up its highest buckets, and the arms that grow take them, lowest
        first, in the order the arms were given. No bucket moves between two arms that both
        keep or grow their share."""
        if set(weights) != set(self.names):
            raise ConfigError(f"new weights must name every arm {self.names}; got "
                              f"{sorted(weights)}")
        new = [float(weights[n]) for n in self.names]
        target = Allocation.from_weights(list(zip(self.names, new, strict=True))).counts()
        owner = self.owner.copy()
        freed: list[np.ndarray] = []
        for i, n in enumerate(self.names):
            mine = np.flatnonzero(owner == i)
            extra = len(mine) - target[n]
            if extra > 0:
                freed.append(mine[len(mine) - extra:])
        pool = np.sort(np.concatenate(freed)) if freed else np.zeros(0, dtype=np.int64)
        at = 0
        for i, n in enumerate(self.names):
            need = target[n] - int((owner == i).sum())
            if need > 0:
                owner[pool[at:at + need]] = i
                at += need
        return Allocation(self.names, new, owner)

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict:
        """Run-length ranges of owners: ``[[first_bucket, arm], ...]``, with the weights."""
        starts = np.flatnonzero(np.diff(self.owner, prepend=-1))
        return {"arms": [{"name": n, "weight": w} for n, w in zip(self.names, self.weights,
                                                                   strict=True)],
                "buckets": BUCKETS,
                "ranges": [[int(s), self.names[int(self.owner[s])]] for s in starts]}

    @classmethod
    def from_json(cls, d: dict) -> Allocation:
        names = [a["name"] for a in d["arms"]]
        index = {n: i for i, n in enumerate(names)}
        owner = np.empty(BUCKETS, dtype=np.int16)
        ranges = d["ranges"]
        for (start, arm), nxt in zip(ranges, [*ranges[1:], [BUCKETS, None]], strict=True):
            owner[start:nxt[0]] = index[arm]
        return cls(names, [a["weight"] for a in d["arms"]], owner)

    def save(self, path: Path) -> None:
        """Written whole or not at all (a temporary file renamed over the old one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load_or_start(cls, path: Path | None, arms: Sequence[tuple[str, float]]) -> Allocation:
        """The saved allocation at ``path`` when it is for the same arms (a restart keeps
        the weights changed at runtime), else a new one from ``arms``."""
        if path is not None and Path(path).exists():
            saved = cls.from_json(json.loads(Path(path).read_text()))
            if saved.names == [n for n, _ in arms]:
                return saved
        return cls.from_weights(arms)
