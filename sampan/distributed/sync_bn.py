"""Batch norm over the global batch: one all_reduce forward and one backward per layer."""

from __future__ import annotations

import torch

from sampan.distributed.collectives import _AllReduceSum
from sampan.distributed.context import context


class SyncBatchNorm(torch.nn.BatchNorm1d):
    """``BatchNorm1d`` whose training statistics are those of the whole global batch.

    Each rank's per-channel mean and variance, weighted by its row count, are added over
    ranks (in float64) with one ``all_reduce``, and the backward adds the matching gradient
    terms with another, so W processes normalise, update the running statistics and
    differentiate exactly as one process on the global batch (``torch.nn.SyncBatchNorm``
    runs on GPUs only). Its parameters and buffers are ``BatchNorm1d``'s, so checkpoints and
    exports do not change; outside training, or in a single process, it is
    ``BatchNorm1d``. Every rank must run each layer the same number of times a step (a
    collective): no batch norm in a branch that only some ranks take."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and context().enabled):
            return super().forward(x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        c = x.shape[1]
        k = x.numel() // c  # this rank's rows (times the length, for [N, C, L])
        low = x.dtype in (torch.float16, torch.bfloat16)  # statistics in float32 under amp
        var_k, mean_k = torch.var_mean(x.float() if low else x, dims, correction=0)
        mean_k, var_k = mean_k.double(), var_k.double()
        local = torch.cat([mean_k * k, (var_k + mean_k * mean_k) * k, mean_k.new_full((1,), k)])
        total = _AllReduceSum.apply(local)
        n = total[-1]
        mean = total[:c] / n
        var = (total[c: 2 * c] / n - mean * mean).clamp_min(0.0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[union-attr]
                f = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                     else self.momentum)
                unbiased = var * n / (n - 1).clamp_min(1.0)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), f)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype),  # type: ignore
                                       f)
        inv = torch.rsqrt(var + self.eps)
        scale, shift = inv, -mean * inv
        if self.affine:
            scale, shift = scale * self.weight, shift * self.weight + self.bias
        t = torch.float32 if low else x.dtype  # normalised in float32 under amp, as torch's
        y = torch.addcmul(shift.to(t).view(shape), x.to(t), scale.to(t).view(shape))
        return y.to(x.dtype)


def sync_batch_norm_(module: torch.nn.Module) -> int:
    """Replace every ``BatchNorm1d`` in ``module`` with a :class:`SyncBatchNorm` holding the
    same parameter and buffer tensors (in place: checkpoints and exports do not change);
    returns how many."""
    done: dict[int, SyncBatchNorm] = {}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.BatchNorm1d:
                if id(child) not in done:
                    done[id(child)] = _synced(child)
                setattr(parent, name, done[id(child)])
    return len(done)


def _synced(bn: torch.nn.BatchNorm1d) -> SyncBatchNorm:
    new = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine,
                        bn.track_running_stats, device="meta")
    for name, p in bn.named_parameters(recurse=False):
        setattr(new, name, p)
    for name, b in bn.named_buffers(recurse=False):
        setattr(new, name, b)
    return new.train(bn.training)
