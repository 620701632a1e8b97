"""Next-item recommendation: from a user's item history, the next item, ranked against the
whole catalogue.

**Rows.** Each row holds a history (a ``kind: sequence`` list, most recent last) and the
item that came next (the model's ``target`` feature): what ``sampan data build-sequences``
writes, one row per event. With ``split: {method: leave_one_out}`` each user's last event
is its test row (its history: everything before it), the one before it validation.

**Training.** A row's history followed by its item is a sequence whose every position is
a training example: the state after position ``t`` predicts item ``t + 1`` (causal
attention keeps it from looking ahead). When the data has ``features.group`` (the user),
only each user's longest training row is trained on: its positions already hold every
shorter row's example. Losses (the model's ``loss``): ``full`` softmax over the catalogue;
``sampled`` softmax over the next item and ``negatives`` items drawn uniformly for the batch
(a uniform draw needs no logQ correction: it shifts every logit alike); ``bce``, the SASRec
paper's loss against one drawn item per position.

**Evaluation.** Full ranking: each row's state is scored against every item of the
catalogue in one matrix product per block of rows, and the rank of the row's item is the
number of items scoring at least as high (ties rank pessimistically), with no sort. Padding
and the OOV id never rank; an item unseen in training (OOV) is a miss. Reported: HitRate@K,
NDCG@K for K in 5, 10, 20 and the model's ``k``, MRR, and the same for a popularity ranking
(``pop_*``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sampan.data.store import SplitArrays
from sampan.metrics import NEXT_ITEM_CUTOFFS

CUTOFFS = NEXT_ITEM_CUTOFFS


def rank_metrics(ranks: np.ndarray, cutoffs: tuple[int, ...]) -> dict[str, float]:
    """HitRate@K, NDCG@K (one relevant item per query) and MRR of 1-based ``ranks`` (inf:
    a miss).

    >>> {k: round(v, 4) for k, v in rank_metrics(np.array([1, 3, np.inf]), (2,)).items()}
    {'hitrate@2': 0.3333, 'ndcg@2': 0.3333, 'mrr': 0.4444}
    """
    r = np.asarray(ranks, np.float64)
    out: dict[str, float] = {}
    for k in cutoffs:
        hit = r <= k
        out[f"hitrate@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(np.minimum(r, 1e18) + 1.0),
                                          0.0).mean())
    out["mrr"] = float((1.0 / r).mean())
    return out


def per_query_metrics(ranks: np.ndarray, cutoffs: tuple[int, ...]
                      ) -> tuple[list[str], np.ndarray]:
    """Each query's HitRate@K, NDCG@K and reciprocal rank ``[Q, metrics]``, named as
    :func:`rank_metrics` names them (their means are its values)."""
    r = np.asarray(ranks, np.float64)
    names = list(rank_metrics(np.ones(1), cutoffs))
    per_query = np.stack([
        *[col for k in cutoffs for col in ((r <= k).astype(np.float64),
                                           np.where(r <= k, 1.0 / np.log2(
                                               np.minimum(r, 1e18) + 1.0), 0.0))],
        1.0 / r], axis=1)
    return names, per_query


def _resampled_means(per_query: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, metrics]``: the metrics' means over queries drawn with replacement
    (the same draws for every column: paired when the columns are differences)."""
    rng = np.random.default_rng(seed)
    means = []
    for lo in range(0, resamples, 64):  # bounded memory: 64 resamples at a time
        idx = rng.integers(0, len(per_query), (min(64, resamples - lo), len(per_query)))
        means.append(per_query[idx].mean(axis=1))
    return np.concatenate(means)


def rank_bootstrap(ranks: np.ndarray, cutoffs: tuple[int, ...], resamples: int,
                   seed: int = 0) -> dict[str, list[float]]:
    """95 % bootstrap intervals of :func:`rank_metrics` over the queries (each query is a
    user under a leave-one-out split): ``{"ndcg@10_ci95": [lo, hi], ...}``."""
    if not len(ranks):
        return {}
    return query_bootstrap(*per_query_metrics(ranks, cutoffs), resamples, seed)


def query_bootstrap(names: list[str], per_query: np.ndarray, resamples: int,
                    seed: int = 0) -> dict[str, list[float]]:
    """95 % bootstrap intervals of the means of per-query metrics ``[Q, metrics]`` over
    the queries: ``{"<name>_ci95": [lo, hi], ...}`` (none without a query)."""
    if not len(per_query):
        return {}
    lo, hi = np.quantile(_resampled_means(per_query, resamples, seed), [0.025, 0.975], axis=0)
    return {f"{n}_ci95": [float(a), float(b)] for n, a, b in zip(names, lo, hi, strict=True)}


def paired_rank_comparison(ranks_a: np.ndarray, ranks_b: np.ndarray,
                           cutoffs: tuple[int, ...], resamples: int, seed: int = 0
                           ) -> dict[str, dict[str, Any]]:
    """Two models' ranks of the same queries: :func:`paired_query_comparison` of their
    :func:`per_query_metrics`."""
    names, qa = per_query_metrics(ranks_a, cutoffs)
    _, qb = per_query_metrics(ranks_b, cutoffs)
    return paired_query_comparison(names, qa, qb, resamples, seed)


def paired_query_comparison(names: list[str], qa: np.ndarray, qb: np.ndarray,
                            resamples: int, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Two models' per-query metrics ``[Q, metrics]`` on the same queries (row for row):
    per metric, both means, ``diff`` (b - a), its 95 % paired bootstrap interval (the same
    resampled queries for both) and ``p_b_better``, the share of resamples where b is
    ahead."""
    d = _resampled_means(qb - qa, resamples, seed)
    lo, hi = np.quantile(d, [0.025, 0.975], axis=0)
    return {n: {"a": float(qa[:, j].mean()), "b": float(qb[:, j].mean()),
                "diff": float(qb[:, j].mean() - qa[:, j].mean()),
                "diff_ci95": [float(lo[j]), float(hi[j])],
                "p_b_better": float((d[:, j] > 0).mean())} for j, n in enumerate(names)}


class NextItemTask:
    """Needs from the model: ``encode(seq) -> [B, L, D]``, ``user_state(batch) -> [B, D]``,
    ``item_vectors(ids=None) -> [N, D]``, ``history``, ``target_column``,
    ``item_cardinality``, ``loss_kind``, ``negatives``, ``k``, ``exclude_history``."""

    name = "next_item"
    # early_stopping.patience auto, in epochs: HSTU on the first 3,000 Toys users stalls
    # at NDCG@10 0.009 from epoch 3 to 7, then climbs to 0.027 by epoch 28 (2 epochs, the
    # binary tasks' patience, stopped it in the stall); RecBole stops after 10 as well
    patience_epochs = 10

    def __init__(self, model: nn.Module, train: SplitArrays):
        self.k = int(model.k)
        self.default_metric = f"ndcg@{self.k}"
        self.cutoffs = tuple(sorted({*CUTOFFS, self.k}))
        self.history, self.target = model.history, model.target_column
        self.n_items = int(model.item_cardinality)
        self.loss_kind, self.negatives = model.loss_kind, int(model.negatives)
        self.exclude_history = bool(model.exclude_history)
        self.last_ranks: np.ndarray | None = None
        self.temperature = (1.0 / float(model.scale) ** 2) if getattr(model, "cosine", False) \
            else None
        pos = train.positive_rows()
        items = np.asarray(train.sparse[pos, self.target]) if len(train) else np.zeros(0, int)
        self.popularity = np.bincount(items, minlength=self.n_items).astype(np.float64)

    def describe(self) -> str:
        how = {"full": f"softmax over all {self.n_items - 2:,} items",
               "sampled": f"sampled softmax over {self.negatives} uniform negatives",
               "bce": "binary cross-entropy against one uniform negative"}[self.loss_kind]
        return f"next-item loss: {how}; ranking every item for HitRate / NDCG@{self.k}, MRR"

    def reference_loss(self, train: SplitArrays, batch_size: int) -> float:
        """The loss of a model that knows nothing (uniform scores); with cosine / T
        scoring, plus the 1 / T a logit may be off by (the loss is bounded, and a model
        that has learned little can sit well above the uniform one)."""
        spread = 1.0 / self.temperature if self.temperature else 0.0
        if self.loss_kind == "full":
            return math.log(max(self.n_items - 2, 2)) + spread
        if self.loss_kind == "sampled":
            return math.log(self.negatives + 1) + spread
        return 2 * math.log(2) + spread

    def init_output_bias(self, model: nn.Module, train: Any, device: Any) -> str | None:
        return None  # a softmax over items has no base rate

    def training_rows(self, train: SplitArrays) -> SplitArrays:
        """Positive rows; with groups (users), each user's longest history only (its
        positions hold every shorter row's example)."""
        pos = train.positive_rows()
        if train.group is None or not len(pos):
            return train if len(pos) == len(train) else train.take(pos)
        hist = np.asarray(train.sequences[self.history])[pos]
        length = (hist != 0).sum(axis=1)
        group = np.asarray(train.group)[pos]
        # per group the longest row, the last of equals (file order is time order)
        order = np.lexsort((pos, length, group))
        last = np.append(group[order][1:] != group[order][:-1], True)
        return train.take(np.sort(pos[order[last]]))

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        states, wanted = self._positions(model, batch.sequences[self.history],
                                         batch.sparse[:, self.target])
        if self.loss_kind == "full":
            logits = states @ model.item_vectors().float().T
            logits[:, :2] = float("-inf")  # padding and OOV are never the next item
            return F.cross_entropy(logits, wanted)
        if self.loss_kind == "sampled":
            negs = torch.randint(2, max(self.n_items, 3), (self.negatives,),
                                 device=wanted.device)
            vec = model.item_vectors(torch.cat([wanted, negs])).float()
            pos_logit = (states * vec[:len(wanted)]).sum(-1, keepdim=True)
            neg_logit = states @ vec[len(wanted):].T
            neg_logit = neg_logit.masked_fill(negs.unsqueeze(0) == wanted.unsqueeze(1),
                                              float("-inf"))  # a draw of the item itself
            logits = torch.cat([pos_logit, neg_logit], dim=1)
            return F.cross_entropy(logits, torch.zeros(len(wanted), dtype=torch.long,
                                                       device=logits.device))
        negs = torch.randint(2, max(self.n_items, 3), (len(wanted),), device=wanted.device)
        vec = model.item_vectors(torch.cat([wanted, negs])).float()
        pos_logit = (states * vec[:len(wanted)]).sum(-1)
        neg_logit = (states * vec[len(wanted):]).sum(-1)
        return F.binary_cross_entropy_with_logits(pos_logit, torch.ones_like(pos_logit)) + \
            F.binary_cross_entropy_with_logits(neg_logit, torch.zeros_like(neg_logit))

    BLOCK = 64  # training rows encoded together, cut to their longest history

    def _positions(self, model: nn.Module, hist: torch.Tensor, target: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The state after every history position that has a known next item ``[P, D]``,
        and that item ``[P]``. Rows go through the model in blocks of similar length, each
        cut to its longest history (leading padding changes no real position's state)."""
        nxt = torch.cat([hist[:, 1:], target.unsqueeze(1)], dim=1)  # item after each position
        mask = (hist != 0) & (nxt >= 2)  # an item in, a known item to predict
        if not bool(mask.any()):  # no history anywhere: predict from the empty state
            mask = torch.zeros_like(mask)
            mask[:, -1] = target >= 2
        # histories are left-padded (the real items last); a row with nothing to predict
        # is left out, one with no history keeps its last (empty) position
        lengths = torch.where(mask.any(dim=1), (hist != 0).sum(dim=1).clamp_min(1), 0)
        order = torch.argsort(lengths)
        states, wanted = [], []
        for lo in range(0, len(hist), self.BLOCK):
            rows = order[lo:lo + self.BLOCK]
            keep = int(lengths[rows].max())
            if keep == 0:
                continue
            m = mask[rows, -keep:]
            states.append(model.encode(hist[rows, -keep:]).float()[m])
            wanted.append(nxt[rows, -keep:][m])
        return torch.cat(states), torch.cat(wanted)

    # ----------------------------------------------------------------- evaluation
    @torch.no_grad()
    def ranks(self, model: nn.Module, data: SplitArrays,
              infer: Callable[[Callable, Any], torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """The 1-based rank of each positive row's item among every item, for the model and
        for popularity (inf: an item unseen in training)."""
        pos = data.positive_rows()
        if not len(pos):
            return np.zeros(0), np.zeros(0)
        rows = data.take(pos)
        states = infer(model.user_state, rows).float()
        was = model.training
        model.eval()
        items = model.item_vectors().float().to(states.device)
        model.train(was)
        target = torch.from_numpy(np.asarray(rows.sparse[:, self.target])).to(states.device)
        hist = torch.from_numpy(np.asarray(rows.sequences[self.history])).to(states.device) \
            if self.exclude_history else None
        model_ranks = []
        step = max(1, (1 << 24) // max(self.n_items, 1))
        for lo in range(0, len(rows), step):
            hi = min(lo + step, len(rows))
            t = target[lo:hi].unsqueeze(1)
            scores = states[lo:hi] @ items.T
            scores[:, :2] = float("-inf")
            if hist is not None:
                mine = scores.gather(1, t)
                scores.scatter_(1, hist[lo:hi], float("-inf"))
                scores.scatter_(1, t, mine)
                scores[:, :2] = float("-inf")
            own = scores.gather(1, t)
            rank = (scores >= own).sum(dim=1).double()
            rank[(t.squeeze(1) < 2) | ~torch.isfinite(own.squeeze(1))] = math.inf
            model_ranks.append(rank.cpu())
        return torch.cat(model_ranks).numpy(), self._popularity_ranks(
            np.asarray(rows.sparse[:, self.target]),
            np.asarray(rows.sequences[self.history]) if self.exclude_history else None)

    def _popularity_ranks(self, target: np.ndarray, hist: np.ndarray | None) -> np.ndarray:
        """Ranks under popularity (the training count of each item): the same order for
        every query, so one rank per item, less the history items above it when the
        history is excluded."""
        pop = self.popularity.copy()
        pop[:2] = -1.0  # padding and OOV never rank
        # items scoring at least as high as each item (itself included)
        above = len(pop) - np.searchsorted(np.sort(pop), pop, side="left")
        rank = above[target].astype(np.float64)
        if hist is not None:
            h = np.sort(hist, axis=1)
            first = np.ones_like(h, dtype=bool)
            first[:, 1:] = h[:, 1:] != h[:, :-1]  # each history item once
            out = first & (h >= 2) & (h != target[:, None]) & \
                (pop[h] >= pop[target][:, None])
            rank -= out.sum(axis=1)
        rank[target < 2] = math.inf
        return rank

    def evaluate(self, model: nn.Module, data: SplitArrays,
                 infer: Callable[[Callable, Any], torch.Tensor]) -> dict[str, float]:
        mine, pop = self.ranks(model, data, infer)
        self.last_ranks = mine  # for intervals (sampan eval --bootstrap)
        out: dict[str, float] = {"rows": float(len(data)), "queries": float(len(mine))}
        if not len(mine):
            return out
        out.update(rank_metrics(mine, self.cutoffs))
        out.update({f"pop_{k}": v for k, v in rank_metrics(pop, self.cutoffs).items()})
        out["unknown_item_rows"] = float(np.isinf(mine).sum())
        return out
