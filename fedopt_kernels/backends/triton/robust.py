"""Triton kernel of ``coordinate_select`` (contract: :mod:`fedopt_kernels.backends`;
oracle: python_ref/robust.py): the coordinate-wise median, beta-trimmed mean and
Bulyan's closest-to-median mean, one pass over the kept clients.

Program ``p`` owns columns ``[p * BLOCK, (p + 1) * BLOCK)``.  It loads the ``[BLOCK, CP]``
tile of all clients' values of those columns (``CP`` = C rounded up to a power of two;
clients left out and the padding read as ``+inf``, so they sort last), sorts each
column's ``CP`` values in registers (``tl.sort`` along the last axis, a bitonic network;
a kept NaN sorts as ``+inf`` and is put back as NaN at the top of the ``m`` kept ranks:
NaN after every number, python_ref's order) and reduces the sorted values in the acc
dtype:

* ``MODE = 0`` (trim): the mean of ``v[k .. m-k)``, ``k = min(count, (m - 1) // 2)``;
* ``MODE = 1`` (closest): the mean of the ``count`` values closest to the median, the
  window found by dropping the farther end (the upper one on a tie), ``m - count`` steps
  for every column at once.

The tile shape comes from C only (``BLOCK * CP = 4096`` values per program), never from
the device.  Each program also writes, per client, whether a kept value of its columns
is NaN/Inf (``bad[i, p]``); the host reduces those with ``any`` (exact).  ``keep``,
``count`` and ``skip`` are loaded in the kernel: no host sync.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _helpers as H

TILE_VALUES = 4096  # BLOCK * CP per program
MAX_CLIENTS = 1024


def tile_shape(C: int):
    """``(CP, BLOCK)`` for ``C`` clients: ``CP`` the next power of two (at least 2),
    ``BLOCK * CP = TILE_VALUES`` (at least 4 columns)."""
    cp = max(2, triton.next_power_of_2(C))
    return cp, max(4, TILE_VALUES // cp)


@triton.jit(do_not_specialize=["C", "N", "nblk"])
def coordinate_select_kernel(x_ptr, keep_ptr, count_ptr, out_ptr, bad_ptr, skip_ptr, C: tl.int64, N: tl.int64,
                             nblk: tl.int64, ACC: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr,
                             MODE: tl.constexpr, HAS_SKIP: tl.constexpr):
    """``out[J] = select(sorted kept values of column J)`` (see the module).  Grid: ``nblk``."""
    run = True
    if HAS_SKIP:
        run = tl.load(skip_ptr) == 0
    if run:
        pid = tl.program_id(0).to(tl.int64)
        cols = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        cidx = tl.arange(0, CP)
        in_c = cidx < C
        keep = (tl.load(keep_ptr + cidx, mask=in_c, other=0) != 0) & in_c
        m = tl.sum(keep.to(tl.int64), axis=0)
        in_n = cols < N
        mask = in_n[:, None] & keep[None, :]
        x = tl.load(x_ptr + cidx.to(tl.int64)[None, :] * N + cols[:, None], mask=mask, other=0.0).to(ACC)
        big = tl.full((), 3.4028234663852886e38, ACC)  # a value is finite iff |x| <= this (fp32 max)
        if ACC == tl.float64:
            big = tl.full((), 1.7976931348623157e308, ACC)
        nonfinite = (~(tl.abs(x) <= big)) & mask
        tl.store(bad_ptr + cidx.to(tl.int64) * nblk + pid, tl.max(nonfinite.to(tl.int8), axis=0), mask=in_c)
        # NaN after every number (python_ref's torch.sort order): tl.sort leaves a NaN
        # unordered, so the kept NaNs sort as +inf and the top n_nan of the m kept ranks
        # are then made NaN again
        isnan = (x != x) & keep[None, :]
        v = tl.sort(tl.where(keep[None, :] & (x == x), x, float("inf")), dim=1)
        n_nan = tl.sum(isnan.to(tl.int64), axis=1)
        count = tl.load(count_ptr)
        rank = cidx.to(tl.int64)[None, :]
        v = tl.where((rank >= m - n_nan[:, None]) & (rank < m), float("nan"), v)
        if MODE == 0:
            k = tl.minimum(count, (m - 1) // 2)
            sel = (rank >= k) & (rank < m - k)
            s = tl.sum(tl.where(sel, v, 0.0), axis=1)
            res = H.div_rn(s, tl.maximum(m - 2 * k, 1).to(ACC), ACC)
        else:
            beta = tl.maximum(tl.minimum(count, m), 1)
            a = tl.sum(tl.where(rank == (m - 1) // 2, v, 0.0), axis=1)
            b = tl.sum(tl.where(rank == m // 2, v, 0.0), axis=1)
            med = tl.where(m % 2 == 1, a, H.div_rn(a + b, tl.full((), 2.0, ACC), ACC))
            lo = tl.zeros([BLOCK], tl.int64)
            hi = tl.zeros([BLOCK], tl.int64) + (m - 1)
            for _ in range(m - beta):
                vlo = tl.sum(tl.where(rank == lo[:, None], v, 0.0), axis=1)
                vhi = tl.sum(tl.where(rank == hi[:, None], v, 0.0), axis=1)
                drop_lo = tl.abs(vlo - med) > tl.abs(vhi - med)
                lo = tl.where(drop_lo, lo + 1, lo)
                hi = tl.where(drop_lo, hi, hi - 1)
            sel = (rank >= lo[:, None]) & (rank <= hi[:, None])
            s = tl.sum(tl.where(sel, v, 0.0), axis=1)
            res = H.div_rn(s, beta.to(ACC), ACC)
        res = tl.where(m > 0, res, 0.0)
        tl.store(out_ptr + cols, res.to(out_ptr.dtype.element_ty), mask=in_n)
