"""Triton kernels of the FedNAR step (``nar_step_`` and ``nar_step_batched_``).

Both ops run the same two kernels over a chunk table (``_tables.NarTable``): for
``nar_step_`` all tensors form one group, for ``nar_step_batched_`` each row of the
``[C, N]`` tensors is a group.  One program per chunk in both launches:

1. ``nar_norm_kernel``: ``partial[chunk] = sum over the chunk of norm_term(x, g)^2``.
2. ``nar_update_kernel``: every program re-combines its group's partials in a fixed
   order (the same order in every program, so all get the same bits), derives norm,
   scale and the skip decision, the group's first chunk writes the stats, and unless
   the step is skipped the program updates its chunk in place.

When one group has more than ``_tables.MAX_REDUNDANT_PARTIALS`` partials (a list of
thousands of tensors), re-combining them in every program would cost
``O(partials^2)`` reads, so ``group_sum_kernel`` sums each group once in between
(same helper, same order) and the update kernel reads that sum (``FINALIZED``).

Reference (python_ref/fednar.py) of one group, all arithmetic in ``ACC``::

    g = g / grad_scale                         (times 1 / grad_scale, as math.h)
    n = sqrt(sum(norm_term(x, g)^2)) ;  s = clip_scale(n)
    skipped = not isfinite(n) or found_inf != 0
    if not skipped: x, b = update(x, g, b, s)  (in place; nothing written otherwise)
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _helpers as H

NAR_COLS = tl.constexpr(8)  # = _tables.NAR_COLS


@triton.jit
def _norm_block(x_ptr, g_ptr, offs, n, wd, inv_gs, acc, ACC: tl.constexpr, MODE: tl.constexpr,
                HAS_GS: tl.constexpr, MASKED: tl.constexpr):
    g = H.nar_unscale(H.load_block(g_ptr, offs, n, ACC, MASKED), inv_gs, HAS_GS)
    if MODE == H.MODE_CO:
        x = H.load_block(x_ptr, offs, n, ACC, MASKED)
        v = H.nar_norm_term(x, g, wd, MODE)
    else:
        v = g  # modes grad/none never read x here
    return acc + v * v


@triton.jit
def nar_norm_kernel(tab_ptr, part_ptr, wd_ptr, gs_ptr, wd_value: tl.float64,
                    DTYPE: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                    WD_KIND: tl.constexpr, HAS_GS: tl.constexpr, ALIGNED: tl.constexpr,
                    BLOCK: tl.constexpr):
    """``part[c] = sum_{j in chunk c} norm_term(x_j, g_j / grad_scale)^2`` (acc dtype).

    Reads g (and x in mode co) once.  Grid: one program per chunk.
    """
    pid = tl.program_id(0).to(tl.int64)
    row = tab_ptr + pid * NAR_COLS
    x_ptr = H.table_ptr(tl.load(row + 0), DTYPE, ALIGNED)
    g_ptr = H.table_ptr(tl.load(row + 1), DTYPE, ALIGNED)
    n = tl.load(row + 3)
    group = tl.load(row + 4)
    if MODE == H.MODE_CO:
        wd = H.load_hyper(wd_value, wd_ptr, group, WD_KIND, ACC)
    else:
        wd = tl.full((), 0.0, ACC)
    inv_gs = H.nar_inv_grad_scale(gs_ptr, HAS_GS, ACC)

    acc = tl.zeros([BLOCK], ACC)
    n_full = n // BLOCK * BLOCK
    for start in range(0, n_full, BLOCK):
        offs = H.block_offsets(start, BLOCK, ALIGNED)
        acc = _norm_block(x_ptr, g_ptr, offs, n, wd, inv_gs, acc, ACC, MODE, HAS_GS, False)
    if n_full < n:
        offs = H.block_offsets(n_full, BLOCK, ALIGNED)
        acc = _norm_block(x_ptr, g_ptr, offs, n, wd, inv_gs, acc, ACC, MODE, HAS_GS, True)
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def group_sum_kernel(groups_ptr, part_ptr, sums_ptr, ACC: tl.constexpr, PBLOCK: tl.constexpr):
    """``sums[g] = sum(part[pbegin_g:pend_g])`` in the fixed order of ``sum_range``.

    Only used when a group has too many partials to re-combine in every update program.
    Grid: one program per group.
    """
    gid = tl.program_id(0).to(tl.int64)
    begin = tl.load(groups_ptr + 2 * gid)
    end = tl.load(groups_ptr + 2 * gid + 1)
    tl.store(sums_ptr + gid, H.sum_range(part_ptr, begin, end, ACC, PBLOCK))


@triton.jit
def _update_block(x_ptr, g_ptr, b_ptr, offs, n, scale, lr, wd, momentum, inv_gs,
                  ACC: tl.constexpr, MODE: tl.constexpr, HAS_MOM: tl.constexpr,
                  HAS_GS: tl.constexpr, MASKED: tl.constexpr):
    x = H.load_block(x_ptr, offs, n, ACC, MASKED)
    g = H.nar_unscale(H.load_block(g_ptr, offs, n, ACC, MASKED), inv_gs, HAS_GS)
    if HAS_MOM:
        b = H.load_block(b_ptr, offs, n, ACC, MASKED)
    else:
        b = x  # unused
    x, b = H.nar_update(x, g, b, scale, lr, wd, momentum, MODE, HAS_MOM)
    H.store_block(x_ptr, offs, n, x, MASKED)
    if HAS_MOM:
        H.store_block(b_ptr, offs, n, b, MASKED)


@triton.jit(do_not_specialize=["lr_value", "wd_value", "max_norm", "momentum"])
def nar_update_kernel(tab_ptr, part_ptr, norm_ptr, scale_ptr, skip_ptr,
                      lr_ptr, wd_ptr, gs_ptr, fi_ptr,
                      lr_value: tl.float64, wd_value: tl.float64, max_norm: tl.float64,
                      momentum: tl.float64,
                      DTYPE: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                      LR_KIND: tl.constexpr, WD_KIND: tl.constexpr, HAS_MOM: tl.constexpr,
                      HAS_GS: tl.constexpr, HAS_FI: tl.constexpr, FINALIZED: tl.constexpr,
                      ALIGNED: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr):
    """Per chunk ``c`` of group ``k``::

        n_k = sqrt(sum(part[pbegin_k:pend_k]))      (or sqrt(part[k]) if FINALIZED)
        s_k = clip_scale(n_k) ; skipped_k = not isfinite(n_k) or found_inf != 0
        c is the group's first chunk: norm[k], scale[k], skipped[k] = n_k, s_k, skipped_k
        not skipped_k: x, b = update(x, g / grad_scale, b, s_k) over the chunk, in place

    Reads x, g (and b), writes x (and b).  Grid: one program per chunk.
    """
    pid = tl.program_id(0).to(tl.int64)
    row = tab_ptr + pid * NAR_COLS
    n = tl.load(row + 3)
    group = tl.load(row + 4)
    pbegin = tl.load(row + 5)
    if FINALIZED:
        sumsq = tl.load(part_ptr + group).to(ACC)
    else:
        sumsq = H.sum_range(part_ptr, pbegin, tl.load(row + 6), ACC, PBLOCK)
    norm = H.sqrt_rn(sumsq, ACC)
    scale = H.nar_clip_scale(norm, H.scalar_arg(max_norm, ACC), MODE, ACC)
    ok = H.nar_norm_ok(norm)
    if HAS_FI:
        ok = ok & (tl.load(fi_ptr) == 0)
    if pid == pbegin:
        tl.store(norm_ptr + group, norm)
        tl.store(scale_ptr + group, scale)
        tl.store(skip_ptr + group, ok == 0)
    if ok:
        x_ptr = H.table_ptr(tl.load(row + 0), DTYPE, ALIGNED)
        g_ptr = H.table_ptr(tl.load(row + 1), DTYPE, ALIGNED)
        if HAS_MOM:
            b_ptr = H.table_ptr(tl.load(row + 2), DTYPE, ALIGNED)
        else:
            b_ptr = x_ptr  # unused
        lr = H.load_hyper(lr_value, lr_ptr, group, LR_KIND, ACC)
        wd = H.load_hyper(wd_value, wd_ptr, group, WD_KIND, ACC)
        mom = H.scalar_arg(momentum, ACC)
        inv_gs = H.nar_inv_grad_scale(gs_ptr, HAS_GS, ACC)
        n_full = n // BLOCK * BLOCK
        for start in range(0, n_full, BLOCK):
            offs = H.block_offsets(start, BLOCK, ALIGNED)
            _update_block(x_ptr, g_ptr, b_ptr, offs, n, scale, lr, wd, mom, inv_gs,
                          ACC, MODE, HAS_MOM, HAS_GS, False)
        if n_full < n:
            offs = H.block_offsets(n_full, BLOCK, ALIGNED)
            _update_block(x_ptr, g_ptr, b_ptr, offs, n, scale, lr, wd, mom, inv_gs,
                          ACC, MODE, HAS_MOM, HAS_GS, True)
