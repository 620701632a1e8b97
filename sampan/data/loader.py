"""BatchLoader: slices the processed arrays into Batches, shuffles, prefetches in a thread.

On a GPU with room for the split, ``device=`` keeps the arrays there (copied once) and
gathers each batch on the device: no host gather, no pinned buffer, no copy per step. The
batches are the same rows in the same order as from the host.

Shuffling is a pure function of ``(seed, epoch)``, so a run resumed at ``(epoch, batch)``
sees exactly the batches the uninterrupted run would have seen.

Example::

    >>> import numpy as np
    >>> from sampan.data.store import SplitArrays
    >>> arr = SplitArrays(dense=np.zeros((10, 2), np.float32), sparse=np.zeros((10, 3), np.int64),
    ...                   labels=np.zeros((10, 1), np.float32))
    >>> [b.size for b in BatchLoader(arr, batch_size=4, shuffle="none")]
    [4, 4, 2]
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from sampan.batch import Batch
from sampan.data.store import SplitArrays
from sampan.data.threads import prefetch


class BatchLoader:
    """Iterates a :class:`SplitArrays` in batches.

    ``shuffle``: ``rows`` permutes all rows each epoch; ``blocks`` permutes contiguous
    blocks of ``block_rows`` (cheaper on data larger than memory); ``none`` keeps file order.
    ``prefetch`` batches are prepared ahead in a background thread (NumPy gathers and
    ``torch.from_numpy`` release the GIL, so this overlaps with the training step).

    ``device``: the arrays are copied to that device once (ids keep their stored width) and
    each batch is gathered there; the device's own queue then runs ahead of the step, so no
    thread is needed.
    """

    def __init__(self, data: SplitArrays, batch_size: int, shuffle: str = "rows",
                 seed: int = 0, drop_last: bool = False, prefetch: int = 2,
                 pin_memory: bool = False, block_rows: int = 65536,
                 drop_singleton: bool = False, rank: int = 0, world: int = 1,
                 device: torch.device | str | None = None):
        if shuffle not in ("rows", "blocks", "none"):
            raise ValueError(f"shuffle must be 'rows', 'blocks' or 'none', got {shuffle!r}")
        self.data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.block_rows = block_rows
        # A last batch of one row breaks batch norm in training; with shuffling a different
        # row sits out each epoch.
        self.drop_singleton = drop_singleton
        # Data parallel: every rank draws the same global batches and keeps its part of each.
        self.rank, self.world = rank, world
        self.epoch = 0
        self.start_batch = 0
        self.device = torch.device(device) if device is not None else None
        self._resident: dict[str, torch.Tensor | None] | None = None

    def __len__(self) -> int:
        n = len(self.data)
        # the last global batch must give each rank two rows or more (batch norm)
        smallest = 2 * self.world if self.drop_singleton else 1
        if self.drop_last or (0 < n % self.batch_size < smallest and n > self.batch_size):
            return n // self.batch_size
        return -(-n // self.batch_size)

    def global_rows(self, i: int) -> int:
        """Rows of global batch ``i`` over all ranks."""
        return min(len(self.data), (i + 1) * self.batch_size) - i * self.batch_size

    def set_position(self, epoch: int, batch: int = 0) -> None:
        """Where the next iteration starts (used when resuming a run)."""
        self.epoch, self.start_batch = epoch, batch

    def _order(self) -> np.ndarray | None:
        n = len(self.data)
        if self.shuffle == "none":
            return None
        rng = np.random.default_rng([self.seed, self.epoch])
        if self.shuffle == "rows":
            return rng.permutation(n)
        nblocks = -(-n // self.block_rows)
        blocks = rng.permutation(nblocks)
        return np.concatenate([np.arange(b * self.block_rows, min(n, (b + 1) * self.block_rows))
                               for b in blocks])

    def _bounds(self, i: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` in the epoch's order of this rank's rows of batch ``i``."""
        lo, hi = i * self.batch_size, min(len(self.data), (i + 1) * self.batch_size)
        if self.world > 1:  # this rank's contiguous part of the global batch
            n = hi - lo
            lo, hi = lo + n * self.rank // self.world, lo + n * (self.rank + 1) // self.world
        return lo, hi

    def _make(self, order: np.ndarray | None, i: int) -> Batch:
        lo, hi = self._bounds(i)
        if order is None:
            sel: slice | np.ndarray = slice(lo, hi)
        else:
            sel = np.sort(order[lo:hi])  # sorted gathers are friendlier to memory-mapped pages

        def take(a: np.ndarray | None, ids: bool = False) -> torch.Tensor | None:
            # A slice of a read-only memory map is a view: copy it so the tensor owns its
            # data. Ids may be stored as int32; the Batch carries int64.
            if a is None:
                return None
            part = a[sel]
            if ids and part.dtype != np.int64:
                return torch.from_numpy(part.astype(np.int64))
            return torch.from_numpy(np.array(part, copy=True))

        d = self.data
        seqs = {k: take(v, ids=True) for k, v in d.sequences.items()} if d.sequences else None
        batch = Batch(dense=take(d.dense), sparse=take(d.sparse, ids=True),
                      labels=take(d.labels), group=take(d.group), oracle=take(d.oracle),
                      sequences=seqs)
        return batch.pin_memory() if self.pin_memory else batch

    def _on_device(self) -> dict[str, torch.Tensor | None]:
        """The split's arrays on ``self.device``, copied at the first use."""
        if self._resident is None:
            d, dev = self.data, self.device

            def put(a: np.ndarray | None) -> torch.Tensor | None:
                return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(dev)

            self._resident = {k: put(getattr(d, k))
                              for k in ("dense", "sparse", "labels", "group", "oracle")}
            for k, v in (d.sequences or {}).items():
                self._resident["seq:" + k] = put(v)
        return self._resident

    def _make_on_device(self, order: torch.Tensor | None, i: int) -> Batch:
        lo, hi = self._bounds(i)
        sel = None if order is None else torch.sort(order[lo:hi]).values

        def take(t: torch.Tensor | None, ids: bool = False) -> torch.Tensor | None:
            if t is None:
                return None
            part = t[lo:hi].clone() if sel is None else t.index_select(0, sel)
            return part.long() if ids else part

        r = self._on_device()
        seqs = {k[4:]: take(v, ids=True) for k, v in r.items() if k.startswith("seq:")}
        return Batch(dense=take(r["dense"]), sparse=take(r["sparse"], ids=True),
                     labels=take(r["labels"]), group=take(r["group"]),
                     oracle=take(r["oracle"]), sequences=seqs or None)

    def __iter__(self) -> Iterator[Batch]:
        order = self._order()
        indices = range(self.start_batch, len(self))
        self.start_batch = 0
        if self.device is not None:  # on the device: its queue runs ahead, no thread
            dev_order = None if order is None else torch.from_numpy(order).to(self.device)
            yield from (self._make_on_device(dev_order, i) for i in indices)
            return
        batches = (self._make(order, i) for i in indices)
        if self.prefetch <= 0:
            yield from batches
        else:
            yield from prefetch(batches, self.prefetch, name="sampan-loader")
