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

import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sampan import native
from sampan.embedding.dynamic import KeyIndex
from sampan.embedding.pages import advise_huge_pages, huge_empty
from sampan.schema import TableSpec


class Dedup(NamedTuple):
    """The unique values of ``flat`` and how its entries group: ``uniq[inverse] == flat``;
    ``order`` lists the positions of ``flat`` sorted by value (stable) and ``counts`` how
    many there are of each unique value, so ``order`` holds the positions of ``uniq[0]``,
    then those of ``uniq[1]``, ... (what a per-row sum of gradients walks)."""

    uniq: torch.Tensor
    inverse: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor


def dedup(flat: torch.Tensor, bound: int | None = None) -> Dedup:
    """:class:`Dedup` of the 1-D ``flat``, in one stable sort. ``bound``: the values are
    known to lie in ``[0, bound)``; on the CPU that sort is then a radix sort over the bits
    ``bound`` needs, in C (:mod:`sampan.native`; about 5x faster than ``torch.sort`` for a
    Criteo batch's 106,496 ids), or where the C kernels are not built, ``torch.sort`` of
    int32 keys when they fit (about twice as fast as int64)."""
    if (bound is not None and bound <= 2**32 and flat.device.type == "cpu"
            and flat.dtype == torch.int64 and len(flat) < 2**31
            and native.library() is not None):
        got = native.sort_dedup(flat.contiguous(), bound)  # one radix sort, in C
        if got is not None:
            return Dedup(*got)
    keys = flat
    if bound is not None and bound <= 2**31 and flat.device.type == "cpu":
        keys = flat.to(torch.int32)
    values, order = torch.sort(keys, stable=True)
    uniq, counts = torch.unique_consecutive(values, return_counts=True)
    inverse = torch.empty_like(flat)
    inverse[order] = torch.repeat_interleave(torch.arange(len(uniq), device=flat.device),
                                             counts, output_size=len(flat))
    return Dedup(uniq.to(flat.dtype), inverse, order, counts)


def segment_sum(grads: torch.Tensor, d: Dedup) -> torch.Tensor:
    """``[U, D]``: row ``u`` the sum of the rows of ``grads [N, D]`` at the positions of
    ``d.uniq[u]``, in position order (what ``zeros(U, D).index_add_(0, d.inverse, grads)``
    gives). On the CPU for fp32, one C pass over the groups (:mod:`sampan.native`), else a
    sparse ``[U, N]`` x ``[N, D]`` product, 2-3x faster than ``index_add_``; on accelerators
    (atomic adds) and for other dtypes, ``index_add_``."""
    if grads.device.type == "cpu" and grads.dtype == torch.float32 and \
            native.library() is not None:
        return native.segment_sum(grads.contiguous(), d.order.contiguous(),
                                  d.counts.contiguous())
    if grads.device.type == "cpu" and grads.dtype in (torch.float32, torch.float64):
        crow = torch.zeros(len(d.counts) + 1, dtype=torch.int64)
        torch.cumsum(d.counts, 0, out=crow[1:])
        select = csr(crow, d.order, torch.ones(len(d.order), dtype=grads.dtype),
                     (len(d.counts), len(d.order)))
        return select @ grads
    out = torch.zeros(len(d.counts), grads.shape[1], dtype=grads.dtype, device=grads.device)
    return out.index_add_(0, d.inverse, grads)


def csr(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
        shape: tuple[int, int]) -> torch.Tensor:
    """A CSR matrix from indices the caller built valid (not checked again), without
    PyTorch's notice that CSR support is in beta (a stable, tested use here: it says nothing
    to a Sampan user)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, val, shape, check_invariants=False)


class _GatherRows(torch.autograd.Function):
    """``rows[inverse]`` whose backward sums the gradients of each row with one
    :func:`segment_sum` (several times faster on CPU than ``embedding_dense_backward`` at
    CTR batch shapes)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, d: Dedup) -> torch.Tensor:
        ctx.d = d
        return rows.index_select(0, d.inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return segment_sum(grad.contiguous(), ctx.d), None


_INIT_BLOCK_ROWS = 1 << 16  # a multiple of 16: see _normal_rows


def _normal_rows(rows: int, dim: int, std: float, lo: int, hi: int,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``torch.empty(rows, dim).normal_(0, std)``, drawing the same
    random stream (so ``generator``, the global one by default, ends in the same state) one
    block at a time: memory is one block and the rows kept, whatever the table's size.

    PyTorch's CPU ``normal_`` fills 16 values at a time; blocks of a multiple of 16 values
    continue the stream exactly, and the last block takes any remainder under 16 values.
    """
    out = huge_empty((hi - lo, dim), torch.get_default_dtype(), "cpu")  # (under "meta" too)
    start = 0
    while start < rows:
        end = min(start + _INIT_BLOCK_ROWS, rows)
        if (rows - end) * dim < 16:
            end = rows
        block = torch.empty(end - start, dim, device="cpu").normal_(0.0, std, generator=generator)
        a, b = max(start, lo), min(end, hi)
        if a < b:
            out[a - lo: b - lo] = block[a - start: b - start]
        start = end
    return out


def merge_rows(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique ids [U], summed gradients [U, D])`` of row gradients that may repeat ids."""
    d = dedup(ids)
    return d.uniq, segment_sum(grads, d)


class EmbeddingCollection(nn.Module):
    """One fused table for ``tables`` (all of one dim), looked up by ``ids [B, F]``.

    The weight is a ``Parameter`` with ``requires_grad=False``: dense optimizers skip it, and
    its updates come only from a sparse optimizer reading :meth:`pop_lookups`. Its initial
    values are ``normal(0, init_std)``, with the first ``zero_columns`` columns zero (the
    first-order weights of :class:`~sampan.layers.embed.FeatureEmbedding`).

    **Deferred tables.** Tables whose spec says ``device="meta"`` (see
    :meth:`DataSchema.with_table_device <sampan.schema.DataSchema.with_table_device>`), or
    built under ``with torch.device("meta")``, allocate nothing: the collection remembers
    where the random stream stood and moves it on as drawing the table would (block by
    block), so everything built after it gets the values it gets in a plain build.
    :meth:`initial_rows` then gives any rows' initial values and :meth:`materialize_`
    allocates the whole table; the data-parallel strategy (:mod:`sampan.distributed`) uses
    them to give each process only the rows it keeps.

    **Dynamic tables.** A table whose spec has ``dynamic`` is looked up by 64-bit keys, not
    ids: a :class:`~sampan.embedding.dynamic.KeyIndex` maps them to its rows, admitting and
    evicting keys in training lookups and only reading in evaluation. Tables with the same
    admission and eviction settings share one map (``self.dynamic``, named by its tables
    joined with ``+``; :meth:`key_index` finds a table's), each with its own rows and
    eviction, so a batch's keys of all of them are one call. Row 0 of such a table is the
    default row of every key without one (and of key 0, padding); it is never updated. A
    row freed by eviction is drawn again from the initial distribution before its new key
    uses it, and :meth:`pop_reset_rows` tells the sparse optimizer to reset its state. The
    step of admission and eviction advances at every :meth:`pop_lookups` (one per
    optimizer step).
    """

    def __init__(self, tables: list[TableSpec], init_std: float = 0.01,
                 zero_columns: int = 0):
        super().__init__()
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"a fused EmbeddingCollection needs one dim, got {sorted(dims)}")
        devices = {t.device for t in tables}
        if len(devices) != 1:
            raise ValueError(f"a fused EmbeddingCollection lives on one device, got {devices}")
        self.tables = list(tables)
        self.dim = dims.pop()
        self.init_std, self.zero_columns = init_std, zero_columns
        rows = [t.rows for t in tables]
        self.num_rows = sum(rows)
        offsets = torch.tensor([0, *rows[:-1]], dtype=torch.int64).cumsum(0)
        fields = [i for i, t in enumerate(tables) if t.field]
        self.register_buffer("offsets", offsets[fields].clone(), persistent=False)
        # List features (sequences, bags) read their table by name.
        self.shared_offset = {name: int(offsets[i]) for i, t in enumerate(tables)
                              for name in (t.features if not t.field else t.features[1:])}
        self._dynamic_tables(offsets)
        self.weight = nn.Parameter(torch.empty(self.num_rows, self.dim, device=devices.pop()),
                                   requires_grad=False)
        self._init_state: torch.Tensor | None = None
        if self.weight.is_meta:  # deferred: see the class docstring
            self._init_state = torch.get_rng_state()
            _normal_rows(self.num_rows, self.dim, init_std, 0, 0)
        else:
            advise_huge_pages(self.weight)  # before the first write: see pages.py
            nn.init.normal_(self.weight, 0.0, init_std)
            with torch.no_grad():
                self.weight[:, :zero_columns].zero_()
        self._lookups: list[tuple[Any, ...]] = []

    def _dynamic_tables(self, offsets: torch.Tensor) -> None:
        """The key maps of the dynamic tables: one :class:`KeyIndex` for every group of
        tables with the same admission and eviction settings (usually one for all), so a
        batch's keys of every table are one call; and where each table's keys are (columns
        of ``ids``, sequences by name)."""
        self.dynamic = nn.ModuleDict()
        groups: dict[tuple[Any, ...], list[tuple[int, TableSpec]]] = {}
        for i, t in enumerate(self.tables):
            if t.dynamic is not None:
                if t.rows != t.dynamic.capacity + 1:
                    raise ValueError(f"dynamic table {t.name!r}: {t.rows} rows, expected its "
                                     f"capacity + 1 = {t.dynamic.capacity + 1} (row 0 is the "
                                     "default)")
                d = t.dynamic
                groups.setdefault((d.min_count, d.probability, d.policy, d.ttl_steps,
                                   d.evict_fraction), []).append((i, t))
        # table name -> (its key map's name, its number there, its default row's offset)
        self._dynamic_at: dict[str, tuple[str, int, int]] = {}
        self._dynamic_groups: dict[str, _KeyGroup] = {}
        fields = {i: n for n, i in enumerate(i for i, t in enumerate(self.tables) if t.field)}
        for members in groups.values():
            name = "+".join(t.name for _, t in members)
            d = members[0][1].dynamic
            assert d is not None
            self.dynamic[name] = KeyIndex(
                [t.dynamic.capacity for _, t in members],  # type: ignore[union-attr]
                min_count=d.min_count, probability=d.probability,
                policy=d.policy, ttl_steps=d.ttl_steps,  # type: ignore[arg-type]
                evict_fraction=d.evict_fraction)
            cols, col_tables, seqs = [], [], []
            for n, (i, t) in enumerate(members):
                self._dynamic_at[t.name] = (name, n, int(offsets[i]))
                if t.field:
                    cols.append(fields[i])
                    col_tables.append(n)
                seqs += [(f, n) for f in (t.features[1:] if t.field else t.features)]
            self._dynamic_groups[name] = _KeyGroup(
                torch.tensor(cols, dtype=torch.int64), torch.tensor(col_tables, dtype=torch.int64),
                seqs, torch.tensor([int(offsets[i]) for i, _ in members], dtype=torch.int64))
        self.register_buffer("frozen_rows", torch.tensor(
            [at for _, _, at in self._dynamic_at.values()], dtype=torch.int64), persistent=False)
        if self._dynamic_at:
            self.register_buffer("dynamic_step", torch.zeros((), dtype=torch.int64))
        self._reset: list[torch.Tensor] = []
        # an exported graph takes rows: the served pipeline maps keys through a frozen map
        self.keys_are_rows = False

    def key_index(self, table: str) -> tuple[KeyIndex, int]:
        """Dynamic table ``table``'s key map and its number in that map."""
        name, n, _ = self._dynamic_at[table]
        return self.dynamic[name], n  # type: ignore[return-value]

    @property
    def dynamic_names(self) -> list[str]:
        """The names of the dynamic tables."""
        return list(self._dynamic_at)

    def find_keys(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """Dynamic table ``table``'s rows of ``keys`` (its own rows; 0: no row), on the
        map's device; changes nothing."""
        index, n = self.key_index(table)
        keys = keys.to(index.row_key.device)
        return index.find(keys, torch.full_like(keys, n) if index.tables > 1 else None)

    def dynamic_summary(self) -> dict[str, dict[str, int]]:
        """Each dynamic table's capacity, rows in use and rows evicted so far."""
        return {t: self.key_index(t)[0].summary(self.key_index(t)[1]) for t in self._dynamic_at}

    def frozen_maps(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each dynamic table's live ``(keys, rows)``, sorted by key: the map an export
        freezes into the bundle's feature pipeline."""
        out = {}
        for table in self._dynamic_at:
            index, n = self.key_index(table)
            keys, rows = index.table_live(n)
            order = torch.argsort(keys)
            out[table] = (keys[order].cpu(), rows[order].cpu())
        return out

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        _join_old_key_maps(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _copy_layout(self, other: EmbeddingCollection) -> None:
        """Take ``other``'s tables, offsets and initial values (for a module that replaces
        it, e.g. one process's rows of it); the weight is the caller's to set."""
        self.tables, self.dim, self.num_rows = other.tables, other.dim, other.num_rows
        self.init_std, self.zero_columns = other.init_std, other.zero_columns
        self.register_buffer("offsets", other.offsets, persistent=False)
        self.shared_offset = other.shared_offset
        self._init_state = other._init_state
        self._lookups = []
        self.dynamic, self._dynamic_at = other.dynamic, other._dynamic_at
        self._dynamic_groups = other._dynamic_groups
        self._reset, self.keys_are_rows = [], False
        self.register_buffer("frozen_rows", other.frozen_rows, persistent=False)
        if other._dynamic_at:
            self.register_buffer("dynamic_step", other.dynamic_step)

    # ------------------------------------------------------------ deferred tables
    @property
    def deferred(self) -> bool:
        """Built on the meta device: no values yet (see :meth:`materialize_`)."""
        return self.weight.is_meta

    def initial_rows(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of a deferred table's initial values, on the CPU: exactly those
        a plain build of the table draws. The global random stream is not touched."""
        if self._init_state is None:
            raise RuntimeError("initial_rows: this table was not built deferred (its values "
                               "are in .weight)")
        hi = self.num_rows if hi is None else hi
        gen = torch.Generator()
        gen.set_state(self._init_state)
        rows = _normal_rows(self.num_rows, self.dim, self.init_std, lo, hi, generator=gen)
        rows[:, : self.zero_columns] = 0.0
        return rows

    def materialize_(self) -> EmbeddingCollection:
        """Allocate a deferred table whole, with its initial values (no-op otherwise)."""
        if self.deferred:
            self.weight = nn.Parameter(self.initial_rows(), requires_grad=False)
        return self

    # ------------------------------------------------------------------- lookups
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, F]`` (each column in its feature's range) -> ``[B, F, D]``."""
        return self.lookup(ids)[0]

    def lookup(self, ids: torch.Tensor, sequences: dict[str, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One gather for the sparse fields and the sequences:
        ``ids [B, F]`` -> ``[B, F, D]``, each ``sequences[name] [B, L]`` -> ``[B, L, D]``."""
        b, f = ids.shape
        if self._dynamic_at:
            if not self.keys_are_rows:
                ids, sequences = self.rows_of_keys(ids, sequences)
            # -1: a key without a row, which reads the default row (0 stays padding for
            # the model's masks, which read the batch, not these rows)
            ids = ids.clamp_min(0)
            sequences = {n: s.clamp_min(0) for n, s in sequences.items()} \
                if sequences else sequences
        parts = [(ids + self.offsets).reshape(-1)]
        shapes = [(b, f)]
        for name, seq in (sequences or {}).items():
            if name not in self.shared_offset:
                raise KeyError(f"sequence {name!r} has no table here; known: "
                               f"{sorted(self.shared_offset)}")
            parts.append((seq + self.shared_offset[name]).reshape(-1))
            shapes.append(tuple(seq.shape))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = self._gather(flat)
        chunks = out.split([p.numel() for p in parts]) if len(parts) > 1 else [out]
        views = [c.view(*shape, self.dim) for c, shape in zip(chunks, shapes, strict=True)]
        return views[0], dict(zip((sequences or {}).keys(), views[1:], strict=True))

    def rows_of_keys(self, ids: torch.Tensor, sequences: dict[str, torch.Tensor] | None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """``ids`` and ``sequences`` with every dynamic table's keys replaced by its rows
        (one KeyIndex call for all the tables of a key map, their columns and sequences
        together; admitting in training, reading otherwise): 0 stays 0 (padding), a key
        without a row becomes -1 (it reads the default row, but is not padding), as the
        served pipeline gives them."""
        training = self.training and torch.is_grad_enabled()
        ids = ids.clone()
        seqs = dict(sequences or {})
        b = ids.shape[0]
        for name, g in self._dynamic_groups.items():
            index = self.dynamic[name]
            several = index.tables > 1
            parts, tabs = [], []
            if len(g.cols):
                parts.append(ids.index_select(1, g.cols.to(ids.device)).reshape(-1))
                if several:
                    tabs.append(g.col_tables.to(ids.device).repeat(b))
            here = [(s, n) for s, n in g.seqs if s in seqs]
            for s, n in here:
                parts.append(seqs[s].reshape(-1))
                if several:
                    tabs.append(torch.full_like(parts[-1], n))
            if not parts:
                continue
            keys = torch.cat(parts) if len(parts) > 1 else parts[0]
            tables = (torch.cat(tabs) if len(tabs) > 1 else tabs[0]) if several else None
            real = (keys != 0).nonzero().squeeze(1)  # padding reads the default row
            k = keys.index_select(0, real)
            t = tables.index_select(0, real) if tables is not None else None
            if training:
                got, freed = self._admit(index, k, t)
                if len(freed):
                    self._renew(g.offsets.to(freed.device).index_select(
                        0, index.table_of(freed)) + index.local(freed))
            else:
                got = index.find(k, t)
            rows = torch.zeros_like(keys)
            rows.index_copy_(0, real, torch.where(got > 0, got, -1))
            chunks = iter(rows.split([p.numel() for p in parts]))
            if len(g.cols):
                ids[:, g.cols.to(ids.device)] = next(chunks).view(b, len(g.cols))
            for s, _ in here:
                seqs[s] = next(chunks).view(seqs[s].shape)
        return ids, (seqs if sequences is not None else None)

    def _admit(self, index: KeyIndex, keys: torch.Tensor, tables: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training lookup of ``keys`` (of ``tables``) in a key map: rows and the
        index rows freed."""
        return index.admit(keys, int(self.dynamic_step), tables)

    def _renew(self, rows: torch.Tensor) -> None:
        """Rows given to new keys: drawn again from the initial distribution, and their
        optimizer state to be reset (see :meth:`pop_reset_rows`)."""
        fresh = self._fresh_rows(rows)
        with torch.no_grad():
            self.weight.index_copy_(0, rows, fresh)
        self._reset.append(rows)

    def _fresh_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """New initial values for the global rows ``rows``. The draw depends only on the
        step and the rows: every process of a data-parallel run draws the same."""
        gen = torch.Generator().manual_seed(int(self.dynamic_step) * 1_000_003 + int(rows[0]))
        fresh = torch.empty(len(rows), self.dim).normal_(0.0, self.init_std, generator=gen)
        fresh[:, : self.zero_columns] = 0.0
        return fresh.to(self.weight.device, self.weight.dtype)

    def pop_reset_rows(self) -> torch.Tensor | None:
        """Rows whose optimizer state must start again (freed and given to new keys)
        since the last call."""
        if not self._reset:
            return None
        rows = torch.cat(self._reset)
        self._reset.clear()
        return rows

    def _gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Rows ``[N, D]`` of the global row ids ``flat``; in training, the unique rows'
        gradients are kept for :meth:`pop_lookups`."""
        if not (self.training and torch.is_grad_enabled()):
            return F.embedding(flat, self.weight)
        d = dedup(flat, self.num_rows)
        return self._track(d, self.weight.detach().index_select(0, d.uniq))

    def _track(self, d: Dedup, rows: torch.Tensor, *extra: Any) -> torch.Tensor:
        """``rows[d.inverse]``, keeping ``rows`` (of the unique ids ``d.uniq``; and
        ``extra``, for a subclass) so their gradients reach :meth:`pop_lookups`."""
        rows.requires_grad_()
        self._lookups.append((d.uniq, rows, *extra))
        return _GatherRows.apply(rows, d)

    def _take_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(unique ids, row gradients)`` of every lookup since the last call."""
        looks = [(look[0], look[1].grad) for look in self._lookups if look[1].grad is not None]
        self._lookups.clear()
        return self._unfrozen(looks)

    def _unfrozen(self, looks: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(global rows, gradients)`` without the default rows of dynamic tables, which
        are never updated; the step of admission moves on (once per optimizer step)."""
        if not self._dynamic_at:
            return looks
        self.dynamic_step += 1
        keep = [~torch.isin(u, self.frozen_rows) for u, _ in looks]
        return [(u[k], g[k]) for (u, g), k in zip(looks, keep, strict=True)]

    def pop_lookups(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Unique row ids ``[U]`` and their summed gradients ``[U, D]`` since the last call.

        Several lookups in one step are merged so each row is updated once.
        """
        looks = self._take_grads()
        if len(looks) <= 1:
            return looks[0] if looks else None
        return merge_rows(torch.cat([u for u, _ in looks]), torch.cat([g for _, g in looks]))

    def clear_lookups(self) -> None:
        """Forget pending gradients (e.g. after a step skipped for a non-finite loss)."""
        self._lookups.clear()

    def extra_repr(self) -> str:
        return f"features={len(self.tables)}, rows={self.num_rows}, dim={self.dim}"


def dynamic_tables(model: nn.Module) -> list[str]:
    """Names of the dynamic tables of every collection in ``model``."""
    return sorted(name for m in model.modules() if isinstance(m, EmbeddingCollection)
                  for name in m.dynamic_names)


def dynamic_summary(model: nn.Module) -> dict[str, dict[str, int]]:
    """Each dynamic table's capacity, rows in use and rows evicted so far."""
    return {name: d for m in model.modules() if isinstance(m, EmbeddingCollection)
            for name, d in m.dynamic_summary().items()}


class _KeyGroup(NamedTuple):
    """Where a key map's keys are in a batch: ``cols`` of ``ids`` (with ``col_tables``, each
    column's table number in the map), ``seqs`` (sequence name, table number), and each
    table's default row in the fused weight (``offsets``)."""

    cols: torch.Tensor
    col_tables: torch.Tensor
    seqs: list[tuple[str, int]]
    offsets: torch.Tensor


_MAP_STATE = ("row_key", "row_stamp", "free", "n_free", "sketch", "sketch_total",
              "freed_total", "counting")


def _join_old_key_maps(coll: EmbeddingCollection, state: dict[str, Any], prefix: str) -> None:
    """A state dict from before tables with the same settings shared one key map (one map
    per table, under the table's name), rewritten in place into the shared maps' layout:
    the same keys in the same rows. The count-min sketches are not joined (each counted
    with its own hashes): where admission counts sightings, counting starts again."""
    for name, index in coll.dynamic.items():
        tables = name.split("+")
        old = [f"{prefix}dynamic.{t}." for t in tables]
        if len(tables) == 1 or f"{old[0]}row_key" not in state \
                or f"{prefix}dynamic.{name}.row_key" in state:
            continue
        assert isinstance(index, KeyIndex)
        parts = {k: [state.pop(o + k) for o in old] for k in _MAP_STATE if old[0] + k in state}
        new = f"{prefix}dynamic.{name}."
        starts = index.starts_list
        state[new + "row_key"] = torch.cat([parts["row_key"][0][:1]] +
                                           [r[1:] for r in parts["row_key"]])
        state[new + "row_stamp"] = torch.cat([parts["row_stamp"][0][:1]] +
                                             [r[1:] for r in parts["row_stamp"]])
        state[new + "free"] = torch.cat([f + a for f, a in zip(parts["free"], starts,
                                                                strict=False)])
        for k in ("n_free", "freed_total"):
            state[new + k] = torch.stack([x.reshape(()) for x in parts[k]])
        state[new + "sketch"] = index.sketch.clone()
        state[new + "sketch_total"] = torch.zeros((), dtype=torch.int64)
        state[new + "counting"] = torch.tensor(True)  # the sketch starts again: so do counts
