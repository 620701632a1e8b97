"""The built-in default dataset: Criteo-shaped rows whose labels come from a known model.

Columns match the Criteo preset: ``label``, ``I1..I13`` (non-negative counts, some missing),
``C1..C26`` (8-hex-digit tokens, Zipf-distributed, some missing), plus ``oracle_p``, the
true click probability of the row. The labelling model has first-order effects, pairwise
field interactions (factorised, as DeepFM assumes) and a non-linear numeric term, so a model
that learns interactions beats logistic regression, and the AUC of ``oracle_p`` on the test
split is the best any model can reach.

Everything is a pure function of ``SyntheticConfig`` (seed included): the same config gives
the same rows on every machine.

>>> from sampan.config import SyntheticConfig
>>> t = next(iter_synthetic(SyntheticConfig(rows=5)))
>>> t.num_rows, t.column_names[:3]
(5, ['label', 'I1', 'I2'])
"""

from __future__ import annotations

from collections.abc import Iterator

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


class _TruthModel:
    """Parameters of the labelling model, drawn once from the seed."""

    def __init__(self, seed: int):
        rng = np.random.default_rng([seed, 0])
        # Effects shrink with an id's rarity (rank r): the head carries most of the signal,
        # as in real logs, so a model can approach the oracle from a few hundred k rows.
        def shrink(v: int) -> np.ndarray:
            return 1.0 / np.sqrt(1.0 + np.arange(v) / 50.0)

        self.w = [rng.normal(0, 0.7 if f in INFORMATIVE else 0.0, size=v) * shrink(v)
                  for f, v in enumerate(VOCAB_SIZES)]
        self.v = {f: rng.normal(0, 0.5, size=(VOCAB_SIZES[f], LATENT)) * shrink(
            VOCAB_SIZES[f])[:, None] for pair in PAIRS for f in pair}
        self.beta = rng.normal(0, 0.25, size=NUM_NUMERIC) * (rng.random(NUM_NUMERIC) < 0.6)
        self.mu = rng.uniform(0.5, 3.0, size=NUM_NUMERIC)
        self.sigma = rng.uniform(0.5, 1.5, size=NUM_NUMERIC)
        # Rank -> token permutation per field so that frequent ids look arbitrary.
        self.tokens = []
        for f, v in enumerate(VOCAB_SIZES):
            codes = (rng.permutation(v).astype(np.uint64) * np.uint64(2654435761)
                     + np.uint64(f * 7919)) % np.uint64(1 << 32)
            self.tokens.append(pa.array([f"{c:08x}" for c in codes.tolist()], pa.string()))

    def logit(self, ranks: np.ndarray, present: np.ndarray, x: np.ndarray) -> np.ndarray:
        """ranks/present ``[N, 26]``, x ``[N, 13]`` (0 where missing) -> true logits ``[N]``."""
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
    truth = _TruthModel(cfg.seed)
    for start in range(0, cfg.rows, CHUNK_ROWS):
        n = min(CHUNK_ROWS, cfg.rows - start)
        rng = np.random.default_rng([cfg.seed, 1, start // CHUNK_ROWS])
        ranks = np.stack([_zipf_ranks(rng, n, v, cfg.zipf_a) for v in VOCAB_SIZES], axis=1)
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
