"""Retrieval (candidate generation) for two-tower models.

**Training**: each batch holds positive (user, item) rows; every row's item is the positive
of its user and the other items of the batch are its negatives (in-batch sampled softmax;
under data parallelism, the items of the whole global batch, gathered from every rank).
Popular items appear as negatives more often than a uniform sample would draw them, which
biases scores against them; the logQ correction (Yi et al., 2019) subtracts ``log q(item)``,
the item's share of the training positives, from each logit. In-batch copies of a row's own
positive ("accidental hits") are masked out.

**Evaluation**: one query per user of the evaluated split, whose relevant items are the
items of that user's positive rows there. The user's vector is scored against every item of
the corpus (the distinct items of the train split); items the user already had in training
are excluded (``exclude_seen``). Reported: Recall@K, NDCG@K, HitRate@K, MRR, and the same
figures for a popularity baseline (items ranked by their training positives), ``pop_*``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sampan import distributed
from sampan.data.store import SplitArrays
from sampan.embedding.collection import EmbeddingCollection
from sampan.metrics import metrics_of_ranks, query_metrics_of_ranks, ranks_of_relevant


def _csr(keys: np.ndarray, values: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets [n_keys + 1], values sorted by key)``: values of key ``k`` are
    ``sorted[offsets[k]:offsets[k + 1]]``."""
    order = np.argsort(keys, kind="stable")
    offsets = np.zeros(n_keys + 1, np.int64)
    np.cumsum(np.bincount(keys, minlength=n_keys), out=offsets[1:])
    return offsets, values[order]


def _gather_ranges(offsets: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``keys`` its CSR range: ``(row of each element, element index)``."""
    starts, ends = offsets[keys], offsets[keys + 1]
    lens = ends - starts
    rows = np.repeat(np.arange(len(keys)), lens)
    first = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return rows, first + np.arange(int(lens.sum()))


class RetrievalTask:
    """In-batch softmax with logQ correction; Recall@K over the item corpus.

    Needs from the model: ``user_vectors(batch)``, ``item_vectors(batch)`` (``[B, d]``) and
    ``vectors(batch)`` (both from one lookup),
    ``item_column`` / ``user_column`` (columns of ``Batch.sparse``), ``temperature``,
    ``logq_correction``, ``k`` and ``exclude_seen``.
    """

    name = "retrieval"

    def reference_loss(self, train: SplitArrays, batch_size: int) -> float:
        """The in-batch softmax loss of a model that knows nothing: ``ln(batch)``."""
        return math.log(max(batch_size, 2))

    def init_output_bias(self, model: nn.Module, train: SplitArrays, device: Any) -> str | None:
        return None  # a softmax over items has no base rate

    def __init__(self, model: nn.Module, train: SplitArrays):
        self.k = int(model.k)
        self.cutoffs: tuple[int, ...] = (self.k,)  # sampan eval --ranking adds others
        self.default_metric = f"recall@{self.k}"
        self.exclude_seen = bool(model.exclude_seen)
        self.temperature = float(model.temperature)
        self.logq = bool(model.logq_correction)
        self.item_col, self.user_col = model.item_column, model.user_column
        items = np.asarray(train.sparse[:, self.item_col])
        users = np.asarray(train.sparse[:, self.user_col])
        self.n_items = int(model.item_cardinality)
        pos = train.positive_rows()
        counts = np.bincount(items[pos], minlength=self.n_items).astype(np.float64)
        self.popularity = counts
        q = counts / max(counts.sum(), 1.0)
        self.log_q = torch.from_numpy(np.log(np.maximum(q, 1e-12))).float()
        # the corpus: every real item id of the train split (0 = padding, 1 = OOV excluded)
        ids, first = np.unique(items, return_index=True)
        keep = ids >= 2
        self.corpus_ids, self.corpus_rows = ids[keep], train.take(first[keep])
        self.corpus_pos = np.full(self.n_items, -1, np.int64)
        self.corpus_pos[self.corpus_ids] = np.arange(len(self.corpus_ids))
        # the items each train user had, by the user's value (a row id, or the key of a
        # dynamic table); the last, empty range is every user the train split lacks
        self.seen_users, at = np.unique(users, return_inverse=True)
        self.seen = _csr(at.reshape(-1), items, len(self.seen_users) + 1)
        schema = getattr(model, "schema", None)
        self.user_table = schema.sparse[self.user_col].name if schema is not None and \
            schema.sparse[self.user_col].dynamic is not None else None

    def training_rows(self, train: SplitArrays) -> SplitArrays:
        """Only positive rows are trained on (the negatives come from the batch)."""
        pos = train.positive_rows()
        self.trained, self.left_out = len(pos), len(train) - len(pos)
        return train if len(pos) == len(train) else train.take(pos)

    def describe(self) -> str:
        """The run header's line: what trains, and what was left out."""
        line = (f"retrieval: in-batch softmax{' with logQ correction' if self.logq else ''} "
                f"at temperature {self.temperature:g}; Recall / NDCG / HitRate@{self.k} and "
                "MRR over the item corpus")
        if getattr(self, "left_out", 0):
            line += (f"; trains on the {self.trained:,} rows with label 1 and leaves out "
                     f"{self.left_out:,} rows with label 0 (the batch's other items are the "
                     "negatives)")
        return line

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        u, v = model.vectors(batch)
        u, v = u.float(), v.float()
        ids = batch.sparse[:, self.item_col]
        # Under data parallelism the negatives are the items of the whole global batch (as
        # in one process): every rank's item vectors, gradients flowing back to their rank.
        v_all, lo = distributed.gather_rows_with_grad(v)
        ids_all = distributed.all_gather_rows(ids)
        logits = u @ v_all.T / self.temperature
        if self.logq:
            logits = logits - self.log_q.to(logits.device)[ids_all].unsqueeze(0)
        target = torch.arange(len(ids), device=logits.device) + lo
        hit = ids.unsqueeze(1) == ids_all.unsqueeze(0)
        hit[torch.arange(len(ids), device=hit.device), target] = False
        logits = logits.masked_fill(hit, float("-inf"))
        return F.cross_entropy(logits, target)

    def _known_users(self, model: nn.Module, users: np.ndarray) -> np.ndarray:
        """Which ``users`` have rows of their own: fitted ids from 2 on, or the keys a
        dynamic user table holds now."""
        if self.user_table is None:
            return users >= 2
        coll = next(m for m in model.modules()
                    if isinstance(m, EmbeddingCollection) and self.user_table in m.dynamic_names)
        rows = coll.find_keys(self.user_table, torch.from_numpy(users))
        return rows.cpu().numpy() > 0

    def _seen_index(self, users: np.ndarray) -> np.ndarray:
        """Each user's range in ``self.seen`` (the empty last one for users not in train)."""
        n = len(self.seen_users)
        if not n:
            return np.zeros(len(users), np.int64)
        at = np.minimum(np.searchsorted(self.seen_users, users), n - 1)
        return np.where(self.seen_users[at] == users, at, n)

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, model: nn.Module, data: SplitArrays,
                 infer: Callable[[Callable, Any], torch.Tensor]) -> dict[str, float]:
        out, _, chunks = self._rank_queries(model, data, infer)
        if not chunks:
            return out
        for prefix, which in (("", 0), ("pop_", 1)):
            parts = [metrics_of_ranks(c[which], c[2], c[3], self.cutoffs, c[4]) for c in chunks]
            n = sum(p["queries"] for p in parts)
            for key in parts[0]:
                if key != "queries":
                    out[prefix + key] = float(sum(p[key] * p["queries"] for p in parts
                                                  if p["queries"]) / max(n, 1))
            if not which:
                out["queries"] = float(n)
        return out

    def query_metrics(self, model: nn.Module, data: SplitArrays,
                      infer: Callable[[Callable, Any], torch.Tensor],
                      cutoffs: tuple[int, ...] | None = None
                      ) -> tuple[np.ndarray, list[str], np.ndarray]:
        """Each query's metrics, the ones :meth:`evaluate` averages: ``(users [Q] (the
        user column's ids), names, [Q, metrics])``, for a paired comparison of two models
        on the same users."""
        _, q_users, chunks = self._rank_queries(model, data, infer)
        names, users, rows = [], [], []
        for ranks, _, r, n_q, n_rel, lo in chunks:
            names, per_query, has = query_metrics_of_ranks(ranks, r, n_q, cutoffs or self.cutoffs,
                                                           n_rel)
            users.append(q_users[lo:lo + n_q][has.numpy()])
            rows.append(per_query.numpy())
        if not rows:
            names = query_metrics_of_ranks(torch.zeros(0), torch.zeros(0, dtype=torch.long), 0,
                                           cutoffs or self.cutoffs)[0]
            return np.zeros(0, np.int64), names, np.zeros((0, len(names)))
        return np.concatenate(users), names, np.concatenate(rows)

    def _rank_queries(self, model: nn.Module, data: SplitArrays,
                      infer: Callable[[Callable, Any], torch.Tensor]
                      ) -> tuple[dict[str, float], np.ndarray, list[tuple[Any, ...]]]:
        """Rank every query's relevant items under the model and under popularity:
        ``(the counts evaluate reports, the query users, chunks)``, each chunk ``(model
        ranks, popularity ranks, query of each rank, queries, relevant items per query,
        first query)`` for the ``rows`` argument of :func:`~sampan.metrics.metrics_of_ranks`."""
        pos = data.positive_rows()
        users = np.asarray(data.sparse[pos, self.user_col])
        # users unknown to training (OOV id 1, or a dynamic table's key without a row: both
        # read a shared row) cannot be told apart: not queries
        query = self._known_users(model, users)
        out: dict[str, float] = {"rows": float(len(data)),
                                 "unknown_user_rows": float((~query).sum())}
        pos, users = pos[query], users[query]
        items = np.asarray(data.sparse[pos, self.item_col])
        if not len(pos):
            return out, np.zeros(0, np.int64), []
        q_users, first = np.unique(users, return_index=True)
        U = infer(model.user_vectors, data.take(pos[first])).float()
        V = infer(model.item_vectors, self.corpus_rows).float()
        # relevant items per query (distinct pairs), and how many of them exist at all
        pairs = np.unique(np.stack([np.searchsorted(q_users, users), items], 1), axis=0)
        rel_off, rel_items = _csr(pairs[:, 0], pairs[:, 1], len(q_users))
        n_rel = torch.from_numpy(np.diff(rel_off))
        # the popularity baseline ranks every query's items by one score: an item's rank is
        # the items at least as popular (ties pessimistic), less those excluded for the query
        pop = torch.from_numpy(np.log1p(self.popularity[self.corpus_ids])).float()
        pop_rank = len(pop) - torch.searchsorted(torch.sort(pop).values, pop)
        n_items = len(self.corpus_ids)
        chunks = []
        step = max(1, (1 << 24) // max(n_items, 1))
        for lo in range(0, len(q_users), step):
            hi = min(lo + step, len(q_users))
            r_rows, r_idx = _gather_ranges(rel_off, np.arange(lo, hi))
            cols = self.corpus_pos[rel_items[r_idx]]
            ok = cols >= 0
            rows, cols = r_rows[ok], cols[ok]  # relevant items among the candidates
            scores = U[lo:hi] @ V.T
            pop_ranks = pop_rank[torch.from_numpy(cols)]
            if self.exclude_seen:
                s_rows, s_idx = _gather_ranges(self.seen[0], self._seen_index(q_users[lo:hi]))
                ex = self.corpus_pos[self.seen[1][s_idx]]
                keep = ex >= 0
                # each (query, item) once (an item seen twice), relevant ones kept
                key = np.setdiff1d(s_rows[keep] * n_items + ex[keep], rows * n_items + cols)
                ex_rows, ex = key // n_items, key % n_items
                scores[torch.from_numpy(ex_rows), torch.from_numpy(ex)] = float("-inf")
                ex_off, ex_items = _csr(ex_rows, ex, hi - lo)
                which, idx = _gather_ranges(ex_off, rows)  # each relevant item's exclusions
                above = pop[torch.from_numpy(ex_items[idx])] >= pop[torch.from_numpy(
                    cols[which])]
                pop_ranks = pop_ranks - torch.bincount(torch.from_numpy(which),
                                                       weights=above.double(),
                                                       minlength=len(cols)).long()
            rows_t = torch.from_numpy(rows)
            ranks = ranks_of_relevant(scores, rows_t, torch.from_numpy(cols))
            chunks.append((ranks, pop_ranks, rows_t, hi - lo, n_rel[lo:hi], lo))
        return out, q_users, chunks
