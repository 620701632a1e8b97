"""EmbeddingCollection: every sparse feature's table fused into one tensor.

Feature ``f``'s ids ``[0, rows_f)`` live at rows ``[offset_f, offset_f + rows_f)`` of a single
``[sum(rows), D]`` weight, so a batch needs one gather for all fields. In training the batch's
ids are deduplicated first; autograd then produces one gradient row per *unique* id
(``[U, D]``), and the sparse optimizer updates exactly those rows. No dense ``[rows, D]``
gradient is ever materialised.

Example::

    >>> from sampan.schema import TableSpec
    >>> emb = EmbeddingCollection([TableSpec("a", 5, 4, ("a",)), TableSpec("b", 3, 4, ("b",))])
    >>> emb(torch.tensor([[1, 2], [4, 0]])).shape      # ids [B, F] -> [B, F, D]
    torch.Size([2, 2, 4])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sampan.schema import TableSpec


class _GatherRows(torch.autograd.Function):
    """``rows[inverse]`` whose backward sums gradients with one ``index_add_`` (several times
    faster on CPU than ``embedding_dense_backward`` at CTR batch shapes)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (inverse,) = ctx.saved_tensors
        out = torch.zeros(ctx.num_rows, grad.shape[1], dtype=grad.dtype, device=grad.device)
        return out.index_add_(0, inverse, grad), None


# Tables built while a rule is set (see sharded_build) keep only this process's rows.
_SHARD_RULE: Callable[[int], tuple[int, int] | None] | None = None
_INIT_BLOCK_ROWS = 1 << 16  # a multiple of 16: see _normal_rows


@contextmanager
def sharded_build(rule: Callable[[int], tuple[int, int] | None]) -> Iterator[None]:
    """While active, every ``EmbeddingCollection`` built calls ``rule(weight bytes)``;
    ``(rank, world)`` makes it allocate and initialise only that rank's contiguous rows,
    with exactly the values those rows get in the whole table (a process never holds the
    whole table); ``None`` builds the whole table."""
    global _SHARD_RULE
    previous, _SHARD_RULE = _SHARD_RULE, rule
    try:
        yield
    finally:
        _SHARD_RULE = previous


def _normal_rows(rows: int, dim: int, std: float, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``torch.empty(rows, dim).normal_(0, std)``, drawing the same
    random stream (so the global generator ends in the same state) one block at a time.

    PyTorch's CPU ``normal_`` fills 16 values at a time; blocks of a multiple of 16 values
    continue the stream exactly, and the last block takes any remainder under 16 values.
    """
    out = torch.empty(hi - lo, dim)
    start = 0
    while start < rows:
        end = min(start + _INIT_BLOCK_ROWS, rows)
        if (rows - end) * dim < 16:
            end = rows
        block = torch.empty(end - start, dim).normal_(0.0, std)
        a, b = max(start, lo), min(end, hi)
        if a < b:
            out[a - lo: b - lo] = block[a - start: b - start]
        start = end
    return out


class EmbeddingCollection(nn.Module):
    """One fused table for ``tables`` (all of one dim), looked up by ``ids [B, F]``.

    The weight is a ``Parameter`` with ``requires_grad=False``: dense optimizers skip it, and
    its updates come only from a sparse optimizer reading :meth:`pop_lookups`.
    """

    def __init__(self, tables: list[TableSpec], init_std: float = 0.01):
        super().__init__()
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"a fused EmbeddingCollection needs one dim, got {sorted(dims)}")
        self.tables = list(tables)
        self.dim = dims.pop()
        rows = [t.rows for t in tables]
        self.num_rows = sum(rows)
        offsets = torch.tensor([0, *rows[:-1]], dtype=torch.int64).cumsum(0)
        fields = [i for i, t in enumerate(tables) if t.field]
        self.register_buffer("offsets", offsets[fields].clone(), persistent=False)
        # List features (sequences, bags) read their table by name.
        self.shared_offset = {name: int(offsets[i]) for i, t in enumerate(tables)
                              for name in (t.features if not t.field else t.features[1:])}
        self.bounds: list[int] | None = None  # row shards of each rank, when row-sharded
        shard = _SHARD_RULE(self.num_rows * self.dim * 4) if _SHARD_RULE else None
        if shard is None:
            self.weight = nn.Parameter(torch.empty(self.num_rows, self.dim),
                                       requires_grad=False)
            nn.init.normal_(self.weight, 0.0, init_std)
        else:
            from sampan.distributed import shard_bounds

            rank, world = shard
            self.bounds = shard_bounds(self.num_rows, world)
            self.weight = nn.Parameter(_normal_rows(
                self.num_rows, self.dim, init_std, self.bounds[rank], self.bounds[rank + 1]),
                requires_grad=False)
        self._lookups: list[tuple[Any, ...]] = []

    # ------------------------------------------------------------------ row sharding
    @property
    def sharded(self) -> bool:
        return self.bounds is not None

    def shard_rows_(self, rank: int, world: int) -> EmbeddingCollection:
        """Keep only this rank's contiguous rows (``weight`` becomes the local shard). Call
        inside a process group, before building optimizers; lookups then fetch rows from
        their owners and send gradients back (see :mod:`sampan.distributed`)."""
        from sampan.distributed import shard_bounds

        self.bounds = shard_bounds(self.num_rows, world)
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        self.weight = nn.Parameter(self.weight.detach()[lo:hi].clone(), requires_grad=False)
        return self

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        # checkpoints hold the whole table: a row-sharded collection keeps its rows
        key = prefix + "weight"
        if self.sharded and key in state_dict and state_dict[key].shape[0] == self.num_rows:
            from sampan.distributed import context

            r = context().rank
            state_dict = {**state_dict,
                          key: state_dict[key][self.bounds[r]: self.bounds[r + 1]]}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, F]`` (each column in its feature's range) -> ``[B, F, D]``."""
        return self.lookup(ids)[0]

    def lookup(self, ids: torch.Tensor, sequences: dict[str, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One gather for the sparse fields and the sequences:
        ``ids [B, F]`` -> ``[B, F, D]``, each ``sequences[name] [B, L]`` -> ``[B, L, D]``."""
        b, f = ids.shape
        parts = [(ids + self.offsets).reshape(-1)]
        shapes = [(b, f)]
        for name, seq in (sequences or {}).items():
            if name not in self.shared_offset:
                raise KeyError(f"sequence {name!r} has no table here; known: "
                               f"{sorted(self.shared_offset)}")
            parts.append((seq + self.shared_offset[name]).reshape(-1))
            shapes.append(tuple(seq.shape))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.sharded:
            from sampan.distributed import fetch_rows

            uniq, inverse = torch.unique(flat, return_inverse=True)
            rows, route = fetch_rows(uniq, self.weight.detach(), self.bounds)
            if self.training and torch.is_grad_enabled():
                rows.requires_grad_()
                self._lookups.append((uniq, rows, route))
                out = _GatherRows.apply(rows, inverse)
            else:
                out = rows.index_select(0, inverse)
        elif not (self.training and torch.is_grad_enabled()):
            out = F.embedding(flat, self.weight)
        else:
            uniq, inverse = torch.unique(flat, return_inverse=True)
            rows = self.weight.detach().index_select(0, uniq).requires_grad_()
            self._lookups.append((uniq, rows))
            out = _GatherRows.apply(rows, inverse)
        chunks = out.split([p.numel() for p in parts]) if len(parts) > 1 else [out]
        views = [c.view(*shape, self.dim) for c, shape in zip(chunks, shapes, strict=True)]
        return views[0], dict(zip((sequences or {}).keys(), views[1:], strict=True))

    def pop_lookups(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Unique row ids ``[U]`` and their summed gradients ``[U, D]`` since the last call.

        Several lookups in one step are merged so each row is updated once.
        """
        from sampan import distributed

        if self.sharded:  # gradients go back to the rows' owners; local row indices out
            served, grads = [], []
            for _, r, route in self._lookups:
                g = r.grad if r.grad is not None else torch.zeros_like(r)
                ids, back = distributed.return_grads(g, route)
                served.append(ids)
                grads.append(back)
            self._lookups.clear()
            if not served:
                return None
            ids = torch.cat(served) - self.bounds[distributed.context().rank]
            uniq, inv = torch.unique(ids, return_inverse=True)
            merged = self.weight.new_zeros(len(uniq), self.dim)
            merged.index_add_(0, inv, torch.cat(grads))
            return uniq, merged
        looks = [(u, r.grad) for u, r in self._lookups if r.grad is not None]
        self._lookups.clear()

        if distributed.context().enabled:  # replicated table: every rank, same update
            if not looks:
                looks = [(torch.empty(0, dtype=torch.long, device=self.weight.device),
                          self.weight.new_zeros(0, self.dim))]
            return distributed.merge_sparse(torch.cat([u for u, _ in looks]),
                                            torch.cat([g for _, g in looks]))
        if not looks:
            return None
        if len(looks) == 1:
            return looks[0]
        ids = torch.cat([u for u, _ in looks])
        grads = torch.cat([g for _, g in looks])
        uniq, inv = torch.unique(ids, return_inverse=True)
        merged = torch.zeros(len(uniq), self.dim, dtype=grads.dtype, device=grads.device)
        merged.index_add_(0, inv, grads)
        return uniq, merged

    def clear_lookups(self) -> None:
        """Forget pending gradients (e.g. after a step skipped for a non-finite loss)."""
        self._lookups.clear()

    def extra_repr(self) -> str:
        return f"features={len(self.tables)}, rows={self.num_rows}, dim={self.dim}"
