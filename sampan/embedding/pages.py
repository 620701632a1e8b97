"""Large tables read at random rows get 2 MB pages where Linux allows it.

A lookup into a table of millions of rows touches a different 4 KB page almost every time,
so on CPU it is bound by address translation (TLB misses) as much as by memory. Backed by
transparent huge pages (2 MB), the same table needs 512x fewer translations. PyTorch asks
for them only when ``THP_MEM_ALLOC_ENABLE=1`` is set before its first allocation, and most
kernels ship THP in ``madvise`` mode (only memory that asks gets them). So the tables that
are read at random (embedding weights, their optimizer state, a dynamic table's key map)
are allocated empty, advised with ``madvise(MADV_HUGEPAGE)`` before their first write, and
only then filled: the first writes fault in huge pages, where the kernel has 2 MB of
contiguous free memory to give (else 4 KB pages, as before; the advice stays, and the
kernel's khugepaged may merge them later).

On a 2-core AMD EPYC, family 25 model 17 (2026-12-02), the dynamic key map of 1 M keys
looked up 10.8-32 M ids/s depending on where the allocator happened to put it; with its
tables advised, 19.6-21.3 M ids/s in the same two placements, and 23-29 M ids/s with
``THP_MEM_ALLOC_ENABLE=1``, which also covers each call's temporaries
(``benchmarks/dynamic_embedding.py``; the README has the 10 M-key figures).

Elsewhere (not Linux, not CPU, small tensors, a kernel with THP ``never``) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence

import torch

MIN_BYTES = 4 << 20  # below two huge pages there is little to gain
_MADV_HUGEPAGE = 14
_PAGE = 4096
_libc: ctypes.CDLL | None = None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back ``t``'s memory with transparent huge pages. Returns whether
    it was asked (a contiguous CPU tensor of :data:`MIN_BYTES` or more, on Linux); pages
    written before the call keep their size until the kernel merges them."""
    global _libc
    nbytes = t.numel() * t.element_size()
    if sys.platform != "linux" or t.device.type != "cpu" or nbytes < MIN_BYTES or \
            not t.is_contiguous():
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-t.data_ptr() // _PAGE) * _PAGE  # whole pages inside the tensor
    end = (t.data_ptr() + nbytes) // _PAGE * _PAGE
    return end > start and _libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0


def huge_empty(shape: int | Sequence[int], dtype: torch.dtype,
               device: str | torch.device | None = None) -> torch.Tensor:
    """``torch.empty(shape)``, advised for huge pages (write it only after this)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


def huge_full(shape: int | Sequence[int], value: float | int, dtype: torch.dtype,
              device: str | torch.device | None = None) -> torch.Tensor:
    """``torch.full(shape, value)``, advised for huge pages before it is written."""
    return huge_empty(shape, dtype, device).fill_(value)


def huge_zeros_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.zeros_like(t)`` (contiguous), advised for huge pages before it is written."""
    return huge_empty(t.shape, t.dtype, t.device).zero_()
