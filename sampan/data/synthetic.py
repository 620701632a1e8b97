"""The built-in default dataset: Criteo-shaped rows whose labels come from a known model.

Columns match the Criteo preset: ``label``, ``I1..I13`` (non-negative counts, some missing),
``C1..C26`` (8-hex-digit tokens, Zipf-distributed, some missing), plus ``oracle_p``, the
true click probability of the row. The labelling model has first-order effects, pairwise
field interactions (factorised, as DeepFM assumes) and a non-linear numeric term, so a model
that learns interactions beats logistic regression, and the AUC of ``oracle_p`` on the test
split is the best any model can reach.

Everything is a pure function of ``SyntheticConfig`` (seed included): the same config gives
the same rows on every machine.

With ``drift`` d > 0 the rows are a stream: at position ``t`` (0 to 1, a column) the Zipf
ranks of field f start at id ``floor(d * t * vocab_f)``, so the popular ids move along, and
by the end ids are common that the first rows never held. Each id keeps its own effect (as
strong as when it is at the head), and ``oracle_p`` stays the true probability of each row.

With ``churn`` c > 0 ids come and go instead: each Zipf rank of a field is a slot whose
holder is replaced by a never-seen id c times over the stream (at times spread evenly over
the slots), as new items take over from retired ones. A new holder's effect is as strong as
its rank makes any id's (the head's strongest), so the head carries most of the signal as in
the stationary rows, and a model that learns new ids as they come can approach the oracle.
Under ``drift`` alone every id the head passes over is at rank 0 once, and so carries the
head's effect, but the largest fields show each id only a handful of times in all (200,000
rows: about 7 for a 30,000-id field): no model can learn most of that signal. ``drift`` and
``churn`` combine (the slots move along, and their holders are replaced).

>>> from sampan.config import SyntheticConfig
>>> t = next(iter_synthetic(SyntheticConfig(rows=5)))
>>> t.num_rows, t.column_names[:3]
(5, ['label', 'I1', 'I2'])
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sampan.config import SyntheticConfig

NUM_NUMERIC = 13
NUM_CATEGORICAL = 26
# Vocabulary sizes shaped like Criteo's (scaled down so a laptop learns them in a minute).
VOCAB_SIZES = [1400, 550, 30000, 12000, 300, 24, 8000, 600, 3, 20000, 4000, 25000, 3000,
               27, 7000, 22000, 10, 3500, 2000, 4, 24000, 18, 15, 9000, 100, 6000]
INFORMATIVE = [0, 1, 2, 3, 5, 6, 9, 10, 12, 14, 16, 18, 21, 23]
PAIRS = [(0, 5), (1, 9), (2, 13), (3, 16), (6, 21), (10, 23), (12, 24), (4, 18)]
CHUNK_ROWS = 65536
LATENT = 4
BIAS = -1.6


def stream_ids(vocab: int, drift: float, churn: float = 0.0) -> int:
    """Ids of a field of ``vocab`` ranks whose head moves ``drift * vocab`` ids along and
    whose slots' holders are replaced ``churn`` times."""
    return (vocab + int(np.ceil(drift * vocab))) * _generations(churn)


def _generations(churn: float) -> int:
    """Holders a slot has over the stream: generation ``floor(churn * t + phase)``."""
    return int(np.ceil(churn)) + 1


class _TruthModel:
    """Parameters of the labelling model, drawn once from the seed."""

    def __init__(self, seed: int, drift: float = 0.0, churn: float = 0.0):
        rng = np.random.default_rng([seed, 0])
        self.slots = [stream_ids(v, drift) for v in VOCAB_SIZES]
        self.generations = gens = _generations(churn)
        sizes = [s * gens for s in self.slots]
        # with churn, each slot's offset in [0, 1) of its generation clock (holder at t:
        # generation floor(churn * t + phase), id slot + slots * generation); its own
        # generator, so the rest of the model is as without
        self.phase = ([np.random.default_rng([seed, 2, f]).random(s)
                       for f, s in enumerate(self.slots)] if churn else [])

        # Effects shrink with an id's rarity, its slot's best rank over the rows (the head
        # carries most of the signal, as in real logs, so a model can approach the oracle
        # from a few hundred k rows); with drift every slot the head passes over is at rank
        # 0 once. Every holder of a slot shrinks alike.
        def shrink(f: int) -> np.ndarray:
            s = self.slots[f]
            best = np.maximum(0, np.arange(s) - (s - VOCAB_SIZES[f]))
            return np.tile(1.0 / np.sqrt(1.0 + best / 50.0), gens)

        self.w = [rng.normal(0, 0.7 if f in INFORMATIVE else 0.0, size=sizes[f]) * shrink(f)
                  for f in range(NUM_CATEGORICAL)]
        self.v = {f: rng.normal(0, 0.5, size=(sizes[f], LATENT)) * shrink(f)[:, None]
                  for pair in PAIRS for f in pair}
        self.beta = rng.normal(0, 0.25, size=NUM_NUMERIC) * (rng.random(NUM_NUMERIC) < 0.6)
        self.mu = rng.uniform(0.5, 3.0, size=NUM_NUMERIC)
        self.sigma = rng.uniform(0.5, 1.5, size=NUM_NUMERIC)
        # Rank -> token permutation per field so that frequent ids look arbitrary.
        self.tokens = []
        for f, v in enumerate(sizes):
            codes = (rng.permutation(v).astype(np.uint64) * np.uint64(2654435761)
                     + np.uint64(f * 7919)) % np.uint64(1 << 32)
            self.tokens.append(pa.array([f"{c:08x}" for c in codes.tolist()], pa.string()))

    def logit(self, ranks: np.ndarray, present: np.ndarray, x: np.ndarray) -> np.ndarray:
        """ids (``ranks``) / present ``[N, 26]``, x ``[N, 13]`` (0 where missing) -> true
        logits ``[N]``."""
        z = np.full(len(x), BIAS)
        for f in range(NUM_CATEGORICAL):
            z += np.where(present[:, f], self.w[f][ranks[:, f]], 0.0)
        for f, g in PAIRS:
            both = present[:, f] & present[:, g]
            z += np.where(both, (self.v[f][ranks[:, f]] * self.v[g][ranks[:, g]]).sum(1), 0.0)
        lx = (np.log1p(x) - self.mu) / self.sigma
        z += lx @ self.beta
        z += 0.6 * np.sin(2.0 * lx[:, 0]) * np.tanh(lx[:, 1])  # a non-linear numeric effect
        return z


def _zipf_ranks(rng: np.random.Generator, n: int, vocab: int, a: float) -> np.ndarray:
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -a
    cdf = np.cumsum(p / p.sum())
    return np.minimum(np.searchsorted(cdf, rng.random(n)), vocab - 1)


def iter_synthetic(cfg: SyntheticConfig) -> Iterator[pa.Table]:
    """Tables of up to 65,536 rows each; ``cfg.rows`` in all."""
    truth = _TruthModel(cfg.seed, cfg.drift, cfg.churn)
    for start in range(0, cfg.rows, CHUNK_ROWS):
        n = min(CHUNK_ROWS, cfg.rows - start)
        rng = np.random.default_rng([cfg.seed, 1, start // CHUNK_ROWS])
        ranks = np.stack([_zipf_ranks(rng, n, v, cfg.zipf_a) for v in VOCAB_SIZES], axis=1)
        t = (start + np.arange(n)) / max(cfg.rows - 1, 1)
        if cfg.drift:  # the head of each field moves along with the row's position
            ranks = ranks + np.floor(cfg.drift * t[:, None] * np.array(VOCAB_SIZES)).astype(
                np.int64)
        if cfg.churn:  # each slot's holder at t: generation floor(churn * t + its phase)
            for f, slots in enumerate(truth.slots):
                gen = np.floor(cfg.churn * t + truth.phase[f][ranks[:, f]]).astype(np.int64)
                gen = np.minimum(gen, truth.generations - 1)  # (float round-up at t = 1)
                ranks[:, f] += slots * gen
        present = rng.random((n, NUM_CATEGORICAL)) >= cfg.missing_rate * 0.5
        x = np.floor(np.exp(rng.normal(truth.mu, truth.sigma, size=(n, NUM_NUMERIC))) - 1)
        x = np.maximum(x, 0.0)
        x_missing = rng.random((n, NUM_NUMERIC)) < cfg.missing_rate
        x_obs = np.where(x_missing, 0.0, x)
        p = 1.0 / (1.0 + np.exp(-truth.logit(ranks, present, x_obs)))
        label = (rng.random(n) < p).astype(np.float64)
        cols: dict[str, pa.Array] = {"label": pa.array(label)}
        for j in range(NUM_NUMERIC):
            cols[f"I{j + 1}"] = pa.array(x[:, j], mask=x_missing[:, j])
        for f in range(NUM_CATEGORICAL):
            tok = truth.tokens[f].take(pa.array(ranks[:, f]))
            cols[f"C{f + 1}"] = pc.if_else(pa.array(present[:, f]), tok,
                                           pa.scalar(None, pa.string()))
        cols["oracle_p"] = pa.array(p)
        if cfg.drift or cfg.churn:
            cols["t"] = pa.array(t)
        yield pa.table(cols)


def behaviour_samples(rows: int, items: int = 2000, categories: int = 100,
                      max_len: int = 30, interests: tuple[int, int] = (2, 5),
                      seed: int = 0) -> pa.Table:
    """A sequence task whose signal lives only in the behaviour history.

    Each row's history (5 to ``max_len`` items, most recent last) is drawn from the user's
    interest categories (between ``interests[0]`` and ``interests[1]`` of them); the
    candidate item comes from one of them half of the time, otherwise from anywhere. The
    click probability is 0.75 when the candidate's category occurs in the history and 0.15
    otherwise, so a candidate is neither good nor bad on its own: only relating it to the
    history helps. Columns: ``label``, ``oracle_p``, ``user_id``
    (uninformative), ``item_id``, ``category_id``, and ``hist_item_id`` /
    ``hist_category_id`` as ``|``-joined strings.

    >>> t = behaviour_samples(4)
    >>> t.column_names
    ['label', 'oracle_p', 'user_id', 'item_id', 'category_id', 'hist_item_id', 'hist_category_id']
    """
    rng = np.random.default_rng(seed)
    item_cat = rng.integers(0, categories, items)
    order = np.argsort(item_cat, kind="stable")  # items grouped by category
    per_cat = np.bincount(item_cat, minlength=categories)
    start = np.concatenate([[0], np.cumsum(per_cat)[:-1]])

    def item_of(cat: np.ndarray) -> np.ndarray:  # a uniform item of each category
        pick = start[cat] + (rng.random(cat.shape) * per_cat[cat]).astype(np.int64)
        return np.where(per_cat[cat] > 0, order[np.minimum(pick, items - 1)], 0)

    lengths = rng.integers(5, max_len + 1, rows)
    lo, hi = min(interests[0], categories), min(interests[1], categories)
    n_interest = rng.integers(lo, hi + 1, rows)
    chosen = np.argsort(rng.random((rows, categories)), axis=1)[:, :hi]
    slot = (rng.random((rows, max_len)) * n_interest[:, None]).astype(np.int64)
    hist = item_of(np.take_along_axis(chosen, slot, axis=1))  # [rows, max_len]
    real = np.arange(max_len) < lengths[:, None]
    own = np.take_along_axis(chosen, (rng.random(rows) * n_interest).astype(np.int64)[:, None],
                             axis=1)[:, 0]
    target = np.where(rng.random(rows) < 0.5, item_of(own), rng.integers(0, items, rows))
    matched = ((item_cat[hist] == item_cat[target][:, None]) & real).any(axis=1)
    p = np.where(matched, 0.75, 0.15)
    label = (rng.random(rows) < p).astype(np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

    def tokens(prefix: str, ids: np.ndarray) -> pa.Array:
        return pc.binary_join_element_wise(prefix, pc.cast(pa.array(ids), pa.string()), "")

    def joined(prefix: str, ids: np.ndarray) -> pa.Array:
        lists = pa.ListArray.from_arrays(offsets, tokens(prefix, ids[real]))
        return pc.binary_join(lists, "|")

    return pa.table({"label": label, "oracle_p": p,
                     "user_id": tokens("u", rng.integers(0, 500, rows)),
                     "item_id": tokens("i", target),
                     "category_id": tokens("c", item_cat[target]),
                     "hist_item_id": joined("i", hist),
                     "hist_category_id": joined("c", item_cat[hist])})


def interaction_samples(users: int = 1000, items: int = 2000, categories: int = 40,
                        per_user: int = 30, seed: int = 0) -> pa.Table:
    """Implicit feedback for retrieval: each user likes 1 to 3 item categories and picks
    80 % of their items from them, the rest from the whole catalogue; within a pool items
    are drawn by a Zipf-like popularity. Popularity alone is a real baseline, knowing the
    user's categories beats it. Columns: ``label`` (all 1), ``user_id``, ``item_id``,
    ``category_id``, ``timestamp`` (the order of each user's picks).

    >>> interaction_samples(users=3, per_user=2).num_rows
    6
    """
    rng = np.random.default_rng(seed)
    item_cat = rng.integers(0, categories, items)
    weight = 1.0 / np.arange(1, items + 1) ** 0.8  # popularity, item 0 most popular
    n = users * per_user
    user = np.repeat(np.arange(users), per_user)
    liked = np.argsort(rng.random((users, categories)), axis=1)[:, :3]
    n_liked = rng.integers(1, 4, users)
    cat = liked[user, (rng.random(n) * n_liked[user]).astype(np.int64)]
    # popularity-weighted pick inside each category through per-category cumulative weights
    order = np.lexsort((np.arange(items), item_cat))
    cum = np.cumsum(weight[order])
    per_cat = np.bincount(item_cat, minlength=categories)
    end = np.cumsum(per_cat)
    start = end - per_cat
    base = np.where(start > 0, cum[np.maximum(start - 1, 0)], 0.0)
    total = cum[np.maximum(end - 1, 0)] - base
    u = base[cat] + rng.random(n) * total[cat]
    in_cat = order[np.minimum(np.searchsorted(cum, u), items - 1)]
    anywhere = np.minimum(np.searchsorted(np.cumsum(weight), rng.random(n) * weight.sum()),
                          items - 1)
    item = np.where((rng.random(n) < 0.8) & (per_cat[cat] > 0), in_cat, anywhere)

    def tokens(prefix: str, ids: np.ndarray) -> pa.Array:
        return pc.binary_join_element_wise(prefix, pc.cast(pa.array(ids), pa.string()), "")

    return pa.table({"label": np.ones(n, np.int64), "user_id": tokens("u", user),
                     "item_id": tokens("i", item), "category_id": tokens("c", item_cat[item]),
                     "timestamp": np.tile(np.arange(per_user), users)})


@dataclass(frozen=True)
class World:
    """A synthetic CTR world with a known labelling model, for measuring defaults on data
    nobody tuned for. Every parameter changes the shape of the problem:

    * ``categorical`` fields with vocabularies drawn log-uniformly in ``vocab`` and Zipf
      (``zipf_a``) frequencies; ``informative`` of them have first-order effects of scale
      ``first_order``; effects shrink with an id's rarity, as in real logs;
    * ``pairs`` pairs of fields interact through rank-4 latent factors of scale
      ``interaction`` (0: a purely additive world, where LR is the right model);
    * ``numeric`` features (half counts, half signed reals) with linear effects of scale
      ``numeric_effect`` and ``nonlinear`` (a sum of sin x tanh terms);
    * the intercept is solved so that the mean click probability is ``base_rate``.

    Columns: ``label``, ``oracle_p`` (the true probability), ``n1..`` and ``c1..``.

    >>> t = next(iter_world(World("w", rows=10, categorical=3, vocab=(5, 50), numeric=2)))
    >>> t.column_names
    ['label', 'oracle_p', 'n1', 'n2', 'c1', 'c2', 'c3']
    """

    name: str
    rows: int
    categorical: int
    vocab: tuple[int, int]
    numeric: int = 0
    zipf_a: float = 1.1
    informative: float = 0.7
    first_order: float = 0.6
    pairs: int = 6
    interaction: float = 0.5
    numeric_effect: float = 0.3
    nonlinear: float = 0.0
    base_rate: float = 0.2
    missing_rate: float = 0.05
    seed: int = 0


class _WorldTruth:
    def __init__(self, w: World):
        rng = np.random.default_rng([w.seed, 7])
        lo, hi = np.log(w.vocab[0]), np.log(w.vocab[1])
        self.vocab = np.round(np.exp(rng.uniform(lo, hi, w.categorical))).astype(np.int64)
        self.vocab = np.maximum(self.vocab, 2)

        def shrink(v: int) -> np.ndarray:
            return 1.0 / np.sqrt(1.0 + np.arange(v) / 50.0)

        informative = rng.random(w.categorical) < w.informative
        self.w = [rng.normal(0, w.first_order if informative[f] else 0.0, v) * shrink(v)
                  for f, v in enumerate(self.vocab)]
        all_pairs = [(f, g) for f in range(w.categorical) for g in range(f + 1, w.categorical)]
        pick = rng.permutation(len(all_pairs))[: w.pairs] if w.interaction > 0 else []
        self.pairs = [all_pairs[i] for i in pick]
        self.v = {f: rng.normal(0, w.interaction, (self.vocab[f], LATENT))
                  * shrink(self.vocab[f])[:, None] for pair in self.pairs for f in pair}
        self.beta = rng.normal(0, w.numeric_effect, w.numeric)
        self.counts = np.arange(w.numeric) % 2 == 0  # even columns: counts, odd: reals
        self.mu = rng.uniform(0.5, 3.0, w.numeric)
        self.sigma = rng.uniform(0.5, 1.5, w.numeric)
        n_nl = w.numeric // 2 if w.nonlinear > 0 else 0
        self.nl = [(int(a), int(b)) for a, b in rng.integers(0, max(w.numeric, 1), (n_nl, 2))]
        self.nl_scale = w.nonlinear / np.sqrt(max(n_nl, 1))
        self.perm = [rng.permutation(v) for v in self.vocab]  # rank -> token id
        self.bias = 0.0

    def logit(self, ranks: np.ndarray, present: np.ndarray, z: np.ndarray) -> np.ndarray:
        out = np.full(len(ranks), self.bias)
        for f, w in enumerate(self.w):
            out += np.where(present[:, f], w[ranks[:, f]], 0.0)
        for f, g in self.pairs:
            both = present[:, f] & present[:, g]
            out += np.where(both, (self.v[f][ranks[:, f]] * self.v[g][ranks[:, g]]).sum(1), 0.)
        if z.shape[1]:
            out += z @ self.beta
            for a, b in self.nl:
                out += self.nl_scale * np.sin(2.0 * z[:, a]) * np.tanh(z[:, b] + 0.5)
        return out


def _draw_key(w: World, stream: int, k: int, draw: int) -> list[int]:
    """The seed of chunk ``k`` of sample ``draw`` (0: the world's own rows)."""
    return [w.seed, stream, k] if draw == 0 else [w.seed, stream, k, draw]


def _world_chunk(w: World, truth: _WorldTruth, k: int, n: int, draw: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(_draw_key(w, 8, k, draw))
    ranks = np.stack([_zipf_ranks(rng, n, int(v), w.zipf_a) for v in truth.vocab], axis=1) \
        if w.categorical else np.zeros((n, 0), np.int64)
    present = rng.random(ranks.shape) >= w.missing_rate
    z = rng.normal(0.0, 1.0, (n, w.numeric))  # the latent standardised value
    raw = np.where(truth.counts, np.floor(np.exp(truth.mu + truth.sigma * z)),
                   truth.mu * 10 * z + truth.mu)
    missing = rng.random(raw.shape) < w.missing_rate
    return ranks, present, np.where(missing, 0.0, z), np.where(missing, np.nan, raw)


def _calibrated_truth(w: World) -> _WorldTruth:
    """``w``'s labelling model with the intercept that gives its base rate (bisection)."""
    truth = _WorldTruth(w)
    ranks, present, z, _ = _world_chunk(w, truth, 1 << 30, min(w.rows, 50_000) or 1)
    lo, hi = -12.0, 6.0
    for _ in range(40):
        truth.bias = (lo + hi) / 2
        p = 1.0 / (1.0 + np.exp(-truth.logit(ranks, present, z)))
        lo, hi = (truth.bias, hi) if p.mean() < w.base_rate else (lo, truth.bias)
    return truth


def true_pairs(w: World) -> list[tuple[int, int]]:
    """The pairs of categorical fields that interact in ``w``, as 0-based field indices
    (field ``f`` is column ``c{f + 1}``); each field's ids carry one rank-:data:`LATENT`
    vector shared by its pairs. Empty for an additive world.

    >>> true_pairs(World("w", rows=10, categorical=4, vocab=(5, 50), pairs=2))
    [(0, 2), (0, 3)]
    """
    return [(int(f), int(g)) for f, g in _WorldTruth(w).pairs]


def interaction_value(w: World, rows: int = 200_000) -> tuple[float, float]:
    """``(oracle AUC, AUC of the oracle without its pair terms)`` on ``rows`` rows drawn
    from ``w`` (not its own rows: a property of the world): the difference is what learning
    the interactions can be worth at most. Labels are drawn from the full model."""
    import torch

    from sampan.metrics import auc

    truth = _calibrated_truth(w)
    ranks, present, z, _ = _world_chunk(w, truth, (1 << 30) + 1, rows)
    full = truth.logit(ranks, present, z)
    pairs, truth.pairs = truth.pairs, []
    first = truth.logit(ranks, present, z)
    truth.pairs = pairs
    rng = np.random.default_rng([w.seed, 10])
    y = torch.from_numpy((rng.random(rows) < 1.0 / (1.0 + np.exp(-full))).astype(np.float32))
    return auc(torch.from_numpy(full), y), auc(torch.from_numpy(first), y)


def iter_world(w: World, chunk_rows: int = CHUNK_ROWS, draw: int = 0,
               rows: int | None = None) -> Iterator[pa.Table]:
    """The rows of ``w`` as tables of up to ``chunk_rows`` rows (a pure function of ``w``).

    ``draw`` 0 gives the world's own ``w.rows`` rows; ``draw`` 1, 2, ... give independent
    samples of ``rows`` rows (default ``w.rows``) from the same world: the same labelling
    model, intercept and vocabularies, other rows (a held-out test set as large as wanted).
    """
    if draw < 0:
        raise ValueError(f"draw must be 0 (the world's own rows) or a positive sample "
                         f"number, got {draw}")
    truth = _calibrated_truth(w)
    total = w.rows if rows is None else rows
    for k, start in enumerate(range(0, total, chunk_rows)):
        n = min(chunk_rows, total - start)
        ranks, present, z, raw = _world_chunk(w, truth, k, n, draw)
        p = 1.0 / (1.0 + np.exp(-truth.logit(ranks, present, z)))
        rng = np.random.default_rng(_draw_key(w, 9, k, draw))
        cols: dict[str, pa.Array] = {"label": pa.array((rng.random(n) < p).astype(np.int64)),
                                     "oracle_p": pa.array(p)}
        for j in range(w.numeric):
            cols[f"n{j + 1}"] = pa.array(raw[:, j], mask=np.isnan(raw[:, j]))
        for f in range(w.categorical):
            ids = truth.perm[f][ranks[:, f]]
            tokens = pc.binary_join_element_wise(f"v{f + 1}_", pc.cast(pa.array(ids),
                                                                       pa.string()), "")
            cols[f"c{f + 1}"] = pc.if_else(pa.array(present[:, f]), tokens,
                                           pa.scalar(None, pa.string()))
        yield pa.table(cols)


@dataclass(frozen=True)
class Marketplace:
    """Users and items with a known click model, for simulating traffic against a server
    (``benchmarks/closed_loop.py``): every (user, item) pair has its true click probability,
    so what a ranking policy earns is known exactly.

    Users carry ``segment`` and ``age``, items ``category`` and ``price``. The true logit is
    an intercept + the item's quality + the segment x category affinity + a rank-``latent``
    user x item taste term - a price effect; the intercept gives ``base_rate`` under
    uniformly random exposure. Learnable from logs: item ids (quality), the segment x
    category cross, and per-user taste where a user has enough impressions.

    >>> m = MarketplaceTruth(Marketplace(users=5, items=4))
    >>> m.p.shape, m.users_table().column_names, m.items_table().column_names
    ((5, 4), ['user_id', 'segment', 'age'], ['item_id', 'category', 'price'])
    """

    users: int = 2000
    items: int = 300
    segments: int = 8
    categories: int = 12
    latent: int = 4
    quality: float = 0.6
    affinity: float = 0.8
    taste: float = 0.5
    base_rate: float = 0.08
    seed: int = 0


class MarketplaceTruth:
    """The drawn users, items and the ``[users, items]`` matrix ``p`` of true click
    probabilities of a :class:`Marketplace`."""

    def __init__(self, m: Marketplace):
        rng = np.random.default_rng([m.seed, 11])
        self.m = m
        self.segment = rng.integers(0, m.segments, m.users)
        self.age = rng.integers(18, 70, m.users)
        self.category = rng.integers(0, m.categories, m.items)
        self.price = np.round(np.exp(rng.normal(3.0, 0.7, m.items)), 2)
        quality = rng.normal(0, m.quality, m.items)
        affinity = rng.normal(0, m.affinity, (m.segments, m.categories))
        u = rng.normal(0, np.sqrt(m.taste), (m.users, m.latent))
        v = rng.normal(0, np.sqrt(m.taste), (m.items, m.latent))
        price = (np.log(self.price) - 3.0) / 0.7
        z = quality[None, :] + affinity[self.segment][:, self.category] + u @ v.T \
            - 0.3 * price[None, :]
        lo, hi = -12.0, 6.0
        for _ in range(50):  # the intercept of the base rate under uniform exposure
            bias = (lo + hi) / 2
            mean = (1.0 / (1.0 + np.exp(-(z + bias)))).mean()
            lo, hi = (bias, hi) if mean < m.base_rate else (lo, bias)
        self.p = 1.0 / (1.0 + np.exp(-(z + bias)))

    def user_ids(self) -> list[str]:
        return [f"u{k}" for k in range(self.m.users)]

    def item_ids(self) -> list[str]:
        return [f"i{k}" for k in range(self.m.items)]

    def users_table(self) -> pa.Table:
        return pa.table({"user_id": self.user_ids(),
                         "segment": [f"s{s}" for s in self.segment], "age": self.age})

    def items_table(self) -> pa.Table:
        return pa.table({"item_id": self.item_ids(),
                         "category": [f"c{c}" for c in self.category], "price": self.price})

    def impressions(self, rows: int, seed: int = 0) -> pa.Table:
        """``rows`` impressions of uniformly random (user, item) pairs with clicks drawn
        from the truth: ``label``, ``user_id``, ``item_id``, ``oracle_p``."""
        rng = np.random.default_rng([self.m.seed, 12, seed])
        u = rng.integers(0, self.m.users, rows)
        i = rng.integers(0, self.m.items, rows)
        p = self.p[u, i]
        return pa.table({"label": (rng.random(rows) < p).astype(np.int64),
                         "user_id": [f"u{k}" for k in u], "item_id": [f"i{k}" for k in i],
                         "oracle_p": p})
