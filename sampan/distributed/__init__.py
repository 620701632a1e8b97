"""Data-parallel training on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

Started by ``sampan train CONFIG --nproc-per-node N`` (or ``torchrun -m sampan train``):
every process runs the same experiment on its share of each global batch.

* **Batches**: ``train.batch_size`` is the *global* batch. All ranks draw the same shuffled
  order (seeded by ``seed`` and the epoch) and rank ``r`` of ``W`` takes the ``r``-th
  contiguous part of every global batch, so the samples of a step, and the order of steps,
  do not depend on ``W``. Each rank reads only its rows of the memory-mapped store.
* **Dense parameters**: gradients are averaged over ranks after backward (flattened into
  buckets, one ``all_reduce`` each) — the reduction DistributedDataParallel performs; it is
  done explicitly because some tasks call the model outside ``forward`` (two-tower's towers,
  DIEN's auxiliary loss), which DDP's reducer does not follow.
* **Embedding tables** are placed per fused table (``train.embedding_placement``), from
  outside the model: the strategy's ``parallelize`` replaces each ``EmbeddingCollection``
  (see :mod:`~sampan.distributed.sharded_embedding`). *replicated*: each rank's (row ids,
  row gradients) are all-gathered and merged, so every rank applies the same sparse update
  and the replicas stay equal; *row-sharded*: rank ``k`` holds rows ``bounds[k]:bounds[k+1]``
  and their optimizer state; a lookup sends each unique id to its owner and gets the row
  back (``all_to_all`` both ways), and the backward sends each row's gradient to its owner,
  which alone updates it. ``auto`` shards tables of ``train.shard_min_bytes`` or more. The
  model is built with its tables deferred (on the meta device), so a process only ever
  allocates the rows it keeps, with the values those rows have in a plain build.
* **Losses** are weighted by each rank's share of the global batch, so the summed gradient
  equals the gradient of the global-batch mean even when the last batch splits unevenly.
* **Evaluation** shards the rows, then gathers every prediction, label and group in row
  order: global AUC / GAUC are computed on all the rows, never averaged over ranks.
* **Batch norm** normalises with the global batch's statistics (:class:`SyncBatchNorm`,
  one ``all_reduce`` forward and one backward per layer); with ``train.sync_batch_norm:
  false`` it keeps per-rank statistics (as DDP without SyncBatchNorm). Rank 0's buffers are
  broadcast before every evaluation and checkpoint.
* **Checkpoints** are written by rank 0, except the rows of row-sharded tables and their
  optimizer state: each process writes its own to a part file first (the protocol is in
  :mod:`sampan.train.checkpoint`), so no process ever holds a whole table. Every process
  reads back only its rows (memory-mapped), so a run resumes with any world size; a
  single-process reader (export, eval) puts the parts together.
* **Retrieval** (two-tower) takes its in-batch negatives from the whole global batch: the
  item vectors are all-gathered with :func:`gather_rows_with_grad`, whose backward returns
  each rank's share of the gradient, so a step equals one process's on the global batch.

The parts: :mod:`~sampan.distributed.context` (the process group), ``collectives``,
``grads``, ``sync_bn``, ``sharded_embedding`` (replicated and row-sharded tables, applied to
a built model) and ``strategy`` (what the Trainer is given: :class:`SingleProcess` or
:class:`DataParallel`). Their names are importable from here.
"""

from sampan.distributed.collectives import (
    all_gather_rows,
    broadcast_buffers,
    broadcast_object,
    gather_objects,
    gather_rows_with_grad,
)
from sampan.distributed.context import DistContext, context, init_from_env, shutdown
from sampan.distributed.grads import average_gradients
from sampan.distributed.sharded_embedding import (
    ReplicatedCollection,
    RowShardedCollection,
    distribute_embeddings,
    fetch_rows,
    return_grads,
    shard_bounds,
)
from sampan.distributed.strategy import DataParallel, SingleProcess, strategy_for
from sampan.distributed.sync_bn import SyncBatchNorm, sync_batch_norm_

__all__ = ["DataParallel", "DistContext", "ReplicatedCollection", "RowShardedCollection",
           "SingleProcess", "SyncBatchNorm", "all_gather_rows", "average_gradients",
           "broadcast_buffers", "broadcast_object", "context", "distribute_embeddings",
           "fetch_rows", "gather_objects", "gather_rows_with_grad", "init_from_env",
           "return_grads", "shard_bounds", "shutdown", "strategy_for",
           "sync_batch_norm_"]
