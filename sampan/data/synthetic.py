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
