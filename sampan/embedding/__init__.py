"""Sparse embeddings: one fused table per collection and row-sparse optimizers."""

from sampan.embedding.collection import EmbeddingCollection
from sampan.embedding.optim import (
    SparseAdagrad,
    SparseAdam,
    SparseRowWiseAdagrad,
    SparseSGD,
    make_sparse_optimizer,
)

__all__ = ["EmbeddingCollection", "SparseAdam", "SparseAdagrad", "SparseRowWiseAdagrad",
           "SparseSGD", "make_sparse_optimizer"]
