"""Off-policy evaluation: a candidate model's click rate on traffic another policy served.

The logged action of a request is the item it showed first (``position`` 0), with the
logging policy's probability of showing it first (``propensity``: exploration must be on
when the traffic was served; without it the candidate can only be judged where it agrees
with the logger, and no unbiased estimate exists). The candidate policy ``pi`` puts the item
with its highest score first (``greedy``, ties shared) or samples the softmax of its scores
at a temperature (``softmax``). With ``w = pi(a | x) / propensity(a | x)`` and the reward
``r`` (the joined click label):

- **IPS**: ``mean(w r)``, unbiased, high variance when ``w`` is large;
- **SNIPS**: ``sum(w r) / sum(w)``, self-normalised: a little bias, much less variance;
- **DR** (doubly robust): ``mean(sum_b pi(b | x) q(x, b) + w (r - q(x, a)))`` with a reward
  model ``q``: the candidate's own click probability (``own``), or that score calibrated on
  the logged clicks (``calibrated``: Platt scaling, cross-fitted over two halves of the
  requests so that no request's reward model saw its own click). Unbiased when either the
  propensities or ``q`` are right.

Each comes with a percentile bootstrap interval over requests (SNIPS resampled as a ratio).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sampan.errors import DataError

ESTIMATORS = ("ips", "snips", "dr")


@dataclass
class Logged:
    """A log as arrays, one entry per served item; ``request`` as 0..R-1 codes."""

    request: np.ndarray
    position: np.ndarray
    propensity: np.ndarray
    reward: np.ndarray

    @classmethod
    def of(cls, request: np.ndarray, position: np.ndarray, propensity: np.ndarray,
           reward: np.ndarray) -> Logged:
        _, codes = np.unique(np.asarray(request), return_inverse=True)
        return cls(codes.astype(np.int64), np.asarray(position, np.int64),
                   np.asarray(propensity, np.float64), np.asarray(reward, np.float64))

    @property
    def requests(self) -> int:
        return int(self.request.max()) + 1 if len(self.request) else 0


def policy(request: np.ndarray, scores: np.ndarray, kind: str = "greedy",
           temperature: float = 1.0, epsilon: float = 0.0) -> np.ndarray:
    """Each row's probability of being put first by the policy of ``scores``: ``greedy``
    (the top score; ties share), ``softmax`` at ``temperature``; either mixed with a uniform
    pick over the request's items with probability ``epsilon``."""
    request = np.asarray(request, np.int64)
    s = np.asarray(scores, np.float64)
    n_req = int(request.max()) + 1 if len(request) else 0
    size = np.bincount(request, minlength=n_req).astype(np.float64)
    top = np.full(n_req, -np.inf)
    np.maximum.at(top, request, s)
    if kind == "greedy":
        is_top = (s == top[request]).astype(np.float64)
        p = is_top / np.bincount(request, weights=is_top, minlength=n_req)[request]
    elif kind == "softmax":
        e = np.exp((s - top[request]) / temperature)
        p = e / np.bincount(request, weights=e, minlength=n_req)[request]
    else:
        raise DataError(f"unknown policy {kind!r}; expected greedy or softmax")
    return (1 - epsilon) * p + epsilon / size[request]


def _platt(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """``(a, b)`` of ``sigmoid(a x + b)`` fitted to labels ``y`` by Newton's method (a tiny
    ridge keeps it finite on separable data)."""
    a, b = 1.0, 0.0
    for _ in range(50):
        z = a * x + b
        p = 1 / (1 + np.exp(-z))
        g = np.array([((p - y) * x).sum() + 1e-3 * (a - 1), (p - y).sum()])
        w = p * (1 - p)
        h = np.array([[(w * x * x).sum() + 1e-3, (w * x).sum()],
                      [(w * x).sum(), w.sum() + 1e-9]])
        step = np.linalg.solve(h, g)
        a, b = a - step[0], b - step[1]
        if np.abs(step).max() < 1e-8:
            break
    return float(a), float(b)


def reward_model(log: Logged, scores: np.ndarray, kind: str = "own",
                 seed: int = 0) -> np.ndarray:
    """``q(x, b)`` for every row: the candidate's click probability ``scores`` (``own``), or
    it calibrated on the logged first items' clicks (``calibrated``, cross-fitted)."""
    q = np.clip(np.asarray(scores, np.float64), 1e-6, 1 - 1e-6)
    if kind == "own":
        return q
    if kind != "calibrated":
        raise DataError(f"unknown reward model {kind!r}; expected own or calibrated")
    logit = np.log(q / (1 - q))
    half = np.random.default_rng(seed).integers(0, 2, log.requests)[log.request]
    shown = log.position == 0
    out = np.empty_like(q)
    for k in (0, 1):
        fit = shown & (half != k)
        a, b = _platt(logit[fit], log.reward[fit])
        out[half == k] = 1 / (1 + np.exp(-(a * logit[half == k] + b)))
    return out


def per_request(log: Logged, target: np.ndarray, q: np.ndarray) -> dict[str, np.ndarray]:
    """Per request: the weight ``w`` of its logged first item, ``w r``, and the DR term."""
    shown = np.flatnonzero(log.position == 0)
    if len(shown) != log.requests or len(np.unique(log.request[shown])) != log.requests:
        raise DataError("off-policy evaluation needs exactly one item at position 0 in every "
                        "request of the log")
    prop = log.propensity[shown]
    if np.isnan(prop).any() or (prop <= 0).any():
        raise DataError("the log's propensities are missing or 0 for some shown items: "
                        "serve with exploration on (explore:) to log them")
    order = np.argsort(log.request[shown])
    shown, prop = shown[order], prop[order]
    w = target[shown] / prop
    r = log.reward[shown]
    direct = np.bincount(log.request, weights=target * q, minlength=log.requests)
    return {"w": w, "wr": w * r, "dr": direct + w * (r - q[shown])}


def estimate(parts: dict[str, np.ndarray], resamples: int = 1000, seed: int = 0,
             ci: float = 0.95) -> dict[str, dict[str, float]]:
    """IPS, SNIPS and DR with percentile bootstrap intervals over requests."""
    w, wr, dr = parts["w"], parts["wr"], parts["dr"]
    n = len(w)
    point = {"ips": wr.mean(), "snips": wr.sum() / w.sum(), "dr": dr.mean()}
    rng = np.random.default_rng(seed)
    boot = {k: np.empty(resamples) for k in ESTIMATORS}
    for i in range(resamples):  # a loop over resamples, each one vectorised over requests
        counts = np.bincount(rng.integers(0, n, n), minlength=n)
        boot["ips"][i] = counts @ wr / n
        boot["snips"][i] = (counts @ wr) / (counts @ w)
        boot["dr"][i] = counts @ dr / n
    lo_q, hi_q = (1 - ci) / 2, 1 - (1 - ci) / 2
    return {k: {"estimate": float(point[k]), "low": float(np.quantile(boot[k], lo_q)),
                "high": float(np.quantile(boot[k], hi_q)),
                "se": float(boot[k].std(ddof=1))} for k in ESTIMATORS}


def evaluate(log: Logged, candidate_scores: np.ndarray, kind: str = "greedy",
             temperature: float = 1.0, reward: str = "own", resamples: int = 1000,
             seed: int = 0) -> dict[str, Any]:
    """The candidate's estimated click rate on ``log`` by IPS, SNIPS and DR, with the
    logged policy's own click rate beside them (the mean reward of the shown items)."""
    target = policy(log.request, candidate_scores, kind, temperature)
    q = reward_model(log, candidate_scores, reward, seed)
    parts = per_request(log, target, q)
    out = estimate(parts, resamples, seed)
    shown = log.position == 0
    return {"estimates": out, "logged_ctr": float(log.reward[shown].mean()),
            "requests": log.requests, "policy": kind, "temperature": temperature,
            "reward_model": reward,
            "effective_sample_size": float(parts["w"].sum() ** 2 / (parts["w"] ** 2).sum()),
            "max_weight": float(parts["w"].max())}
