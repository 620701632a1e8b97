"""Tables read at random are backed by transparent huge pages where Linux allows it."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from sampan.embedding import EmbeddingCollection
from sampan.embedding.dynamic import KeyIndex
from sampan.embedding.pages import MIN_BYTES, advise_huge_pages, huge_full, huge_zeros_like
from sampan.schema import TableSpec

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def advised(t: torch.Tensor) -> bool:
    """Whether the memory mapping that holds ``t``'s middle byte is advised for huge pages
    (``hg`` in its VmFlags; advising splits a mapping, so the advised pages are one of their
    own). Whether the kernel then gives huge pages depends on its free memory, so that is
    what ``benchmarks/dynamic_embedding.py`` measures, not this test."""
    addr, mapping = t.data_ptr() + t.numel() * t.element_size() // 2, None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            mapping = lo <= addr < hi
        elif mapping and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


needs_thp = pytest.mark.skipif(
    sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off (or not Linux)")


def test_only_large_contiguous_cpu_tensors_are_advised():
    assert not advise_huge_pages(torch.empty(MIN_BYTES // 8, dtype=torch.int64)[::2])
    assert not advise_huge_pages(torch.empty(16))
    assert not advise_huge_pages(torch.empty(MIN_BYTES, device="meta"))
    t = huge_full((MIN_BYTES // 4,), 7, torch.int32)
    assert t.is_contiguous() and bool((t == 7).all())
    z = huge_zeros_like(torch.ones(3, MIN_BYTES // 12))
    assert z.shape == (3, MIN_BYTES // 12) and not z.any()
    if sys.platform == "linux":
        assert advise_huge_pages(torch.empty(MIN_BYTES // 4))


@needs_thp
def test_the_tables_are_advised_for_huge_pages():
    t = huge_full((64 << 20) // 8, 0, torch.int64)
    # a mapping of its own, never advised (malloc's memory may be: a training run has it
    # reuse freed blocks, advised tables' among them)
    region = mmap.mmap(-1, 64 << 20)
    plain = torch.frombuffer(region, dtype=torch.int64)
    assert advised(t) and not advised(plain)
    del plain
    region.close()
    index = KeyIndex(1 << 20)  # its map alone is 32 MB
    assert advised(index.slots) and advised(index.row_key) and advised(index.row_stamp)
    table = EmbeddingCollection([TableSpec("a", 1 << 20, 16, ("a",))], 0.01)  # 64 MB
    assert advised(table.weight)
    assert len(index) == 0 and table.weight.shape == (1 << 20, 16)
