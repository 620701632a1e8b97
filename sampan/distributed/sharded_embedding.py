"""Embedding tables in a data-parallel run, applied to a built model from outside (as
TorchRec's DistributedModelParallel does): :func:`distribute_embeddings` replaces every
:class:`~sampan.embedding.EmbeddingCollection` of the model with

* a :class:`ReplicatedCollection`: the whole table on every process; each step's row
  gradients are all-gathered and merged, so every process applies the same sparse update
  and the replicas stay equal;
* or a :class:`RowShardedCollection`: process ``k`` of ``W`` holds rows
  ``bounds[k]:bounds[k + 1]`` (and their optimizer state). A lookup sends each unique id to
  its owner and gets the row back (``all_to_all`` both ways); the backward sends each row's
  gradient to its owner, which alone updates it. A dynamic table's key -> row map is kept
  whole on every process (the same on all: each admits the global batch's keys); its rows
  are sharded.

A model built from a schema whose tables are deferred (``schema.with_table_device("meta")``)
never allocates a whole table: each process materialises only the rows it keeps, with the
values those rows have in a plain build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sampan.distributed.collectives import all_gather_rows
from sampan.embedding.collection import EmbeddingCollection, dedup, merge_rows
from sampan.embedding.dynamic import KeyIndex


def shard_bounds(rows: int, world: int) -> list[int]:
    """Row boundaries of ``world`` contiguous shards of a ``rows``-row table."""
    return [rows * k // world for k in range(world + 1)]


@dataclass
class _Route:
    """How one lookup's unique ids travelled: counts each way and the ids this rank
    served (global rows), for sending their gradients back."""

    sent: list[int]
    received: list[int]
    served: torch.Tensor


def fetch_rows(uniq: torch.Tensor, shard: torch.Tensor, bounds: list[int], rank: int
               ) -> tuple[torch.Tensor, _Route]:
    """Rows ``[U, D]`` of the sorted unique global ids ``uniq`` from the ranks that own them
    (rank ``k`` holds rows ``bounds[k]:bounds[k + 1]`` in ``shard``): ids go out with one
    ``all_to_all``, rows come back with another."""
    w = len(bounds) - 1
    owner = torch.bucketize(uniq, torch.tensor(bounds[1:], device=uniq.device), right=True)
    sent = torch.bincount(owner, minlength=w)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)
    sent_l, received_l = sent.tolist(), received.tolist()
    served = torch.empty(sum(received_l), dtype=uniq.dtype, device=uniq.device)
    dist.all_to_all_single(served, uniq.contiguous(), received_l, sent_l)
    rows_out = shard.index_select(0, served - bounds[rank])
    rows = torch.empty(len(uniq), shard.shape[1], dtype=shard.dtype, device=shard.device)
    dist.all_to_all_single(rows, rows_out.contiguous(), sent_l, received_l)
    return rows, _Route(sent_l, received_l, served)


def return_grads(grads: torch.Tensor, route: _Route) -> tuple[torch.Tensor, torch.Tensor]:
    """Send row gradients back to the owners: ``(global ids served here, their grads)``."""
    back = torch.empty(sum(route.received), grads.shape[1], dtype=grads.dtype,
                       device=grads.device)
    dist.all_to_all_single(back, grads.contiguous(), route.received, route.sent)
    return route.served, back


def admit_global_batch(index: KeyIndex, keys: torch.Tensor, tables: torch.Tensor | None,
                       step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A key map's training lookup in a data-parallel run: every process admits the keys
    (of ``tables``) of the whole global batch (gathered in rank order), so every process's
    key -> row map stays the same; returns this process's keys' rows and the index rows
    freed."""
    _, freed = index.admit(all_gather_rows(keys), step,
                           None if tables is None else all_gather_rows(tables))
    return index.find(keys, tables), freed


class ReplicatedCollection(EmbeddingCollection):
    """The whole table on every process: the row gradients of all processes are merged
    before the sparse update, so every replica takes the same one. A dynamic table admits
    the keys of the whole global batch (gathered, in rank order) on every process, so every
    replica's key -> row map stays the same too."""

    def __init__(self, plain: EmbeddingCollection):
        nn.Module.__init__(self)
        self._copy_layout(plain)
        self.weight = plain.weight if not plain.deferred else nn.Parameter(
            plain.initial_rows(), requires_grad=False)

    def _admit(self, index: KeyIndex, keys: torch.Tensor, tables: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return admit_global_batch(index, keys, tables, int(self.dynamic_step))

    def pop_lookups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every process's ``(row ids, gradients)`` merged: the same on every process (a
        collective: every process calls it each step, with rows or without)."""
        looks = self._take_grads()
        ids = torch.cat([u for u, _ in looks]) if looks else \
            torch.empty(0, dtype=torch.long, device=self.weight.device)
        grads = torch.cat([g for _, g in looks]) if looks else self.weight.new_zeros(0, self.dim)
        return merge_rows(all_gather_rows(ids), all_gather_rows(grads))


class RowShardedCollection(EmbeddingCollection):
    """Process ``rank``'s contiguous rows ``[lo, hi)`` of a fused table; ``weight`` is that
    shard. Lookups take global row ids and fetch rows from their owners; :meth:`pop_lookups`
    gives this process's rows (local indices) with the gradients every process sent them."""

    def __init__(self, plain: EmbeddingCollection, rank: int, world: int):
        nn.Module.__init__(self)
        self._copy_layout(plain)
        self.rank, self.world = rank, world
        self.bounds = shard_bounds(self.num_rows, world)
        self.lo, self.hi = self.bounds[rank], self.bounds[rank + 1]
        rows = plain.initial_rows(self.lo, self.hi) if plain.deferred else \
            plain.weight.detach()[self.lo: self.hi].clone()
        self.weight = nn.Parameter(rows, requires_grad=False)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        # a state dict that holds the whole table: this process keeps its rows
        key = prefix + "weight"
        if key in state_dict and state_dict[key].shape[0] == self.num_rows:
            # in place, as the base class rewrites old key maps (its children read the dict)
            state_dict[key] = state_dict[key][self.lo: self.hi]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _gather(self, flat: torch.Tensor) -> torch.Tensor:
        d = dedup(flat, self.num_rows)
        rows, route = fetch_rows(d.uniq, self.weight.detach(), self.bounds, self.rank)
        if not (self.training and torch.is_grad_enabled()):
            return rows.index_select(0, d.inverse)
        return self._track(d, rows, route)

    # A dynamic table's key -> row map is the same on every process (each admits the
    # global batch's keys, as a replicated table does: the map is small next to the rows it
    # points to); its rows are sharded like any other, and each process renews the freed
    # rows it holds.
    def _admit(self, index: KeyIndex, keys: torch.Tensor, tables: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return admit_global_batch(index, keys, tables, int(self.dynamic_step))

    def _renew(self, rows: torch.Tensor) -> None:
        fresh = self._fresh_rows(rows)  # all of them: the draw is the plain table's
        mine = (rows >= self.lo) & (rows < self.hi)
        local = rows[mine] - self.lo
        with torch.no_grad():
            self.weight.index_copy_(0, local, fresh[mine])
        self._reset.append(local)  # the optimizer state of this shard is local-indexed

    def pop_lookups(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This process's rows (local indices) and the gradients sent to them (a
        collective, like the lookups)."""
        looks = []
        for _, r, route in self._lookups:
            looks.append(return_grads(r.grad if r.grad is not None else torch.zeros_like(r),
                                      route))
        self._lookups.clear()
        looks = self._unfrozen(looks)  # global rows: the default rows are never updated
        if not looks:
            return None
        return merge_rows(torch.cat([u for u, _ in looks]) - self.lo,
                          torch.cat([g for _, g in looks]))


def distribute_embeddings(model: nn.Module, shard: Callable[[int], bool], rank: int,
                          world: int) -> nn.Module:
    """Replace every plain :class:`EmbeddingCollection` of ``model`` (in place; a
    collection given as the model is returned replaced) with a
    :class:`RowShardedCollection` where ``shard(weight bytes)`` is true, else a
    :class:`ReplicatedCollection`. Call before building optimizers."""
    done: dict[int, EmbeddingCollection] = {}

    def replaced(c: EmbeddingCollection) -> EmbeddingCollection:
        if id(c) not in done:
            nbytes = c.num_rows * c.dim * c.weight.element_size()
            done[id(c)] = RowShardedCollection(c, rank, world) if shard(nbytes) else \
                ReplicatedCollection(c)
        return done[id(c)]

    if type(model) is EmbeddingCollection:
        return replaced(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is EmbeddingCollection:
                setattr(parent, name, replaced(child))
    return model
