"""Gradient reduction: dense gradients averaged in buckets, row gradients merged."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sampan.distributed.collectives import all_gather_rows
from sampan.distributed.context import context


def average_gradients(params: list[torch.Tensor], bucket_bytes: int = 25 << 20) -> None:
    """Sum every parameter's gradient over ranks, flattened into buckets of about
    ``bucket_bytes``. Each rank's loss is weighted by its share of the global batch, so the
    sum is the gradient of the global-batch mean (an average when the shares are equal)."""
    if not context().enabled:
        return
    # A parameter without a gradient on this rank (e.g. DIEN's auxiliary net when the shard
    # has no history) still takes part: every rank must reduce the same layout.
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    bucket: list[torch.Tensor] = []
    size = 0
    for g in [*grads, None]:
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket and (g is None or size >= bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
            bucket, size = [], 0



def merge_sparse(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' ``(unique row ids [U], gradients [U, D])`` merged into one sum per row."""
    if not context().enabled:
        return rows, grads
    all_rows = all_gather_rows(rows)
    all_grads = all_gather_rows(grads)
    uniq, inv = torch.unique(all_rows, return_inverse=True)
    merged = torch.zeros(len(uniq), grads.shape[1], dtype=grads.dtype, device=grads.device)
    merged.index_add_(0, inv, all_grads)
    return uniq, merged
