"""One round's compressed replies in one host allocation, kept from round to round.

The fused decode-aggregate reads the C replies of a round side by side, one stream of
codes per reply, and its speed on a CPU depends on the pages those streams live in, not
only on their bytes.  Measured on Zen 5 (one thread, 20 int8 replies of 11.2M values, the
same bytes in each case, docs/benchmarks.md):

* the replies as the encode allocates them one by one (torch's CPU allocator; at this
  size glibc serves them from its heap, whose pages it recycles): 23-28 ms;
* the same codes copied into freshly mapped memory, one mapping per reply or one for
  all: 14-18 ms; in 2 MiB pages (``madvise(MADV_HUGEPAGE)``): 14-17 ms.

Our reading, not measured directly: fresh mappings are faulted in order and tend to get
physically contiguous 4 KiB pages, which Zen's TLB can coalesce, where recycled heap
pages are scattered.  2 MiB pages give every CPU that contiguity by construction
(Intel's TLBs do not coalesce 4 KiB pages); an Intel machine has not been measured.  So a
round's block-codec replies are written into a :class:`ReplyArena`: one anonymous
mapping, 2 MiB aligned and advised for huge pages where the kernel allows it (Linux, THP
``madvise`` or ``always``), reused the next round, so its pages are faulted once per run
rather than once per round.  The encode writes there directly
(:func:`~fedopt_kernels.ops.compressed.encode`'s ``out=``, the kernels'
``block_quantize_into``): copying a reply in would cost the clients' side about what
the aggregation saves.  Top-k replies keep their own allocations (the arena did not
speed their scatter up).  Replies on another device (CUDA) are not placed here: the
caching allocator already reuses its blocks.
"""

from __future__ import annotations

import mmap
from typing import List

import torch

__all__ = ["ReplyArena", "host_buffer", "HUGE_PAGE"]

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_ALIGN = 64  # every tensor handed out starts on a cache line


def host_buffer(nbytes: int, *, huge_pages: bool = True) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` bytes in its own anonymous mapping, starting on a
    2 MiB boundary and (``huge_pages``) advised for transparent huge pages.  Where the
    platform has no ``madvise(MADV_HUGEPAGE)`` the mapping keeps 4 KiB pages; where it has
    no anonymous ``mmap`` this is ``torch.empty``.  The tensor keeps the mapping alive."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(nbytes, dtype=torch.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a 2 MiB boundary
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out or "never": 4 KiB pages
            pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to region
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class ReplyArena:
    """Host memory for the replies of one round at a time (module docstring).

    ``start_round()`` recycles the memory of the previous round's replies, and
    ``take(numel, dtype)`` hands out an uninitialised tensor of this round's memory (an
    encode's output).  A previous round's tensor that is still referenced when the next
    round starts keeps its memory: the arena then maps fresh memory rather than hand it
    out again, so a reply never changes under its holder.

    Args:
        huge_pages: advise the arena's mappings for 2 MiB pages.
    """

    def __init__(self, *, huge_pages: bool = True):
        self.huge_pages = bool(huge_pages)
        self._slabs: List[torch.Tensor] = []  # this round's mappings, the last one being filled
        self._fresh_use: List[int] = []  # each slab's storage use count when it was mapped
        self._used = 0  # bytes of the last slab taken
        self._round_bytes = 0  # bytes taken this round, over every slab

    @property
    def nbytes(self) -> int:
        """Bytes mapped for the current round."""
        return sum(s.numel() for s in self._slabs)

    def start_round(self, reserve: int = 0) -> None:
        """Make the previous round's memory the next round's: one slab of at least what
        the previous round took and ``reserve`` bytes; a slab still referenced by a
        tensor it handed out is left to it."""
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"reserve must be an int >= 0, got {reserve!r}")
        needed = max(self._round_bytes, reserve)
        reusable = [s for s, n in zip(self._slabs, self._fresh_use) if _use_count(s) == n]
        self._slabs, self._fresh_use, self._used, self._round_bytes = [], [], 0, 0
        best = max(reusable, key=lambda s: s.numel(), default=None)
        if best is not None and best.numel() >= needed:
            self._slabs, self._fresh_use = [best], [_use_count(best)]
        elif needed:
            self._map(needed)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D CPU tensor of ``numel`` values of ``dtype`` in this round's
        memory, starting on a 64-byte boundary."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        size = torch.empty((), dtype=dtype).element_size()
        return self._take(numel * size).view(dtype)

    def _take(self, nbytes: int) -> torch.Tensor:
        start = -(-self._used // _ALIGN) * _ALIGN
        if not self._slabs or start + nbytes > self._slabs[-1].numel():
            self._map(max(nbytes, 2 * (self._slabs[-1].numel() if self._slabs else 0)))
            start = 0
        self._used = start + nbytes
        self._round_bytes += -(-nbytes // _ALIGN) * _ALIGN
        return self._slabs[-1][start:start + nbytes]  # uint8; nbytes 0 gives an empty view

    def _map(self, nbytes: int) -> None:
        slab = host_buffer(-(-nbytes // HUGE_PAGE) * HUGE_PAGE, huge_pages=self.huge_pages)
        self._slabs.append(slab)
        self._fresh_use.append(_use_count(slab))
        self._used = 0

