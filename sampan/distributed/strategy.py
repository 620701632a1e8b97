"""How a run spreads over processes, as one object the Trainer is given: it reads as
single-process code and asks its strategy wherever processes must agree.

:class:`SingleProcess` is the identity (every collective returns its input);
:class:`DataParallel` is the data-parallel run of ``sampan train --nproc-per-node N`` (see
:mod:`sampan.distributed` for what each part does). A strategy is also what prepares a built
model for its run: :meth:`~SingleProcess.parallelize` gives deferred embedding tables their
values — whole in one process, each process's own rows when row-sharded.

Example::

    strategy = strategy_for(cfg.train)               # from the launch environment
    schema = store.schema.with_table_device(strategy.table_device)
    model = strategy.parallelize(build_model(cfg.model, schema))
    Trainer(model, cfg, run_dir, train, valid, strategy=strategy).fit()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sampan.distributed import collectives
from sampan.distributed.context import DistContext, context
from sampan.distributed.grads import average_gradients
from sampan.distributed.sharded_embedding import RowShardedCollection, distribute_embeddings
from sampan.distributed.sync_bn import sync_batch_norm_
from sampan.embedding.collection import EmbeddingCollection


class SingleProcess:
    """One process: nothing to agree on."""

    rank, world, local_rank = 0, 1, 0
    enabled, is_main = False, True
    table_device: str | None = None  # plain builds: tables allocated where they are built
    synced_batch_norms = 0  # batch-norm layers parallelize made global-batch ones

    def parallelize(self, model: nn.Module) -> nn.Module:
        """``model`` ready for this strategy: deferred tables allocated whole."""
        for m in model.modules():
            if isinstance(m, EmbeddingCollection):
                m.materialize_()
        return model

    def describe(self, model: nn.Module) -> list[tuple[str, int, int, int, str]]:  # noqa: ARG002
        """``(table, rows, dim, bytes, placement)`` of every table (distributed runs)."""
        return []

    def batch_weight(self, rows: int, global_rows: int) -> float:  # noqa: ARG002
        """This process's share of a global batch of ``global_rows`` (its loss weight)."""
        return 1.0

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the dense gradients over processes (the losses are weighted by share)."""

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over processes, in place."""
        return t

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any."""
        return flag

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every process."""
        return obj

    def gather(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in rank order."""
        return [obj]

    def sync_buffers(self, model: nn.Module) -> None:
        """Rank 0's buffers (batch-norm statistics) on every process."""

    def barrier(self) -> None:
        """Wait for every process."""

    def shard(self, n: int) -> tuple[int, int]:
        """This process's contiguous ``[lo, hi)`` of ``n`` rows (evaluation)."""
        return 0, n

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's rows of ``x``, in rank order."""
        return x

    def max_int(self, n: int) -> int:
        """The largest ``n`` over processes."""
        return n


class DataParallel(SingleProcess):
    """Every process trains on its share of each global batch (gloo on CPU, NCCL on GPUs).

    ``shard_tables(weight bytes)`` says which fused tables are row-sharded (the others are
    replicated); ``sync_batch_norm`` normalises batch norm over the global batch.
    """

    table_device = "meta"  # no process allocates a whole table; parallelize gives its rows

    def __init__(self, ctx: DistContext, shard_tables: Any = None,
                 sync_batch_norm: bool = True):
        if not ctx.enabled:
            raise RuntimeError("DataParallel needs a process group of 2 or more processes "
                               "(start with sampan train --nproc-per-node N)")
        self.ctx = ctx
        self.rank, self.world, self.local_rank = ctx.rank, ctx.world, ctx.local_rank
        self.enabled, self.is_main = True, ctx.is_main
        self.shard_tables = shard_tables or (lambda nbytes: False)
        self.sync_batch_norm = sync_batch_norm

    def parallelize(self, model: nn.Module) -> nn.Module:
        model = distribute_embeddings(model, self.shard_tables, self.rank, self.world)
        if self.sync_batch_norm:
            self.synced_batch_norms += sync_batch_norm_(model)
        return model

    def describe(self, model: nn.Module) -> list[tuple[str, int, int, int, str]]:
        rows = []
        for c in (m for m in model.modules() if isinstance(m, EmbeddingCollection)):
            start = 0
            for t in c.tables:
                if isinstance(c, RowShardedCollection):
                    owners = [k for k in range(self.world)
                              if c.bounds[k] < start + t.rows and c.bounds[k + 1] > start]
                    where = (f"row-sharded: rank {owners[0]}" if len(owners) == 1 else
                             f"row-sharded: ranks {owners[0]}-{owners[-1]}")
                else:
                    where = "replicated (sparse gradients all-gathered)"
                rows.append((t.name, t.rows, c.dim, t.rows * c.dim * c.weight.element_size(),
                             where))
                start += t.rows
        return rows

    def batch_weight(self, rows: int, global_rows: int) -> float:
        return rows / global_rows

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        average_gradients(params)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def any(self, flag: bool) -> bool:
        return self.max_int(int(flag)) > 0

    def max_int(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def broadcast(self, obj: Any) -> Any:
        return collectives.broadcast_object(obj)

    def gather(self, obj: Any) -> list[Any]:
        return collectives.gather_objects(obj)

    def sync_buffers(self, model: nn.Module) -> None:
        collectives.broadcast_buffers(model)

    def barrier(self) -> None:
        dist.barrier()

    def shard(self, n: int) -> tuple[int, int]:
        return n * self.rank // self.world, n * (self.rank + 1) // self.world

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_gather_rows(x)


def strategy_for(train: Any = None) -> SingleProcess:
    """The strategy of this process's launch: :class:`DataParallel` under ``torchrun`` /
    ``--nproc-per-node`` (with ``train``'s ``embedding_placement``, ``shard_min_bytes``
    and ``sync_batch_norm``), else :class:`SingleProcess`."""
    ctx = context()
    if not ctx.enabled:
        return SingleProcess()
    if train is None:
        return DataParallel(ctx)
    how, at_least = train.embedding_placement, train.shard_min_bytes

    def shard(nbytes: int) -> bool:
        return how == "row_sharded" or (how == "auto" and nbytes >= at_least)

    return DataParallel(ctx, shard, train.sync_batch_norm)
