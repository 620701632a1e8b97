"""Sparse embeddings: one fused table per collection and row-sparse optimizers."""

from sampan.embedding.collection import EmbeddingCollection
from sampan.embedding.optim import (
           SparseAdagrad,
           SparseAdam,
           SparseRowWiseAdagrad,
           make_sparse_optimizer,
)

__all__ = ["EmbeddingCollection", "SparseAdam", "SparseAdagrad", "SparseRowWiseAdagrad",
           "make_sparse_optimizer"]
