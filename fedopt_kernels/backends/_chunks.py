"""The multi-tensor work partition, the Python twin of csrc/include/fedopt/chunks.h.

One chunk rule and one chunk-row layout serve every multi-tensor kernel of the GPU
backends (the CUDA launchers build the table in C++ from chunks.h, the Triton launchers
in Python from this file; keep the two identical).

Chunk rule.  The tensors of a call are cut into chunks of ``chunk_size_for(n)``
elements, ``n`` the element count of the call's largest group (all elements for ops
without groups, a row's ``N`` for ``nar_step_batched_``): the smallest power of two
``>= MIN_CHUNK`` that keeps a group at about ``TARGET_CHUNKS`` chunks, plus one tail
chunk per tensor.  Chunks start at multiples of the chunk size inside their tensor, so a
chunk keeps its tensor's 16-byte alignment, and the boundaries depend on sizes only
(never on the device), which is what makes the reductions bitwise reproducible.

Chunk row: ``ROW_COLS`` int64 per chunk (64 bytes)::

    [ptr0, ptr1, ptr2, ptr3, len, group, flags, 0]

``ptrK`` is the device address of the chunk's first element in array ``K`` (0 where the
op has no such array): FedNAR ``x, g, momentum buffer, 0``; the server update ``x, D,
exp_avg, exp_avg_sq``.  ``len`` is ``1..chunk_size``; ``group`` the group whose norm the
chunk feeds (0 without groups); ``flags`` bit 0 (``FLAG_ALIGNED16``) says every nonzero
pointer of the row is 16-byte aligned, so that chunk takes the vectorised body: one
misaligned tensor (a view of the flat mean update at an odd offset, a DDP bucket view)
costs vector width on its own chunks only.  Rows are listed group by group; a separate
``[num_groups, 2]`` array holds each group's partial range ``[pbegin, pend)``.

Why this and not apex's ``multi_tensor_apply`` (tensor addresses and chunk lists in the
kernel arguments, a launch per 4 KiB of metadata): a group's norm must combine all its
partials, and a launch boundary in the middle of a group would need the partials to
survive across launches anyway; one table in device memory has no size limit, so a
step is always two launches (norm, update) whatever the number of tensors.  PyTorch's
``_foreach`` / fused optimizers take the same path as apex.  The cost is one small
upload per distinct table, which the launchers cache (``backends/triton/_tables.py``).
"""

from __future__ import annotations

from typing import Sequence

MIN_CHUNK = 2048  # elements: a multiple of every vector width and of every Triton BLOCK
TARGET_CHUNKS = 1024
# Beyond this many partials in one group the update kernel stops re-combining them in
# every program (O(partials^2) reads) and a one-program-per-group pass sums them once.
MAX_REDUNDANT_PARTIALS = 4096
ALIGN_BYTES = 16
ROW_COLS = 8
FLAG_ALIGNED16 = 1
# Column indices of a row.
COL_LEN, COL_GROUP, COL_FLAGS = 4, 5, 6


def max_redundant_partials() -> int:
    """``MAX_REDUNDANT_PARTIALS``, or the environment's ``FEDOPT_MAX_REDUNDANT_PARTIALS``
    (read at every call, as the CUDA launcher does: tests force either path with it)."""
    import os

    env = os.environ.get("FEDOPT_MAX_REDUNDANT_PARTIALS", "")
    if not env:
        return MAX_REDUNDANT_PARTIALS
    if not env.isdigit():
        raise ValueError(f"FEDOPT_MAX_REDUNDANT_PARTIALS must be a non-negative integer, got {env!r}")
    return int(env)


def chunk_size_for(n: int) -> int:
    """The chunk size for a call whose largest group has ``n`` elements."""
    want = -(-n // TARGET_CHUNKS)
    size = MIN_CHUNK
    while size < want:
        size *= 2
    return size


def build_rows(ptrs: Sequence[Sequence[int]], esizes: Sequence[int], numels: Sequence[int],
               group_of: Sequence[int], num_groups: int, chunk: int):
    """The chunk rows and group ranges of tensors ``t`` with addresses ``ptrs[t]`` (up
    to 4, 0 = absent), element sizes ``esizes[k]`` of array ``k``, sizes ``numels[t]``
    and non-decreasing groups ``group_of[t]``.  Returns ``(rows, group_ranges)`` as flat
    int lists (``ROW_COLS`` and 2 per entry)."""
    rows: list = []
    ranges: list = []
    t, T = 0, len(numels)
    width = len(esizes)
    for gi in range(num_groups):
        pbegin = len(rows) // ROW_COLS
        while t < T and group_of[t] == gi:
            n = numels[t]
            base = tuple(ptrs[t]) + (0,) * (4 - width)
            for start in range(0, n, chunk):
                addrs = [(a + start * esizes[k]) if a else 0 for k, a in enumerate(base[:width])]
                addrs += [0] * (4 - width)
                aligned = all(a % ALIGN_BYTES == 0 for a in addrs)
                rows += addrs
                rows += (min(chunk, n - start), gi, FLAG_ALIGNED16 if aligned else 0, 0)
            t += 1
        ranges += (pbegin, len(rows) // ROW_COLS)
    return rows, ranges


def rows_misalignment(addrs: Sequence[int]) -> int:
    """For the table-free ``[C, N]`` forms: the common misalignment (address mod 16) of
    the arrays' base addresses, or -1 when they differ (then no chunk can have them all
    aligned).  The kernels align a chunk iff ``(mis + offset_bytes) % 16 == 0``."""
    mis = {a % ALIGN_BYTES for a in addrs if a}
    return mis.pop() if len(mis) == 1 else (0 if not mis else -1)


# Aggregation tiling (item "few SMs when N is small"): a program owns one tile of
# columns for all clients.  The tile width depends on N and the dtype only -- never on
# the device -- so the partial sums, hence the results, are the same on every GPU.
AGG_TARGET_TILES = 512
AGG_MIN_TILE = 256


def aggregate_tile(n: int, max_tile: int) -> int:
    """Columns per program of the aggregation over ``n`` columns: the smallest power of
    two ``>= AGG_MIN_TILE`` that keeps about ``AGG_TARGET_TILES`` programs, at most
    ``max_tile`` (the dtype's widest block).  C = 100 clients of N = 62K fp32 columns
    get 243 programs of 256 columns instead of 31 of 2048."""
    want = -(-n // AGG_TARGET_TILES)
    size = AGG_MIN_TILE
    while size < want and size < max_tile:
        size *= 2
    return min(size, max_tile)
