"""A collision-free map from 64-bit keys to embedding rows, for ID spaces with no fitted
vocabulary: admission, eviction and a fixed memory cap (the dynamic tables of issue 16).

:class:`KeyIndex` gives every admitted key a row of its own in ``[1, capacity]``; row 0 is
the shared default row that keys not admitted (or evicted) read. It is tensor operations
(CPU or GPU, no per-key Python), with the probe and the insert in C on the CPU
(:mod:`sampan.native`: one pass over the keys, the same rows and stamps):

* **the map** is an open-addressing hash table (linear probing, at most half full) whose
  slots hold a key and its row side by side (one cache line; row 0: empty, -1: deleted). A
  batch of keys probes all at once: the home slot first (where most keys end), then 8
  neighbouring slots per round, each round on the keys still searching;
* **admission**: a new key gets a row once it has been seen ``min_count`` times (counted
  in a count-min sketch of 4 rows of 8 to 16 counters per row of capacity (a power of
  two, 4,096 to ``sketch_width``); when more than 25 % of a row's counters are in use,
  checked every 1/32 of a row's width of sightings, all are halved, so a key seen once is
  admitted by collisions alone with a chance near 0.25 ** 4 = 0.4 % while a batch's new
  keys are a small share of the sketch, and, in a stream of ever new keys, a key must
  come back before its count fades), and then with probability ``probability`` (a hash
  of the key and the step, so a resumed run makes the same draws). A run over a file
  counts in its first pass over the training rows only (:meth:`KeyIndex.stop_counting`
  after it): ``min_count`` is then how often a key occurs in them, however many epochs
  read them;
* **eviction**: when a new key needs a row and none is free, the least recently used
  (``lru``, ``ttl``) or least frequently used (``lfu``; ties by recency) rows give theirs
  up, at least
  ``evict_fraction`` of the capacity at a time. The choice is exact: a sampled threshold
  narrows the candidates in one pass, then the lowest are taken from those; the rows under
  that threshold are kept, and later evictions take theirs from them (a stamp only grows)
  until too few are left or a row is given out under it, without another pass. Rows the
  current batch uses are never evicted. With ``ttl``, rows unseen for ``ttl_steps`` are
  also freed, full table or not (checked every ``ttl_steps / 8`` steps). The freed rows
  are returned, for their owner to re-initialise the weights and reset the optimizer state
  before reuse.

Memory is fixed by ``capacity`` (about ``capacity * 96`` bytes, plus the sketch when
``min_count`` > 1: 128 to 256 bytes a row, 64 KB to 16 MB), however many distinct keys
stream through. The map changes only in :meth:`KeyIndex.admit`, which
the training step calls in its own thread: no lookup ever reads a row while it is freed.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from sampan import native
from sampan.embedding.pages import huge_empty, huge_full

_WINDOW = 8  # slots looked at per probe round: 8 int64 keys are one or two cache lines
_LATE_WINDOW = 64  # per round for the few keys still searching after one: no third round
_SMALL_BATCH = 4096  # keys a probe or insert reads whole windows for from the first round
# rows above which eviction first cuts the table at a sampled threshold (below, one top-k
# of all rows is as cheap): at 1 M rows the cut is 5x faster than the top-k
_SAMPLED_EVICTION = 1 << 16
_MAX_FILL = 0.75  # full + deleted slots over all slots: rebuilt above it
_NEVER = torch.iinfo(torch.int64).max  # the stamp of a free row: never evicted, never seen
_FLOOR = torch.iinfo(torch.int64).min  # no eviction cut kept (see KeyIndex._cand)
_LOW32 = 0xFFFFFFFF
_SKETCH_SALTS = (0, 0x5BD1E995, 0x27D4EB2F, 0x165667B1)  # one hash per count-min row
_SKETCH_PER_ROW = 8  # counters per row of capacity (the sketch's width, before its bounds)
_SKETCH_MIN = 1 << 12
_SKETCH_FILL = 0.25  # counters in use above which all are halved
_TABLE_SALT = 0x3C6EF372FE94F82B  # mixed with a table's number: its keys' salt


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 (wrapping arithmetic): a bijection whose bits all
    depend on every input bit."""
    x = x + (-7046029254386353131)  # 0x9E3779B97F4A7C15
    x = (x ^ _srl(x, 30)) * (-4658895280553007687)  # 0xBF58476D1CE4E5B9
    x = (x ^ _srl(x, 27)) * (-7723592293110705685)  # 0x94D049BB133111EB
    return x ^ _srl(x, 31)


def _unique(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.unique(keys, return_inverse=True, return_counts=True)`` of a 1-d tensor, by
    one sort and a run-length pass (a quarter faster on CPU than ``torch.unique``)."""
    s, perm = torch.sort(keys)
    uniq, inv_sorted, counts = torch.unique_consecutive(s, return_inverse=True,
                                                        return_counts=True)
    inv = torch.empty_like(inv_sorted)
    inv.scatter_(0, perm, inv_sorted)
    return uniq, inv, counts


def _lowest_first(rows: torch.Tensor, stamps: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` of ``rows`` (ascending) with the lowest ``stamps``, lowest stamp first; ties
    at the cut go to the lower rows. ``torch.topk`` breaks ties differently on CPU and CUDA;
    this gives the same rows on both."""
    if n <= 0:
        return rows[:0]
    cut = torch.kthvalue(stamps, n).values
    below = stamps < cut
    take = below | ((stamps == cut) & ((stamps == cut).cumsum(0) <= n - below.sum()))
    chosen, st = rows[take], stamps[take]
    return chosen[torch.sort(st, stable=True).indices]


class KeyIndex(nn.Module):
    """Map int64 keys to rows ``[1, capacity]`` (0: not admitted); see the module docstring.

    Each row has a *stamp*, its eviction priority (lowest first): the step it was last seen
    (``lru``, ``ttl``), or its use count above the low 32 bits of that step (``lfu``).

    **Several tables in one map.** ``capacity`` may be a list, one capacity per table: the
    tables share every other setting, the map and the sketch, and a batch of all their keys
    is one call. Keys then come with their table (``tables``, the same shape); each table's
    keys are its own (key 7 of table 0 and key 7 of table 1 are two keys), and each table
    has its own rows ``[1, capacity[t]]``, free rows and eviction (a full table evicts its
    own rows only). Inside, the tables' rows follow one another, the *index rows* (table
    ``t``'s are ``starts[t] + 1 .. starts[t + 1]``); the map holds each key XORed with its
    table's salt (0 for table 0, so that a one-table index is the plain map) beside its
    index row, and a slot is a key's only when that row is in the key's table.

    >>> idx = KeyIndex(capacity=2)
    >>> idx.admit(torch.tensor([10, 7, 10]), step=1)[0].tolist()  # new keys: rows in key order
    [2, 1, 2]
    >>> idx.find(torch.tensor([7, 99])).tolist()         # 99: never seen
    [1, 0]
    >>> rows, freed = idx.admit(torch.tensor([5]), step=2)  # full: the LFU row (7's) gives way
    >>> rows.tolist(), freed.tolist(), idx.find(torch.tensor([7, 10])).tolist()
    ([1], [1], [0, 2])
    >>> two = KeyIndex(capacity=[2, 3])                  # two tables in one map
    >>> two.admit(torch.tensor([7, 7]), step=1, tables=torch.tensor([0, 1]))[0].tolist()
    [1, 1]
    >>> two.find(torch.tensor([7, 8]), tables=torch.tensor([1, 1])).tolist(), len(two)
    ([1, 0], 2)
    """

    native = True  # on the CPU, probe and insert with the C kernels where they are built

    def __init__(self, capacity: int | list[int], *, min_count: int = 1,
                 probability: float = 1.0, policy: Literal["lru", "lfu", "ttl"] = "lfu",
                 ttl_steps: int | None = None, evict_fraction: float = 0.01,
                 sketch_width: int = 1 << 20, device: str | torch.device | None = None):
        super().__init__()
        caps = [capacity] if isinstance(capacity, int) else [int(c) for c in capacity]
        if not caps or min(caps) < 1:
            raise ValueError(f"capacity must be 1 or more, got {capacity}")
        if policy not in ("lru", "lfu", "ttl"):
            raise ValueError(f"policy must be lru, lfu or ttl, got {policy!r}")
        if policy == "ttl" and not ttl_steps:
            raise ValueError("policy ttl needs ttl_steps (steps a row may go unseen)")
        if not 0.0 < probability <= 1.0:
            raise ValueError(f"probability must be in (0, 1], got {probability}")
        self.capacities = caps
        self.capacity = sum(caps)  # every table's rows
        self.min_count, self.probability = min_count, probability
        self.policy, self.ttl_steps = policy, ttl_steps
        self.evict_batch = [max(1, int(evict_fraction * c)) for c in caps]
        starts = [0]
        for c in caps:
            starts.append(starts[-1] + c)
        self.starts_list = starts
        slots = 1 << max(4, (2 * self.capacity - 1).bit_length())  # at most half full
        self.mask = slots - 1
        i64 = torch.int64
        # the map (rebuilt from the rows when loaded, so not saved): [salted key, row] per slot
        self.register_buffer("slots", huge_full((slots, 2), 0, i64, device), persistent=False)
        self.used_slots = 0  # full + deleted
        # the slot of each index row's key (kept by every insert: a row leaves without a
        # probe)
        self.register_buffer("row_slot", huge_full(self.capacity + 1, 0, i64, device),
                             persistent=False)
        # per index row: its key and its stamp; each table's free rows, a stack in its own
        # segment free[starts[t]: starts[t + 1]] popped from the top (its row 1 first)
        self.register_buffer("row_key", huge_full(self.capacity + 1, 0, i64, device))
        self.register_buffer("row_stamp", huge_full(self.capacity + 1, _NEVER, i64, device))
        free = huge_empty(self.capacity, i64, device)
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            torch.arange(b, a, -1, out=free[a:b])
        self.register_buffer("free", free)
        self.register_buffer("n_free", torch.tensor(caps, dtype=i64))
        want = min(sketch_width, max(_SKETCH_MIN, _SKETCH_PER_ROW * self.capacity))
        width = 1 << max(4, (want - 1).bit_length()) if min_count > 1 else 1
        self.register_buffer("sketch", huge_full((len(_SKETCH_SALTS), width), 0, torch.int32,
                                                 device))
        # sightings counted since the sketch's fill was last checked
        self.register_buffer("sketch_total", torch.tensor(0, dtype=i64))
        # whether a new key's sightings are counted: a run over a file stops after its
        # first pass (stop_counting), so min_count counts a key's training rows, not the
        # epochs that read them again; a stream counts every record
        self.register_buffer("counting", torch.tensor(True))
        self.register_buffer("freed_total", torch.zeros(len(caps), dtype=i64))  # ever freed
        self.register_buffer("_window", torch.arange(_LATE_WINDOW, device=device),
                             persistent=False)
        self.register_buffer("_salts", torch.tensor(_SKETCH_SALTS, dtype=i64, device=device),
                             persistent=False)
        self.register_buffer("starts", torch.tensor(starts, dtype=i64, device=device),
                             persistent=False)
        # table t's keys are XORed with its salt in the map and the sketch (table 0's: 0)
        salts = mix64(torch.arange(len(caps), dtype=i64) + _TABLE_SALT)
        salts[0] = 0
        self.register_buffer("table_salt", salts.to(device), persistent=False)
        # Eviction's candidates: per table, its rows whose stamp was at or under the cut
        # of its last full pass (ascending local rows; None: no pass to reuse) and that cut
        # (int64 min: none). A stamp only grows while its row lives, so until a row is given
        # out at or under the cut, the rows at or under it are among these: a later eviction
        # takes its rows from them without another pass over the table (see _lowest).
        self._cand: list[torch.Tensor | None] = [None] * len(caps)
        self.register_buffer("_cut", torch.full((len(caps),), _FLOOR, dtype=i64,
                                                device=device), persistent=False)
        self._last_step: int | None = None
        self.eviction_passes = 0  # evictions that read every stamp of their table

    # -------------------------------------------------------------------- queries
    @property
    def tables(self) -> int:
        """How many tables share this map."""
        return len(self.capacities)

    def __len__(self) -> int:
        return self.capacity - int(self.n_free.sum())

    @property
    def live(self) -> torch.Tensor:
        """Which index rows hold a key (``[capacity + 1]`` bool)."""
        return self.row_stamp != _NEVER

    def seen(self, rows: torch.Tensor) -> torch.Tensor:
        """The step each of ``rows`` (index rows) was last seen (its low 32 bits with
        ``lfu``)."""
        st = self.row_stamp[rows]
        return st & _LOW32 if self.policy == "lfu" else st

    def table_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The table of each of the index ``rows`` (1 or more)."""
        if self.tables == 1:
            return torch.zeros_like(rows)
        return torch.searchsorted(self.starts[1:], rows)

    def local(self, rows: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """Index rows -> their table's own rows ``[1, capacity[t]]`` (0 stays 0);
        ``tables``: theirs, when the caller knows them."""
        if self.tables == 1:
            return rows
        t = self.table_of(rows) if tables is None else tables
        return torch.where(rows > 0, rows - self.starts.index_select(0, t), 0)

    def table_live(self, t: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Table ``t``'s live keys and their rows (its own, ascending)."""
        a, b = self.starts_list[t], self.starts_list[t + 1]
        rows = self.live[a + 1: b + 1].nonzero().squeeze(1) + a + 1
        return self.row_key.index_select(0, rows), rows - a

    def _salted(self, keys: torch.Tensor, tables: torch.Tensor | None) -> torch.Tensor:
        """``keys`` of ``tables`` as the map and the sketch hold them (XOR: its own
        inverse, so a salted key salted again is the key)."""
        if tables is None or self.tables == 1:
            return keys
        return keys ^ self.table_salt.index_select(0, tables)

    def _map_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """The salted keys of index ``rows``, as the map holds them."""
        t = self.table_of(rows) if self.tables > 1 else None
        return self._salted(self.row_key.index_select(0, rows), t)

    def _window_of(self, pos: torch.Tensor, first_round: bool, width: int) -> torch.Tensor:
        """The slots a probe or insert round reads: the home slot alone in a large batch's
        first round, else ``width`` neighbours from ``pos``. ``[n, w]``."""
        if first_round:
            return pos[:, None]
        return (pos[:, None] + self._window[:width]) & self.mask

    def _probe(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """The index row of each of the distinct salted ``keys`` (of ``tables``; None: one
        table), or 0. A key sits before the first empty slot of its probe sequence, so each
        round stops a key at its own slot or at an empty one; with several tables, a slot
        holding the key is its own only when the row is in the key's table.

        In a large batch the first round reads the home slot alone (where most keys are: the
        map is at most half full); the keys still searching then read ``_WINDOW`` slots a
        round, as every key of a small batch does from the start; the few still searching
        after such a round read ``_LATE_WINDOW`` slots a round. Gathers
        are ``index_select`` (several times faster than advanced indexing on CPU)."""
        pos = mix64(keys) & self.mask
        lo = hi = None
        if tables is not None and self.tables > 1:
            lo, hi = self.starts.index_select(0, tables), self.starts.index_select(0, tables + 1)
        if len(keys) <= _SMALL_BATCH:  # few keys: rounds cost more than reads, all windows
            row = torch.zeros_like(keys)
            idx = torch.arange(len(keys), device=keys.device)
        else:
            kr = self.slots.index_select(0, pos)  # [n, 2]
            k0, r0 = kr.unbind(1)
            hit = (k0 == keys) & (r0 > 0 if lo is None else (r0 > lo) & (r0 <= hi))
            row = torch.where(hit, r0, 0)
            idx = ((r0 != 0) & ~hit).nonzero().squeeze(1)  # not there, no empty slot yet
            keys, pos = keys.index_select(0, idx), (pos.index_select(0, idx) + 1) & self.mask
            if lo is not None:
                lo, hi = lo.index_select(0, idx), hi.index_select(0, idx)
        width = _WINDOW
        while len(idx):
            win = self._window_of(pos, False, width)  # [m, w]
            kr = self.slots.index_select(0, win.reshape(-1)).view(len(idx), width, 2)
            rw = kr[..., 1]
            h = (kr[..., 0] == keys[:, None]) & (
                rw > 0 if lo is None else (rw > lo[:, None]) & (rw <= hi[:, None]))
            stop = h | (rw == 0)
            first = stop.to(torch.uint8).argmax(1, keepdim=True)
            found = h.gather(1, first).squeeze(1).nonzero().squeeze(1)
            row[idx[found]] = rw.gather(1, first).squeeze(1)[found]
            go = (~stop.any(1)).nonzero().squeeze(1)
            idx, keys = idx.index_select(0, go), keys.index_select(0, go)
            pos = (pos.index_select(0, go) + width) & self.mask
            if lo is not None:
                lo, hi = lo.index_select(0, go), hi.index_select(0, go)
            width = _LATE_WINDOW
        return row

    def _distinct(self, keys: torch.Tensor, tables: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """The distinct (table, key) pairs of the flat ``keys``: ``(salted keys, their
        tables (None with one table), inverse, counts)``, by one sort of the salted keys.
        None when keys of two tables meet at one salted value (for hashed keys a chance of
        about 2**-64 a pair): the caller then takes each table alone."""
        uniq, inv, cnt = _unique(self._salted(keys, tables))
        if tables is None:
            return uniq, None, inv, cnt
        ut = torch.empty_like(uniq).scatter_(0, inv, tables)
        if not torch.equal(ut.index_select(0, inv), tables):
            return None
        return uniq, ut, inv, cnt

    @staticmethod
    def _flat(keys: torch.Tensor, tables: torch.Tensor | None, n: int
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if tables is not None and tables.shape != keys.shape:
            raise ValueError(f"tables {tuple(tables.shape)}: expected the keys' shape "
                             f"{tuple(keys.shape)}")
        if tables is not None and tables.device != keys.device:
            raise ValueError(f"tables on {tables.device}, keys on {keys.device}: expected "
                             "both on one device")
        if n > 1 and tables is not None and tables.numel() and tables.device.type == "cpu":
            # (the C probe indexes by them unchecked; on a GPU, index_select checks them)
            lo, hi = (int(v) for v in torch.aminmax(tables))
            if lo < 0 or hi >= n:
                raise IndexError(f"table {lo if lo < 0 else hi} of a key: this map holds "
                                 f"tables 0 to {n - 1}")
        # int64 keys always: the map holds int64 (the C kernels read them as such)
        return keys.reshape(-1).long(), \
            None if tables is None or n == 1 else tables.reshape(-1).long()

    def _per_table(self, fn: Any, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """``fn(keys, tables)`` -> rows, on each table's keys alone, put back in order."""
        out = torch.zeros_like(keys)
        for t in torch.unique(tables).tolist():
            at = (tables == t).nonzero().squeeze(1)
            out[at] = fn(keys.index_select(0, at), tables.index_select(0, at))
        return out

    def find(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``keys`` (any shape; with several tables, ``tables`` of the same shape
        names each key's) in their tables, 0 for keys without one; changes nothing."""
        flat, tab = self._flat(keys, tables, self.tables)
        if self._native(flat):
            return self._native_probe(flat, tab, 0, 0)[0].view(keys.shape)
        d = self._distinct(flat, tab)
        if d is None:
            return self._per_table(self.find, flat, tab).view(keys.shape)
        uniq, ut, inv, _ = d
        return self.local(self._probe(uniq, ut), ut).index_select(0, inv).view(keys.shape)

    # -------------------------------------------------------------------- training
    def admit(self, keys: torch.Tensor, step: int, tables: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training lookup: rows of ``keys`` (any shape; 0 where not admitted; with
        several tables, ``tables`` of the same shape names each key's, and the rows are in
        its table) after counting them, admitting the new keys that pass and evicting rows
        to make room; and the index rows freed on the way (to re-initialise before use: some
        may be given to new keys of this very batch; :meth:`table_of` and :meth:`local` say
        whose they are)."""
        flat, tab = self._flat(keys, tables, self.tables)
        if self._last_step is not None and step < self._last_step:
            self._forget_cuts()  # stamps of this step may be under the kept cuts
        self._last_step = step
        out = [torch.empty(0, dtype=torch.long, device=keys.device)]
        if self._native(flat):  # one pass finds and stamps the known keys; the rest below
            found, miss = self._native_probe(flat, tab, 2 if self.policy == "lfu" else 1,
                                             step)
            self._expire_due(step, out)
            if len(miss):
                rows, freed = self._admit_distinct(
                    flat.index_select(0, miss),
                    tab.index_select(0, miss) if tab is not None else None, step, probe=False)
                found.index_copy_(0, miss, rows)
                out.append(freed)
            return found.view(keys.shape), torch.cat(out)
        rows, freed = self._admit_distinct(flat, tab, step, out=out)
        return rows.view(keys.shape), freed

    def _admit_distinct(self, flat: torch.Tensor, tab: torch.Tensor | None, step: int, *,
                        probe: bool = True, out: list[torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`admit` of the flat ``keys`` (of ``tab``) by their distinct keys: rows in
        their tables and the rows freed (after ``out``'s). ``probe=False``: none of the keys
        is in the map (the C probe found them missing, stamped the rest and expired)."""
        out = out if out is not None else []
        d = self._distinct(flat, tab)
        if d is None:
            def one_table(k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                rows, f = self._admit_distinct(k, t, step, probe=probe, out=[])
                out.append(f)
                return rows

            return self._per_table(one_table, flat, tab), torch.cat(out)
        uniq, ut, inv, cnt = d
        if probe:
            rows = self._probe(uniq, ut)
            hit = rows > 0
            at = hit.nonzero().squeeze(1)
            known = rows.index_select(0, at)
            self._stamp(known, cnt.index_select(0, at), step,
                        old=self.row_stamp.index_select(0, known))
            self._expire_due(step, out)
            new = (~hit).nonzero().squeeze(1)
        else:
            rows = torch.zeros_like(uniq)
            new = torch.arange(len(uniq), device=uniq.device)
        if len(new):
            ok = self._admitted(uniq.index_select(0, new), cnt.index_select(0, new), step)
            new = new.index_select(0, ok.nonzero().squeeze(1))
        if len(new):
            new_t = ut.index_select(0, new) if ut is not None else None
            got, took = self._take_rows(new_t, len(new), step, out)
            new = new.index_select(0, took)
            new_keys = uniq.index_select(0, new)
            self._insert(new_keys, got)
            self.row_key.index_copy_(0, got, self._salted(
                new_keys, new_t.index_select(0, took) if new_t is not None else None))
            self._stamp(got, cnt.index_select(0, new), step)
            rows.index_copy_(0, new, got)
        if not out:
            out.append(torch.empty(0, dtype=torch.long, device=flat.device))
        return self.local(rows, ut).index_select(0, inv), torch.cat(out)

    def _expire_due(self, step: int, out: list[torch.Tensor]) -> None:
        """With ``ttl``, every ``ttl_steps / 8`` steps: rows unseen too long go, full table
        or not (appended to ``out``)."""
        if self.ttl_steps and step % max(1, self.ttl_steps // 8) == 0:
            out.append(self.expire(step))

    def _native(self, keys: torch.Tensor) -> bool:
        """Whether this call runs on the C kernels (a CPU map, :attr:`native` on, and they
        could be built: :func:`sampan.native.status`)."""
        return self.native and self.slots.device.type == "cpu" and \
            keys.device.type == "cpu" and native.library() is not None

    def _native_probe(self, keys: torch.Tensor, tables: torch.Tensor | None, mode: int,
                      step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each key's row in its table (0: none), in one C pass; ``mode`` 1 / 2 also stamps
        the rows found (lru, ttl / lfu), 0 reads only. And the positions of the keys that
        have none."""
        # (int64 already: see _flat)
        return native.probe(self.slots, self.mask, keys.contiguous(),
                            None if tables is None else tables.contiguous(),
                            self.table_salt, self.starts, self.row_stamp, mode, step)

    def _take_rows(self, tables: torch.Tensor | None, n: int, step: int,
                   freed: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for ``n`` new keys (of ``tables``; None: one table), first come first
        served in each table, evicting where a table has too few free (never a row seen at
        this step, by this call or an earlier one; appended to ``freed``): ``(the index rows
        given, which of the n keys got them)``; the rest stay out this time."""
        if tables is None:
            short = n - int(self.n_free[0])
            if short > 0:
                freed.append(self.evict(max(short, self.evict_batch[0]), step))
            have = int(self.n_free[0])
            take = min(n, have)
            self.n_free[0] -= take
            return self.free[have - take: have].flip(0), torch.arange(take,
                                                                      device=self.free.device)
        need = torch.bincount(tables, minlength=self.tables)
        short = need - self.n_free
        tight = (short > 0).nonzero().squeeze(1).tolist()
        if tight:  # one choice and one release for every table short of rows
            gap = short.tolist()
            freed.append(self._free(self._lowest_of(
                [(t, max(gap[t], self.evict_batch[t])) for t in tight], step)))
        order = torch.sort(tables, stable=True).indices  # by table, first come first
        st = tables.index_select(0, order)
        rank = torch.arange(n, device=tables.device) - (need.cumsum(0) - need).index_select(0, st)
        have = self.n_free.index_select(0, st)
        ok = (rank < have).nonzero().squeeze(1)
        order, st, rank, have = (x.index_select(0, ok) for x in (order, st, rank, have))
        got = self.free.index_select(0, self.starts.index_select(0, st) + have - 1 - rank)
        self.n_free -= torch.bincount(st, minlength=self.tables)
        return got, order

    def _stamp(self, rows: torch.Tensor, times: torch.Tensor, step: int,
               old: torch.Tensor | None = None) -> None:
        """``rows`` used ``times`` more times at ``step`` (``old``: their stamps, None for
        rows just given out)."""
        if self.policy != "lfu":
            self.row_stamp.index_fill_(0, rows, step)
            if old is None:
                self._given(rows, torch.full_like(rows, step))
            return
        count = times if old is None else (old >> 32) + times
        # (at most 2**31 - 2 uses: a stamp never reaches _NEVER, the mark of a free row)
        stamps = (count.clamp_max(2**31 - 2) << 32) + (step & _LOW32)
        self.row_stamp.index_copy_(0, rows, stamps)
        if old is None:
            self._given(rows, stamps)

    def _given(self, rows: torch.Tensor, stamps: torch.Tensor) -> None:
        """Index ``rows`` were just given out with ``stamps``: a table whose kept eviction
        cut one of them is at or under loses its candidates (the row is not among them)."""
        if not len(rows) or not any(c is not None for c in self._cand):
            return
        t = self.table_of(rows)
        under = stamps <= self._cut.index_select(0, t)
        if bool(under.any()):
            for i in torch.unique(t[under]).tolist():
                self._cand[i] = None
                self._cut[i] = _FLOOR

    def _forget_cuts(self) -> None:
        self._cand = [None] * self.tables
        self._cut.fill_(_FLOOR)

    def _admitted(self, keys: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        """Which of the new ``keys`` (seen ``counts`` times in this batch) get a row."""
        ok = torch.ones(len(keys), dtype=torch.bool, device=keys.device)
        if self.min_count > 1:  # count-min: the least of the key's counters
            w = self.sketch.shape[1] - 1
            h = mix64(keys[None, :] ^ self._salts[:, None]) & w  # [rows, n]
            h += torch.arange(0, self.sketch.numel(), w + 1, device=keys.device)[:, None]
            flat = self.sketch.view(-1)
            h = h.reshape(-1)
            counting = bool(self.counting)
            if counting:
                flat.index_add_(0, h, counts.int().repeat(len(_SKETCH_SALTS)))
            est = flat.index_select(0, h).view(len(_SKETCH_SALTS), -1).amin(0)
            ok &= est >= self.min_count
            if counting:
                self.sketch_total += int(counts.sum())
            if counting and int(self.sketch_total) > (w + 1) // 32:  # crowded: counts fade
                if (float(self.sketch[0].count_nonzero()) > _SKETCH_FILL * (w + 1)
                        or int(self.sketch.max()) > 1 << 30):  # (int32 counters)
                    self.sketch.div_(2, rounding_mode="floor")
                self.sketch_total.zero_()
        if self.probability < 1.0:
            salt = mix64(torch.tensor(step, dtype=torch.int64, device=keys.device))
            u = _srl(mix64(keys ^ salt), 11).double() / 2.0**53
            ok &= u < self.probability
        return ok

    def _insert(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Put absent, distinct ``keys`` in the map, at the first free (empty or deleted)
        slot of each's probe sequence. Keys that reach the same slot in one round all
        write their key there; the one whose key stays takes the slot, the others go on
        from it. (Which one wins changes where a key sits, never its row.)"""
        if self.used_slots + len(keys) > _MAX_FILL * (self.mask + 1):
            self._rebuild()
        if self._native(keys):  # one key after another: no rounds
            self.used_slots += native.insert(self.slots, self.mask, keys.contiguous(),
                                             rows.contiguous(), self.row_slot)
            return
        flat = self.slots.view(-1)  # slot s: key at 2 s, row at 2 s + 1
        pos = mix64(keys) & self.mask
        first_round = len(keys) > _SMALL_BATCH
        width = _WINDOW
        while len(keys):
            win = self._window_of(pos, first_round, width)
            free = flat.index_select(0, (2 * win + 1).reshape(-1)).view(win.shape) <= 0
            has = free.any(1)
            at = win.gather(1, free.to(torch.uint8).argmax(1, keepdim=True)).squeeze(1)
            cand = has.nonzero().squeeze(1)
            at_c, keys_c = at.index_select(0, cand), keys.index_select(0, cand)
            flat.index_copy_(0, 2 * at_c, keys_c)
            won_c = (flat.index_select(0, 2 * at_c) == keys_c).nonzero().squeeze(1)
            won = cand.index_select(0, won_c)
            slots = at_c.index_select(0, won_c)
            self.used_slots += int((flat.index_select(0, 2 * slots + 1) == 0).sum())
            got = rows.index_select(0, won)
            flat.index_copy_(0, 2 * slots + 1, got)
            self.row_slot.index_copy_(0, got, slots)
            left = torch.ones(len(keys), dtype=torch.bool, device=keys.device)
            left[won] = False
            # the losers look again from the slot they lost (now full), the rest further on
            pos = torch.where(has, at, (pos + win.shape[1]) & self.mask)
            go = left.nonzero().squeeze(1)
            keys, rows, pos = (t.index_select(0, go) for t in (keys, rows, pos))
            if not first_round:  # the few left after a window: wide windows
                width = _LATE_WINDOW
            first_round = False

    def evict(self, n: int, step: int, keep: torch.Tensor | None = None,
              table: int = 0) -> torch.Tensor:
        """Free up to ``n`` rows of ``table`` by the policy, never one of ``keep`` (index
        rows; by default the rows seen at ``step``); returns them (index rows). They go on
        their table's free stack, their keys leave the map."""
        return self._free(self._lowest(n, step, keep, table))

    def _lowest(self, n: int, step: int, keep: torch.Tensor | None = None,
                table: int = 0) -> torch.Tensor:
        """Up to ``n`` live index rows of ``table`` of lowest stamp (ties: the lowest rows
        first, so that a table on a GPU evicts the same rows as on the CPU), none of
        ``keep`` (by default the rows seen at ``step``).

        On a large table a threshold from a sample first keeps only the rows at or under it
        (one pass over the stamps), the rows to keep are dropped from those, and the lowest
        of the rest are taken: the same rows as a sort of the whole table would give. When
        the sample's threshold leaves too few, the whole table is sorted instead."""
        base = self.starts_list[table] + 1  # the table's first index row
        stamps = self.row_stamp[base: self.starts_list[table + 1] + 1]
        if keep is not None:
            keep = keep - base

        def evictable(rows: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
            ok = (st != _NEVER) & ~torch.isin(rows, keep) if keep is not None else \
                self._evictable(st, step)
            return ok.nonzero().squeeze(1)

        if self._sampled(table, n):
            kept = self._cand[table]
            if kept is not None and kept.device == stamps.device:
                # the rows at or under the last pass's cut are among the kept ones: when
                # enough of them are still under it, the lowest n are there
                st = stamps.index_select(0, kept)
                under = (st <= self._cut[table]).nonzero().squeeze(1)
                kept, st = kept.index_select(0, under), st.index_select(0, under)
                self._cand[table] = kept  # a row over the cut never comes back under it
                ok = evictable(kept, st)
                if len(ok) >= n:
                    return _lowest_first(kept.index_select(0, ok), st.index_select(0, ok),
                                         n) + base
            gen = torch.Generator(device=stamps.device).manual_seed(step)
            sample = stamps[torch.randint(0, len(stamps), (1 << 16,), generator=gen,
                                          device=stamps.device)]
            k = min(len(sample), int(len(sample) * (2.0 * n / len(stamps) + 0.01)) + 1)
            cut = sample.kthvalue(k).values
            cand = (stamps <= cut).nonzero().squeeze(1)
            self._cand[table], self._cut[table] = cand, cut
            self.eviction_passes += 1
            st = stamps.index_select(0, cand)
            ok = evictable(cand, st)
            if len(ok) >= n:
                return _lowest_first(cand.index_select(0, ok), st.index_select(0, ok),
                                     n) + base
        self.eviction_passes += 1
        cand = torch.arange(len(stamps), device=stamps.device)
        st = stamps
        ok = evictable(cand, st)
        cand, st = cand.index_select(0, ok), st.index_select(0, ok)
        return _lowest_first(cand, st, min(n, len(cand))) + base

    def _lowest_of(self, wanted: list[tuple[int, int]], step: int) -> torch.Tensor:
        """:meth:`_lowest` of several tables at once, ``wanted`` = ``(table, n)`` in
        ascending table order: the same rows, table after table. The tables small enough
        to be sorted whole are taken together in one sort (a batch that overfills a few
        small tables pays one pass, not one per table); the large ones each take their
        sampled cut."""
        alone = [self._lowest(n, step, table=t) for t, n in wanted if self._sampled(t, n)]
        together = [(t, n) for t, n in wanted if not self._sampled(t, n)]
        if not together:
            return torch.cat(alone)
        dev = self.row_stamp.device
        ts = torch.tensor([t for t, _ in together], device=dev)
        first = self.starts.index_select(0, ts)
        sizes = self.starts.index_select(0, ts + 1) - first
        which = torch.repeat_interleave(sizes, output_size=sum(
            self.capacities[t] for t, _ in together))  # the i-th table's index for its rows
        # table t's index rows starts[t] + 1 .. starts[t + 1], the tables one after another
        rows = torch.arange(1, len(which) + 1, device=dev) + (
            first - (sizes.cumsum(0) - sizes)).index_select(0, which)
        st = self.row_stamp.index_select(0, rows)
        ok = self._evictable(st, step).nonzero().squeeze(1)
        rows, which, st = (x.index_select(0, ok) for x in (rows, which, st))
        # lowest stamp first, ties to the lower row (stable), then grouped by table
        by = torch.sort(st, stable=True).indices
        by = by.index_select(0, torch.sort(which.index_select(0, by), stable=True).indices)
        rows, which = rows.index_select(0, by), which.index_select(0, by)
        have = torch.bincount(which, minlength=len(together))
        rank = torch.arange(len(rows), device=dev) - (have.cumsum(0) - have).index_select(
            0, which)
        most = torch.tensor([n for _, n in together], device=dev)
        got = rows.index_select(0, (rank < most.index_select(0, which)).nonzero().squeeze(1))
        if not alone:
            return got
        # back in table order (a stable sort keeps each table's own order)
        got = torch.cat([got, *alone])
        return got.index_select(0, torch.sort(self.table_of(got), stable=True).indices)

    def _evictable(self, stamps: torch.Tensor, step: int) -> torch.Tensor:
        """Which rows of these ``stamps`` may be evicted at ``step``: live, and not seen at
        this step."""
        now = step & _LOW32 if self.policy == "lfu" else step
        return (stamps != _NEVER) & ((stamps & _LOW32 if self.policy == "lfu" else stamps) != now)

    def _sampled(self, table: int, n: int) -> bool:
        """Whether :meth:`_lowest` narrows ``table`` by a sampled threshold first."""
        size = self.capacities[table]
        return size > _SAMPLED_EVICTION and n < size >> 5

    def expire(self, step: int) -> torch.Tensor:
        """With ``ttl``: free every row unseen for more than ``ttl_steps`` (of every table);
        returns them (index rows)."""
        if not self.ttl_steps:
            return torch.empty(0, dtype=torch.long, device=self.row_stamp.device)
        old = (self.live & (self.seen(slice(None)) < step - self.ttl_steps)).nonzero()
        return self._free(old.squeeze(1))

    def _free(self, victims: torch.Tensor) -> torch.Tensor:
        """Index rows ``victims`` leave the map and go on their tables' free stacks, the
        first victim of a table on top (reused first)."""
        if not len(victims):
            return victims
        self.slots[self.row_slot.index_select(0, victims), 1] = -1
        self.row_key.index_fill_(0, victims, 0)
        self.row_stamp.index_fill_(0, victims, _NEVER)
        if self.tables == 1:
            n = int(self.n_free[0])
            self.free[n: n + len(victims)] = victims.flip(0)
            count = torch.tensor([len(victims)], device=victims.device)
        else:
            t = self.table_of(victims)
            count = torch.bincount(t, minlength=self.tables)
            order = torch.sort(t, stable=True).indices
            st = t.index_select(0, order)
            rank = torch.arange(len(victims), device=victims.device) - \
                (count.cumsum(0) - count).index_select(0, st)
            at = self.starts.index_select(0, st) + self.n_free.index_select(0, st) + \
                count.index_select(0, st) - 1 - rank
            self.free.index_copy_(0, at, victims.index_select(0, order))
        self.n_free += count
        self.freed_total += count
        return victims

    def summary(self, table: int | None = None) -> dict[str, int]:
        """``capacity``, ``live`` rows and rows ``evicted`` so far (expired included): of
        ``table``, or of every table together."""
        if table is None:
            return {"capacity": self.capacity, "live": len(self),
                    "evicted": int(self.freed_total.sum())}
        return {"capacity": self.capacities[table],
                "live": self.capacities[table] - int(self.n_free[table]),
                "evicted": int(self.freed_total[table])}

    def _rebuild(self) -> None:
        """The map again from the live rows (drops the deleted slots)."""
        self.slots.zero_()
        self.used_slots = 0
        live = self.live.nonzero().squeeze(1)
        if len(live):
            self._insert(self._map_keys(live), live)

    def stop_counting(self) -> None:
        """Count no more sightings (the training rows have all been read once): a key's
        count is then what its rows gave it, and a key whose rows gave it ``min_count``
        sightings still gets its row when it comes again."""
        self.counting.fill_(False)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        if prefix + "counting" not in state_dict:  # saved before the flag: still counting
            state_dict = {**state_dict, prefix + "counting": torch.tensor(True)}
        for name in ("n_free", "freed_total"):  # one number before tables shared a map
            old = state_dict.get(prefix + name)
            if old is not None and old.dim() == 0:
                state_dict = {**state_dict, prefix + name: old.reshape(1)}
        saved = state_dict.get(prefix + "sketch")
        if saved is not None and saved.shape != self.sketch.shape:
            if self.min_count > 1 and saved.shape[1] > 1:
                # a checkpoint's sketch keeps its width (before 2026-12-03 every sketch was
                # 4 x 2**20 counters): its counts only mean something at the width they
                # were hashed with
                self.sketch = huge_full(tuple(saved.shape), 0, torch.int32,
                                        self.sketch.device)
            else:  # saved without counting (min_count 1), or this index does not count
                state_dict = {**state_dict, prefix + "sketch": self.sketch.clone()}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._forget_cuts()  # the stamps are the loaded ones
        self._last_step = None
        self._rebuild()

    def extra_repr(self) -> str:
        return (f"capacity={self.capacities if self.tables > 1 else self.capacity}, "
                f"live={len(self)}, policy={self.policy}, "
                f"min_count={self.min_count}, probability={self.probability}")
