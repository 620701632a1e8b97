"""Gradient reduction: dense gradients summed over ranks in buckets."""

from __future__ import annotations

import torch
import torch.distributed as dist

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
