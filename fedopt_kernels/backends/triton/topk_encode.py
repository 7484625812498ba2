"""Triton kernels of the client's top-k encode (oracle: python_ref/compression.py
``topk_encode``, a stable descending sort of ``|x|`` in fp32; the CPU twin is
csrc/cpu/compressed_encode.cpp, the CUDA twin csrc/cuda/kernels/topk_encode.cuh, the
same algorithm).

The order.  Element ``j`` has the key ``K_j = m_j 2^32 + (2^32 - 1 - j)``: ``m_j`` the
fp32 bits of ``|x_j|`` with the sign cleared (``x`` widened to fp32 as python_ref does:
fp16 / bf16 exactly, fp64 rounded once; the bits of a non-negative float order as the
float does, so -0 == +0), every NaN mapped to ``0x7F800001`` (above +Inf, all NaNs
equal); the complemented index sends a tie to the lower index.  ``m_j < 2^31``, so
``K_j < 2^63`` is an ordinary non-negative int64, and all keys are distinct: "the k
largest keys" is exactly the first k of python_ref's stable sort.  The indices come
back ascending with no sort.  (N <= 2^32: the index fits its 32 bits; the wrapper
refuses more.)

A radix select, most significant 8-bit digit first (8 passes), with no host
synchronisation (k is a host integer, so the outputs' sizes are known):

* ``topk_histogram_kernel`` (pass p, one program per tile): the histogram of digit p
  over the tile's keys that match the prefix found so far (``tl.histogram`` with a
  mask), added into the pass's 256 global bins with integer atomics -- the counts,
  hence every decision, do not depend on the programs' order.
* ``topk_pick_kernel`` (one program): the bucket d holding the remaining k-th largest
  key (the largest d whose count from the top reaches it), appended to the prefix; the
  keys above it are subtracted.  When bucket d holds exactly the keys still wanted, the
  threshold ``prefix`` (lower digits zero) selects exactly k keys: ``done`` is set and
  later passes load nothing (their loads are masked off).  Keys are distinct, so the
  last digit's bucket holds one key and the 8th pass always completes.
* compaction, ``select = K_j >= threshold`` (exactly k elements), in index order:
  ``topk_count_kernel`` (a count per tile), ``topk_scan_kernel`` (one program: the
  tiles' exclusive offsets, chunk by chunk with a carry), ``topk_write_kernel`` (per
  tile, an exclusive ``tl.cumsum`` of the selection gives each selected element's
  slot: index int64, value fp32).

Bytes per element: 8 histogram passes read x at most (a pass after ``done`` reads
nothing; with distinct magnitudes the 4 magnitude digits decide, often fewer), plus 2
reads for the compaction, plus ``12 k`` written.  State (prefix, remaining, done), the
histograms and the tile counts (then offsets) are one int64 workspace zeroed by the
wrapper.

bf16 input is passed as its int16 bits and widened by a shift (``_helpers.load_f32``:
the interpreter's own bf16 -> fp32 conversion gets subnormals wrong), as the other
encodes do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _helpers as H

TOPK_BINS = tl.constexpr(256)  # 8-bit digits (the kernels and the wrapper's workspace size)
TOPK_PASSES = 8  # 32 bits of magnitude, 32 of index
TOPK_BLOCK = 1024  # elements per program of the histogram, count and write kernels
TOPK_SCAN_BLOCK = 1024  # tile counts per step of the scan
# The workspace (int64): [0] prefix, [1] remaining, [2] done, [3] unused, then
# TOPK_PASSES x TOPK_BINS histogram bins, then one count (then offset) per tile.
TOPK_STATE = tl.constexpr(4)


@triton.jit
def _topk_keys(x_ptr, j, m, BF16_BITS: tl.constexpr):
    """``K_j`` (int64) of the elements ``j`` (int64) where ``m``; x widened to fp32."""
    x = H.load_f32(x_ptr, j, m, BF16_BITS)
    mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    mag = tl.where(mag > 0x7F800000, 0x7F800001, mag)  # every NaN one key, above +Inf
    return (mag.to(tl.int64) << 32) | (0xFFFFFFFF - j), x


@triton.jit(do_not_specialize=["N"])
def topk_histogram_kernel(x_ptr, ws_ptr, N: tl.int64, PASS: tl.constexpr, BLOCK: tl.constexpr,
                          BF16_BITS: tl.constexpr):
    """Pass ``PASS``'s histogram of digit ``PASS`` (bits ``[56 - 8 PASS, 64 - 8 PASS)`` of the
    key) over this tile's keys that match the prefix on the digits above it."""
    done = tl.load(ws_ptr + 2)
    prefix = tl.load(ws_ptr + 0)
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = (j < N) & (done == 0)
    key, _ = _topk_keys(x_ptr, j, m, BF16_BITS)
    SHIFT: tl.constexpr = 56 - 8 * PASS
    if PASS > 0:
        high = -(1 << (64 - 8 * PASS))  # the digits above this one (two's complement mask)
        m = m & ((key & high) == (prefix & high))
    digit = ((key >> SHIFT) & 0xFF).to(tl.int32)
    counts = tl.histogram(digit, TOPK_BINS, mask=m)
    bins = tl.arange(0, TOPK_BINS)
    tl.atomic_add(ws_ptr + TOPK_STATE + PASS * TOPK_BINS + bins, counts.to(tl.int64), mask=(counts > 0) & (done == 0))


@triton.jit(do_not_specialize=["k"])
def topk_pick_kernel(ws_ptr, k: tl.int64, PASS: tl.constexpr):
    """One program: the digit of pass ``PASS`` that holds the remaining k-th largest key."""
    done = tl.load(ws_ptr + 2)
    if PASS == 0:
        want = k
    else:
        want = tl.load(ws_ptr + 1)
    d = tl.arange(0, TOPK_BINS)
    c = tl.load(ws_ptr + TOPK_STATE + PASS * TOPK_BINS + d)
    from_top = tl.sum(c, axis=0) - tl.cumsum(c, axis=0) + c  # keys in buckets >= d
    pick = tl.max(tl.where(from_top >= want, d, -1), axis=0)  # >= 0: bucket 0 counts everything left
    c_pick = tl.sum(tl.where(d == pick, c, 0), axis=0)
    rest = want - (tl.sum(tl.where(d == pick, from_top, 0), axis=0) - c_pick)  # 1 <= rest <= c_pick
    SHIFT: tl.constexpr = 56 - 8 * PASS
    live = done == 0
    tl.store(ws_ptr + 0, tl.load(ws_ptr + 0) | (pick.to(tl.int64) << SHIFT), mask=live)
    tl.store(ws_ptr + 1, rest, mask=live)
    tl.store(ws_ptr + 2, (c_pick == rest).to(tl.int64), mask=live)


@triton.jit(do_not_specialize=["N"])
def topk_count_kernel(x_ptr, ws_ptr, counts_ptr, N: tl.int64, BLOCK: tl.constexpr, BF16_BITS: tl.constexpr):
    """This tile's number of selected keys (``K_j >= threshold``)."""
    threshold = tl.load(ws_ptr + 0)
    t = tl.program_id(0).to(tl.int64)
    j = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = j < N
    key, _ = _topk_keys(x_ptr, j, m, BF16_BITS)
    tl.store(counts_ptr + t, tl.sum((m & (key >= threshold)).to(tl.int64), axis=0))


@triton.jit(do_not_specialize=["tiles"])
def topk_scan_kernel(counts_ptr, tiles: tl.int64, SCAN_BLOCK: tl.constexpr):
    """One program: each tile's count becomes its exclusive offset, in tile order."""
    carry = tl.zeros((), dtype=tl.int64)
    for s in range(0, tiles, SCAN_BLOCK):
        t = s + tl.arange(0, SCAN_BLOCK).to(tl.int64)
        c = tl.load(counts_ptr + t, mask=t < tiles, other=0)
        tl.store(counts_ptr + t, carry + tl.cumsum(c, axis=0) - c, mask=t < tiles)
        carry += tl.sum(c, axis=0)


@triton.jit(do_not_specialize=["N"])
def topk_write_kernel(x_ptr, ws_ptr, offsets_ptr, values_ptr, indices_ptr, N: tl.int64, BLOCK: tl.constexpr,
                      BF16_BITS: tl.constexpr):
    """This tile's selected elements at their slots, in index order."""
    threshold = tl.load(ws_ptr + 0)
    t = tl.program_id(0).to(tl.int64)
    j = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = j < N
    key, x = _topk_keys(x_ptr, j, m, BF16_BITS)
    sel = m & (key >= threshold)
    s = sel.to(tl.int64)
    slot = tl.load(offsets_ptr + t) + tl.cumsum(s, axis=0) - s
    tl.store(indices_ptr + slot, j, mask=sel)
    tl.store(values_ptr + slot, x, mask=sel)
