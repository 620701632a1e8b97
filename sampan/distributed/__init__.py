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
* **Embedding tables** are placed per fused table (``train.embedding_placement``):
  *replicated*: each rank's (row ids, row gradients) are all-gathered and merged, so every
  rank applies the same sparse update and the replicas stay equal; *row-sharded*: rank ``k``
  holds rows ``bounds[k]:bounds[k+1]`` and their optimizer state; a lookup sends each unique
  id to its owner and gets the row back (``all_to_all`` both ways), and the backward sends
  each row's gradient to its owner, which alone updates it. ``auto`` shards tables of
  ``train.shard_min_bytes`` or more.
* **Losses** are weighted by each rank's share of the global batch, so the summed gradient
  equals the gradient of the global-batch mean even when the last batch splits unevenly.
* **Evaluation** shards the rows, then gathers every prediction, label and group in row
  order: global AUC / GAUC are computed on all the rows, never averaged over ranks.
* **Batch norm** normalises with the global batch's statistics (:class:`SyncBatchNorm`,
  one ``all_reduce`` forward and one backward per layer); with ``train.sync_batch_norm:
  false`` it keeps per-rank statistics (as DDP without SyncBatchNorm). Rank 0's buffers are
  broadcast before every evaluation and checkpoint.
* **Checkpoints** are written by rank 0, except the rows of row-sharded tables and their
  optimizer state: each process writes its own to a part file first (see
  :mod:`sampan.train.checkpoint`), so no process ever holds a whole table. Every process
  reads back only its rows (memory-mapped), so a run resumes with any world size; a
  single-process reader (export, eval) puts the parts together.
* **Retrieval** (two-tower) takes its in-batch negatives from the whole global batch: the
  item vectors are all-gathered with :func:`gather_rows_with_grad`, whose backward returns
  each rank's share of the gradient, so a step equals one process's on the global batch.
* **Row-sharded tables** are built as each rank's rows only (see
  :func:`sampan.embedding.collection.sharded_build`), with the values those rows have in the
  whole table.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


_CTX = DistContext()


def context() -> DistContext:
    """The process's place in the job (rank 0 of 1 outside a distributed launch)."""
    return _CTX


def init_from_env(device_type: str = "cpu") -> DistContext:
    """Join the process group described by torchrun's environment (``WORLD_SIZE`` > 1)."""
    global _CTX
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        _CTX = DistContext()
        return _CTX
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_launcher()
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)  # one GPU per process on each machine
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    _CTX = DistContext(rank=dist.get_rank(), world=dist.get_world_size(),
                       local_rank=local_rank)
    return _CTX


def _die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a launcher killed outright
    (SIGKILL to ``sampan train``'s process group) would leave its ranks training on. On
    Linux, have the kernel kill this rank when its launcher dies."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def shutdown() -> None:
    global _CTX
    if dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while a peer still uses them
        dist.destroy_process_group()
    _CTX = DistContext()


def broadcast_object(obj: object) -> object:
    """Rank 0's ``obj`` on every rank."""
    if not _CTX.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: object) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in a single process)."""
    if not _CTX.enabled:
        return [obj]
    out: list[object] = [None] * _CTX.world
    dist.all_gather_object(out, obj)
    return out


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same trailing shape, any number of rows) in rank
    order."""
    if not _CTX.enabled:
        return x
    return _gather(x)[0]


def _gather(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    n = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    sizes_t = [torch.zeros_like(n) for _ in range(_CTX.world)]
    dist.all_gather(sizes_t, n)
    sizes = [int(s) for s in sizes_t]
    top = max(sizes)
    pad = torch.zeros((top - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    parts = [torch.empty((top, *x.shape[1:]), dtype=x.dtype, device=x.device)
             for _ in range(_CTX.world)]
    dist.all_gather(parts, torch.cat([x, pad]).contiguous())
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)]), sizes


class _AllGatherRows(torch.autograd.Function):
    """all_gather_rows with a backward: each rank's rows get the sum over ranks of the
    gradient with respect to them (every rank's loss may use every rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, where: dict) -> torch.Tensor:  # type: ignore[override]
        out, sizes = _gather(x)
        ctx.lo, ctx.n = sum(sizes[: _CTX.rank]), x.shape[0]
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
    if not _CTX.enabled:
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
        if not (self.training and _CTX.enabled):
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
    """Make every ``BatchNorm1d`` in ``module`` a :class:`SyncBatchNorm` (in place, the same
    parameter and buffer tensors); returns how many."""
    count = 0
    for m in module.modules():
        if type(m) is torch.nn.BatchNorm1d:
            m.__class__ = SyncBatchNorm  # adds no state: only forward differs
            count += 1
    return count


def average_gradients(params: list[torch.Tensor], bucket_bytes: int = 25 << 20) -> None:
    """Sum every parameter's gradient over ranks, flattened into buckets of about
    ``bucket_bytes``. Each rank's loss is weighted by its share of the global batch, so the
    sum is the gradient of the global-batch mean (an average when the shares are equal)."""
    if not _CTX.enabled:
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


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (batch-norm running statistics) on every rank, so that all ranks
    evaluate and save the same model."""
    if not _CTX.enabled:
        return
    for b in module.buffers():
        if b.is_floating_point() or b.dtype in (torch.int64, torch.int32):
            dist.broadcast(b, src=0)


def merge_sparse(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' ``(unique row ids [U], gradients [U, D])`` merged into one sum per row."""
    if not _CTX.enabled:
        return rows, grads
    all_rows = all_gather_rows(rows)
    all_grads = all_gather_rows(grads)
    uniq, inv = torch.unique(all_rows, return_inverse=True)
    merged = torch.zeros(len(uniq), grads.shape[1], dtype=grads.dtype, device=grads.device)
    merged.index_add_(0, inv, all_grads)
    return uniq, merged


def shard_rows(n: int) -> tuple[int, int]:
    """This rank's contiguous ``[lo, hi)`` of ``n`` rows (evaluation sharding)."""
    return n * _CTX.rank // _CTX.world, n * (_CTX.rank + 1) // _CTX.world


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
    w = _CTX.world
    owner = torch.bucketize(uniq, torch.tensor(bounds[1:], device=uniq.device), right=True)
    sent = torch.bincount(owner, minlength=w)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)
    sent_l, received_l = sent.tolist(), received.tolist()
    served = torch.empty(sum(received_l), dtype=uniq.dtype, device=uniq.device)
    dist.all_to_all_single(served, uniq.contiguous(), received_l, sent_l)
    rows_out = shard.index_select(0, served - bounds[_CTX.rank])
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


# A row-sharded tensor in a checkpoint: its rows are in part files (see
# sampan.train.checkpoint, which writes and reads them)
PART = "__rows_in_parts__"


def placeholder(key: str, rows: int) -> dict[str, Any]:
    return {PART: key, "rows": rows}


def _sharded(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from sampan.embedding import EmbeddingCollection

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, EmbeddingCollection) and m.sharded]


def any_sharded(model: torch.nn.Module) -> bool:
    return bool(_sharded(model))


def _weight(name: str) -> str:
    """A table's state-dict key (checkpoint part keys are ``model/`` + it)."""
    return f"{name}.weight" if name else "weight"


def split_sharded_state(model: torch.nn.Module, obj: dict,
                        opt: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """A checkpoint ``obj`` (``"model"`` and maybe ``"sparse_opt"``, the state dict of
    ``opt``, of this rank) with this rank's rows of every row-sharded table, and their
    per-row optimizer state, replaced by placeholders; and those rows by key, for
    :func:`checkpoint.save_part`."""
    rows: dict[str, torch.Tensor] = {}
    sd = dict(obj["model"])
    sharded = _sharded(model)
    for name, m in sharded:
        w = _weight(name)
        rows[f"model/{w}"] = sd[w]
        sd[w] = placeholder(f"model/{w}", m.num_rows)
    out = {**obj, "model": sd}
    opt_sd = obj.get("sparse_opt")
    if opt_sd is not None and opt is not None:
        tables = {id(m.weight): m for _, m in sharded}
        state = dict(opt_sd["state"])
        for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
            m = tables.get(id(p))
            if m is None or i not in state:
                continue
            entry = dict(state[i])
            for k, v in entry.items():
                if torch.is_tensor(v) and v.dim() and v.shape[0] == p.shape[0]:
                    rows[f"sparse_opt/{i}/{k}"] = v
                    entry[k] = placeholder(f"sparse_opt/{i}/{k}", m.num_rows)
            state[i] = entry
        out["sparse_opt"] = {**opt_sd, "state": state}
    return out, rows


def local_rows_of(model: torch.nn.Module,  # type: ignore[no-untyped-def]
                  opt: torch.optim.Optimizer | None = None):
    """For :func:`checkpoint.load`: this rank's ``(lo, hi)`` of each row-sharded table and of
    its optimizer state, so a process reads only its rows; ``None`` when nothing is sharded."""
    sharded = _sharded(model)
    if not sharded:
        return None
    r = _CTX.rank
    want = {f"model/{_weight(name)}": (m.bounds[r], m.bounds[r + 1], m.num_rows)
            for name, m in sharded}
    tables = {id(m.weight): (m.bounds[r], m.bounds[r + 1], m.num_rows) for _, m in sharded}
    params = [] if opt is None else [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if id(p) in tables:
            want[f"sparse_opt/{i}"] = tables[id(p)]

    def rows_of(key: str, total: int) -> tuple[int, int] | None:
        got = want.get(key) or want.get(key.rsplit("/", 1)[0])
        return got[:2] if got is not None and got[2] == total else None

    return rows_of


def shard_optimizer_state_dict(sd: dict, opt: torch.optim.Optimizer,
                               model: torch.nn.Module) -> dict:
    """A whole-table optimizer state dict cut to this rank's rows (before loading it, so the
    whole state never reaches the device)."""
    shards = {id(m.weight): m for _, m in _sharded(model)}
    params = [p for g in opt.param_groups for p in g["params"]]
    state = dict(sd["state"])
    for i, p in enumerate(params):
        m = shards.get(id(p))
        if m is None or i not in state:
            continue
        lo, hi = m.bounds[_CTX.rank], m.bounds[_CTX.rank + 1]
        state[i] = {k: v[lo:hi].clone() if torch.is_tensor(v) and v.dim() and
                    v.shape[0] == m.num_rows else v for k, v in state[i].items()}
    return {**sd, "state": state}
