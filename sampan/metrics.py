"""Ranking and calibration metrics computed on whole prediction vectors, on any device.

* :func:`auc` — exact ROC AUC (Mann-Whitney U with tied scores given their average rank).
* :func:`logloss` — mean binary cross-entropy, computed from logits (no clipping needed).
* :func:`gauc` — per-group AUC weighted by the group's impressions; groups whose labels
  are all one class have no AUC and are skipped (and counted).
* :func:`auc_bootstrap` — the AUC of many bootstrap resamples of the rows, for confidence
  intervals and paired comparisons of models scored on the same rows.

All run in float64 and never loop over rows or groups in Python.

>>> auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
0.75
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def _avg_ranks(sorted_keys: list[torch.Tensor]) -> torch.Tensor:
    """1-based positions, averaged over runs where every key in ``sorted_keys`` is equal."""
    n = sorted_keys[0].numel()
    change = torch.zeros(n, dtype=torch.bool, device=sorted_keys[0].device)
    change[0] = True
    for k in sorted_keys:
        change[1:] |= k[1:] != k[:-1]
    tie_id = change.cumsum(0) - 1
    counts = torch.bincount(tie_id)
    ends = counts.cumsum(0).to(torch.float64)  # 1-based last position of each tie run
    starts = ends - counts + 1
    return ((starts + ends) / 2)[tie_id]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC; labels > 0.5 are positives. ``nan`` when only one class is present."""
    s = scores.detach().reshape(-1).to(torch.float64)
    y = labels.detach().reshape(-1) > 0.5
    n = s.numel()
    npos = int(y.sum())
    nneg = n - npos
    if npos == 0 or nneg == 0:
        return math.nan
    order = torch.argsort(s, stable=True)
    ranks = _avg_ranks([s[order]])
    rank_sum = ranks[y[order]].sum().item()
    return (rank_sum - npos * (npos + 1) / 2) / (npos * nneg)


def auc_bootstrap(scores: torch.Tensor, labels: torch.Tensor, resamples: int = 1000,
                  seed: int = 0, chunk: int = 64) -> torch.Tensor:
    """AUC of ``resamples`` bootstrap resamples of the rows -> ``[resamples]`` (float64).

    Resample ``r`` draws ``n`` rows with replacement; its AUC is computed exactly (ties
    count half) from the number of times each row was drawn, so nothing is re-sorted per
    resample. The draws depend only on ``seed``, ``resamples`` and ``n``: two models scored
    on the same rows get the same resamples, and the difference of their vectors is a
    paired bootstrap of the AUC difference. A resample with one class only is ``nan``.

    >>> y = torch.tensor([0, 0, 1, 1])
    >>> b = auc_bootstrap(torch.tensor([0.1, 0.4, 0.35, 0.8]), y, resamples=200)
    >>> b.shape, bool(((b[~b.isnan()] >= 0) & (b[~b.isnan()] <= 1)).all())
    (torch.Size([200]), True)
    """
    s = scores.detach().reshape(-1).to(torch.float64).cpu()
    y = labels.detach().reshape(-1).cpu() > 0.5
    n = s.numel()
    order = torch.argsort(s, stable=True)
    ss, ys = s[order], y[order]
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = ss[1:] != ss[:-1]
    tie_id = change.cumsum(0) - 1
    sizes = torch.bincount(tie_id)
    end = sizes.cumsum(0)  # exclusive end of each tie run, in sorted positions
    first, last = (end - sizes)[tie_id], end[tie_id]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, resamples, chunk):
        r = min(chunk, resamples - start)
        draws = torch.randint(0, n, (r, n), generator=gen)
        w = torch.zeros(r, n, dtype=torch.float64).scatter_add_(
            1, draws, torch.ones(r, n, dtype=torch.float64))[:, order]
        wneg = w * ~ys
        wpos = w * ys
        cum = torch.nn.functional.pad(wneg.cumsum(1), (1, 0))  # negatives before a position
        below, upto = cum[:, first], cum[:, last]
        u = (wpos * (below + 0.5 * (upto - below))).sum(1)
        pairs = wpos.sum(1) * wneg.sum(1)
        out.append(torch.where(pairs > 0, u / pairs.clamp_min(1.0), torch.nan))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.float64)



def paired_auc_comparison(a: torch.Tensor, b: torch.Tensor | Sequence[torch.Tensor],
                          labels: torch.Tensor, resamples: int = 1000) -> dict[str, Any]:
    """Paired bootstrap of ``AUC(b) - AUC(a)`` on the same rows: both score vectors see the
    same resamples. Returns both AUCs, ``diff``, its 95 % interval ``diff_ci95`` and
    ``p_b_better``, the share of resamples in which ``b`` came out ahead (what ``sampan
    compare`` prints).

    ``b`` may be several score vectors of one model on the same rows (runs with different
    seeds): ``auc_b`` and ``diff`` are then their means, and the interval and ``p_b_better``
    come from the draws of every run pooled, so they hold the runs' spread as well as the
    rows'. ``auc_b_runs`` lists each run's AUC (one for a single vector).

    >>> y = torch.tensor([0., 0., 1., 1., 0., 1.] * 20)
    >>> r = paired_auc_comparison(torch.rand(120), y * 2 + torch.rand(120), y, resamples=100)
    >>> r["diff"] > 0, r["diff_ci95"][0] > 0, r["p_b_better"]
    (True, True, 1.0)
    >>> r = paired_auc_comparison(torch.rand(120), [y + torch.rand(120), y * 2 + torch.rand(120)],
    ...                           y, resamples=100)
    >>> len(r["auc_b_runs"]), r["auc_b"] == sum(r["auc_b_runs"]) / 2
    (2, True)
    """
    runs = [b] if isinstance(b, torch.Tensor) else list(b)
    if not runs:
        raise ValueError("paired_auc_comparison: no scores to compare")
    ba = auc_bootstrap(a, labels, resamples)
    diffs = []
    for scores in runs:
        bb = auc_bootstrap(scores, labels, resamples)
        diffs.append((bb - ba)[~(ba.isnan() | bb.isnan())])
    diff = torch.cat(diffs)
    auc_a = auc(a, labels)
    aucs = [auc(scores, labels) for scores in runs]
    auc_b = sum(aucs) / len(aucs)
    return {"auc_a": auc_a, "auc_b": auc_b, "diff": auc_b - auc_a, "auc_b_runs": aucs,
            "diff_ci95": [float(torch.quantile(diff, 0.025)), float(torch.quantile(diff, 0.975))],
            "p_b_better": float((diff > 0).double().mean())}

def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of ``sigmoid(logits)`` against ``labels`` (natural log)."""
    return F.binary_cross_entropy_with_logits(
        logits.detach().reshape(-1).to(torch.float64), labels.detach().reshape(-1).to(torch.float64)
    ).item()


@dataclass
class GAUCResult:
    value: float
    groups_used: int
    groups_skipped: int  # all-positive or all-negative groups, which have no AUC


def gauc(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor) -> GAUCResult:
    """Impression-weighted mean of per-group AUC over groups that have both classes."""
    s = scores.detach().reshape(-1).to(torch.float64)
    y = labels.detach().reshape(-1) > 0.5
    g = groups.detach().reshape(-1)
    # Sort by (group, score): stable sort by score, then stable sort by group.
    o1 = torch.argsort(s, stable=True)
    o2 = torch.argsort(g[o1], stable=True)
    order = o1[o2]
    gs, ss, ys = g[order], s[order], y[order]
    ranks = _avg_ranks([gs, ss])  # global positions, ties within a group averaged
    gchange = torch.ones_like(gs, dtype=torch.bool)
    gchange[1:] = gs[1:] != gs[:-1]
    gid = gchange.cumsum(0) - 1
    sizes = torch.bincount(gid).to(torch.float64)
    gstart = (sizes.cumsum(0) - sizes)[gid]  # positions before the group
    local = ranks - gstart
    ngroups = sizes.numel()
    npos = torch.zeros(ngroups, dtype=torch.float64, device=s.device).index_add_(
        0, gid, ys.to(torch.float64))
    rank_pos = torch.zeros(ngroups, dtype=torch.float64, device=s.device).index_add_(
        0, gid, torch.where(ys, local, torch.zeros_like(local)))
    nneg = sizes - npos
    ok = (npos > 0) & (nneg > 0)
    if not bool(ok.any()):
        return GAUCResult(math.nan, 0, ngroups)
    per = (rank_pos[ok] - npos[ok] * (npos[ok] + 1) / 2) / (npos[ok] * nneg[ok])
    w = sizes[ok]
    return GAUCResult((per * w).sum().item() / w.sum().item(), int(ok.sum()),
                      int(ngroups - ok.sum()))


class MetricAccumulator:
    """Collects logits / labels / groups on their device across batches (no host sync per
    batch); :meth:`compute` concatenates once and returns the metrics."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.groups: list[torch.Tensor] = []

    def update(self, logits: torch.Tensor, labels: torch.Tensor,
               group: torch.Tensor | None = None) -> None:
        self.logits.append(logits.detach().float())
        self.labels.append(labels.detach().float())
        if group is not None:
            self.groups.append(group.detach())

    def compute(self) -> dict[str, float]:
        if not self.logits:
            return {}
        z = torch.cat(self.logits)
        y = torch.cat(self.labels)
        out = {"auc": auc(z[:, 0], y[:, 0]), "logloss": logloss(z[:, 0], y[:, 0]),
               "rows": float(z.shape[0]), "ctr": y[:, 0].mean().item(),
               "pred_ctr": torch.sigmoid(z[:, 0].double()).mean().item()}
        if z.shape[1] > 1:
            for t in range(z.shape[1]):
                out[f"auc_{t}"] = auc(z[:, t], y[:, t])
                out[f"logloss_{t}"] = logloss(z[:, t], y[:, t])
        if self.groups:
            g = torch.cat(self.groups)
            r = gauc(z[:, 0], y[:, 0], g)
            out.update(gauc=r.value, gauc_groups=float(r.groups_used),
                       gauc_skipped=float(r.groups_skipped))
            rank = grouped_ranking_metrics(z[:, 0], y[:, 0], g, RANKING_K)
            out.update({k: v for k, v in rank.items()
                        if k.startswith(("hitrate@", "ndcg@", "mrr", "candidates_per"))})
        return out


RANKING_K = 10  # the cutoff of the per-group ranking metrics of a CTR model
# the cut-offs a next-item model's evaluation reports besides its own k
NEXT_ITEM_CUTOFFS = (5, 10, 20)


def metric_names(kind: str, k: int | None = None, grouped: bool = False) -> list[str]:
    """The validation metrics a model of task ``kind`` reports, any of which early stopping
    and ``sampan tune`` may follow: ``k`` is a retrieval or next-item model's cut-off;
    ``grouped``, whether the data has a group column (``features.group``: a binary model's
    GAUC and per-group ranking metrics).

    >>> metric_names("retrieval", k=50)
    ['recall@50', 'hitrate@50', 'ndcg@50', 'mrr']
    """
    if kind == "retrieval":
        return [f"{m}@{k}" for m in ("recall", "hitrate", "ndcg")] + ["mrr"]
    if kind == "next_item":
        return [f"{m}@{c}" for c in sorted({*NEXT_ITEM_CUTOFFS, k or 10})
                for m in ("hitrate", "ndcg")] + ["mrr"]
    ranking = [f"hitrate@{RANKING_K}", f"ndcg@{RANKING_K}", "mrr"]
    return ["auc", "logloss", *(["gauc", *ranking] if grouped else [])]


def grouped_ranking_metrics(scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor,
                            k: int) -> dict[str, float]:
    """:func:`ranking_metrics` of a CTR model's rows, each group (``features.group``, e.g.
    the user) a query whose candidates are its rows and whose relevant items are its
    positives: mean over groups with a positive of Recall@K, HitRate@K, NDCG@K and MRR.
    Ties rank pessimistically (an item ranks below every item of its group with an equal
    score). No loop over groups: one sort of ``(group, score)`` keys.

    >>> s = torch.tensor([0.9, 0.8, 0.1, 0.2, 0.9, 0.5])
    >>> y = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    >>> g = torch.tensor([7, 7, 7, 3, 3, 3])
    >>> m = grouped_ranking_metrics(s, y, g, k=2)
    >>> {k: round(v, 4) for k, v in m.items() if k != "candidates_per_query"}
    {'recall@2': 0.5, 'hitrate@2': 0.5, 'ndcg@2': 0.3155, 'mrr': 0.4167, 'queries': 2.0}
    >>> m["candidates_per_query"]  # rows per group ranked: 3 (a ranking of 3 items)
    3.0
    """
    s = scores.detach().reshape(-1).to(torch.float64)
    rel = labels.detach().reshape(-1) > 0.5
    _, gid = torch.unique(groups.detach().reshape(-1), return_inverse=True)
    uniq_s, srank = torch.unique(s, return_inverse=True)
    key = gid * (len(uniq_s) + 1) + srank  # sorts by group, then score
    sorted_key = torch.sort(key).values
    ngroups = int(gid.max()) + 1 if len(gid) else 0
    sizes = torch.bincount(gid, minlength=ngroups)
    ends = sizes.cumsum(0)
    # 1-based rank: the rows of the group that score at least as high (itself included)
    rank = (ends[gid] - torch.searchsorted(sorted_key, key, right=False)).to(torch.float64)
    n_rel = torch.zeros(ngroups, dtype=torch.float64).index_add_(0, gid, rel.double())
    has = n_rel > 0
    if not bool(has.any()):
        return {f"recall@{k}": math.nan, f"hitrate@{k}": math.nan, f"ndcg@{k}": math.nan,
                "mrr": math.nan, "queries": 0.0}
    in_k = rel & (rank <= k)
    hits = torch.zeros(ngroups, dtype=torch.float64).index_add_(0, gid, in_k.double())
    dcg = torch.zeros(ngroups, dtype=torch.float64).index_add_(
        0, gid, torch.where(in_k, 1.0 / torch.log2(rank + 1.0), torch.zeros_like(rank)))
    discounts = (1.0 / torch.log2(torch.arange(2, k + 2, dtype=torch.float64))).cumsum(0)
    idcg = discounts[(torch.clamp(n_rel[has], max=k) - 1).long()]
    first = torch.full((ngroups,), math.inf, dtype=torch.float64).scatter_reduce_(
        0, gid[rel], rank[rel], reduce="amin")
    return {f"recall@{k}": (hits[has] / n_rel[has]).mean().item(),
            f"hitrate@{k}": (hits[has] > 0).double().mean().item(),
            f"ndcg@{k}": (dcg[has] / idcg).mean().item(),
            "mrr": (1.0 / first[has]).mean().item(), "queries": float(has.sum()),
            "candidates_per_query": sizes[has].double().mean().item()}


# ---------------------------------------------------------------- top-K ranking metrics
def ranks_of_relevant(scores: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
                      ) -> torch.Tensor:
    """1-based rank of each relevant item ``(rows[j], cols[j])`` in its row: the number of
    items scoring at least as high, itself included (ties rank pessimistically). No sort:
    one comparison of the item's row with its score, so the cost is the relevant items
    times the row length, not every item's rank. A NaN score ranks pessimistically too: a
    NaN competitor counts as scoring higher, a NaN relevant item ranks last."""
    own = scores[rows, cols]
    nan = bool(torch.isnan(scores).any())
    ranks = torch.empty(len(rows), dtype=torch.int64, device=scores.device)
    step = max(1, (1 << 20) // max(scores.shape[1], 1))  # a block of rows that stays in cache
    for lo in range(0, len(rows), step):
        hi = min(lo + step, len(rows))
        block = scores[rows[lo:hi]]
        above = block >= own[lo:hi, None]
        if nan:
            above |= torch.isnan(block)
        ranks[lo:hi] = torch.count_nonzero(above, dim=1)
    if nan:
        ranks[torch.isnan(own)] = scores.shape[1]
    return ranks


def ranking_metrics(scores: torch.Tensor, relevant: torch.Tensor, k: int | tuple[int, ...],
                    n_relevant: torch.Tensor | None = None) -> dict[str, float]:
    """Mean over queries of Recall@K, HitRate@K, NDCG@K (binary gains) and MRR; ``k`` may
    be several cut-offs (the items are ranked once).

    ``scores [Q, N]`` ranks each query's ``N`` candidates; ``relevant [Q, N]`` marks the
    relevant ones. Queries without a relevant item are skipped. Ties rank pessimistically.
    ``n_relevant [Q]`` counts relevant items that are not among the candidates too (items
    a retrieval model cannot return, e.g. never seen in training): they are misses, so they
    enter Recall's and the ideal DCG's denominators, and such queries are not skipped.

    >>> s = torch.tensor([[0.9, 0.8, 0.1], [0.2, 0.9, 0.5]])
    >>> r = torch.tensor([[False, True, False], [True, False, False]])
    >>> {k: round(v, 4) for k, v in ranking_metrics(s, r, k=2).items()}
    {'recall@2': 0.5, 'hitrate@2': 0.5, 'ndcg@2': 0.3155, 'mrr': 0.4167, 'queries': 2.0}
    """
    rows, cols = relevant.bool().nonzero(as_tuple=True)
    return metrics_of_ranks(ranks_of_relevant(scores, rows, cols), rows, len(relevant), k,
                            n_relevant)


def metrics_of_ranks(ranks: torch.Tensor, rows: torch.Tensor, n_queries: int,
                     k: int | tuple[int, ...], n_relevant: torch.Tensor | None = None
                     ) -> dict[str, float]:
    """:func:`ranking_metrics` from the 1-based ``ranks`` of the relevant items (0: not
    among the candidates) and their queries ``rows`` (each item once): for a caller that
    knows the ranks without a ``[Q, N]`` score matrix (items ranked by one score for every
    query, such as their popularity)."""
    names, per_query, _ = query_metrics_of_ranks(ranks, rows, n_queries, k, n_relevant)
    if not len(per_query):
        return {**{n: math.nan for n in names}, "queries": 0.0}
    means = per_query.mean(0).tolist()
    return {**dict(zip(names, means, strict=True)), "queries": float(len(per_query))}


def query_metrics_of_ranks(ranks: torch.Tensor, rows: torch.Tensor, n_queries: int,
                           k: int | tuple[int, ...], n_relevant: torch.Tensor | None = None
                           ) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Each query's Recall@K, HitRate@K, NDCG@K and reciprocal rank, as
    :func:`metrics_of_ranks` takes them: ``(names, [Q', metrics] float64, has [n_queries])``
    for the ``Q'`` queries with a relevant item (``has``); their means are its values, so
    two models' rows can be compared query by query (a paired bootstrap)."""
    ks = (k,) if isinstance(k, int) else tuple(k)
    names = [f"{m}@{c}" for c in ks for m in ("recall", "hitrate", "ndcg")] + ["mrr"]
    total = torch.bincount(rows, minlength=n_queries)
    if n_relevant is not None:
        total = torch.maximum(n_relevant.to(total.device), total)
    has = total > 0
    if not bool(has.any()):
        return names, torch.zeros(0, len(names), dtype=torch.float64), has
    ranks = ranks.to(torch.float64)
    rows = (torch.cumsum(has, 0) - 1)[rows]  # the query's place among those with an item
    total = total[has]
    q, n_rel = len(total), total.to(torch.float64)
    cols = []
    for c in ks:
        in_k = (ranks > 0) & (ranks <= c)
        hits = torch.bincount(rows, weights=in_k.to(torch.float64), minlength=q)
        dcg = torch.bincount(rows, weights=torch.where(in_k, 1.0 / torch.log2(ranks + 1.0),
                                                       0.0), minlength=q)
        idcg = (1.0 / torch.log2(torch.arange(2, c + 2, dtype=torch.float64,
                                              device=ranks.device))).cumsum(0)[
            torch.clamp(n_rel, max=c).long() - 1]
        cols += [hits / n_rel, (hits > 0).to(torch.float64), dcg / idcg]
    first = torch.full((q,), math.inf, dtype=torch.float64, device=ranks.device).scatter_reduce(
        0, rows, torch.where(ranks > 0, ranks, math.inf), "amin")
    return names, torch.stack([*cols, 1.0 / first], 1), has
