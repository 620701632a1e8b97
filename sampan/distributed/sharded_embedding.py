"""Row-sharded tables: which rank owns which rows, and the all_to_all that fetches a
batch's rows from their owners and sends the gradients back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sampan.distributed.context import context


# ------------------------------------------------------------------ row-sharded tables
@dataclass
class _Route:
    """How one lookup's unique ids travelled: counts each way and the ids this rank
    served (global rows), for sending their gradients back."""

    sent: list[int]
    received: list[int]
    served: torch.Tensor


def fetch_rows(uniq: torch.Tensor, shard: torch.Tensor, bounds: list[int]
               ) -> tuple[torch.Tensor, _Route]:
    """Rows ``[U, D]`` of the sorted unique global ids ``uniq`` from the ranks that own them
    (rank ``k`` holds rows ``bounds[k]:bounds[k + 1]`` in ``shard``): ids go out with one
    ``all_to_all``, rows come back with another."""
    w = context().world
    owner = torch.bucketize(uniq, torch.tensor(bounds[1:], device=uniq.device), right=True)
    sent = torch.bincount(owner, minlength=w)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)
    sent_l, received_l = sent.tolist(), received.tolist()
    served = torch.empty(sum(received_l), dtype=uniq.dtype, device=uniq.device)
    dist.all_to_all_single(served, uniq.contiguous(), received_l, sent_l)
    rows_out = shard.index_select(0, served - bounds[context().rank])
    rows = torch.empty(len(uniq), shard.shape[1], dtype=shard.dtype, device=shard.device)
    dist.all_to_all_single(rows, rows_out.contiguous(), sent_l, received_l)
    return rows, _Route(sent_l, received_l, served)


def return_grads(grads: torch.Tensor, route: _Route) -> tuple[torch.Tensor, torch.Tensor]:
    """Send row gradients back to the owners: ``(global ids served here, their grads)``."""
    back = torch.empty(sum(route.received), grads.shape[1], dtype=grads.dtype,
                       device=grads.device)
    dist.all_to_all_single(back, grads.contiguous(), route.received, route.sent)
    return route.served, back


def shard_bounds(rows: int, world: int) -> list[int]:
    """Row boundaries of ``world`` contiguous shards of a ``rows``-row table."""
    return [rows * k // world for k in range(world + 1)]
