"""Collectives the training loop and the tasks use: objects, rows (with and without
gradient) and buffers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sampan.distributed.context import context


def broadcast_object(obj: object) -> object:
    """Rank 0's ``obj`` on every rank."""
    if not context().enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: object) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in a single process)."""
    if not context().enabled:
        return [obj]
    out: list[object] = [None] * context().world
    dist.all_gather_object(out, obj)
    return out


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same trailing shape, any number of rows) in rank
    order."""
    if not context().enabled:
        return x
    return _gather(x)[0]


def _gather(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    n = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    sizes_t = [torch.zeros_like(n) for _ in range(context().world)]
    dist.all_gather(sizes_t, n)
    sizes = [int(s) for s in sizes_t]
    top = max(sizes)
    pad = torch.zeros((top - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    parts = [torch.empty((top, *x.shape[1:]), dtype=x.dtype, device=x.device)
             for _ in range(context().world)]
    dist.all_gather(parts, torch.cat([x, pad]).contiguous())
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)]), sizes


class _AllGatherRows(torch.autograd.Function):
    """all_gather_rows with a backward: each rank's rows get the sum over ranks of the
    gradient with respect to them (every rank's loss may use every rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, where: dict) -> torch.Tensor:  # type: ignore[override]
        out, sizes = _gather(x)
        ctx.lo, ctx.n = sum(sizes[: context().rank]), x.shape[0]
        where["lo"] = ctx.lo
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.lo: ctx.lo + ctx.n], None


def gather_rows_with_grad(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(every rank's x in rank order, where this rank's rows start)``, differentiable:
    for losses that use other ranks' rows, e.g. in-batch negatives drawn from the global
    batch. A single process gets ``(x, 0)``."""
    if not context().enabled:
        return x, 0
    where: dict[str, int] = {}
    out = _AllGatherRows.apply(x, where)
    return out, where["lo"]


class _AllReduceSum(torch.autograd.Function):
    """all_reduce (sum) with a backward: the sum feeds every rank's loss, so each rank's
    input gets the sum over ranks of the gradient with respect to the sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad



def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (batch-norm running statistics) on every rank, so that all ranks
    evaluate and save the same model."""
    if not context().enabled:
        return
    for b in module.buffers():
        if b.is_floating_point() or b.dtype in (torch.int64, torch.int32):
            dist.broadcast(b, src=0)
