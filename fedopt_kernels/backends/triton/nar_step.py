"""Triton kernels of the FedNAR step (``nar_step_`` and ``nar_step_batched_``).

Both ops run the same two kernels, one program per chunk (layout and chunk rule:
``backends/_chunks.py``).  For ``nar_step_`` all tensors form one group and the chunks
come from a table (``_tables.NarTable``); for ``nar_step_batched_`` each row of the
contiguous ``[C, N]`` tensors is a group and there is no table (``ROWS``): program
``p`` is chunk ``p % row_chunks`` of row ``p // row_chunks``, its addresses computed
from the tensors' base addresses (kernel arguments).

1. ``nar_norm_kernel``: ``partial[chunk] = sum over the chunk of norm_term(x, g)^2``.
2. ``nar_update_kernel``: every program re-combines its group's partials in a fixed
   order (the same order in every program, so all get the same bits), derives norm,
   scale and the skip decision, the group's first chunk writes the stats, and unless
   the step is skipped the program updates its chunk in place.

When one group has more than ``MAX_REDUNDANT_PARTIALS`` partials (a list of thousands of
tensors), re-combining them in every program would cost ``O(partials^2)`` reads, so
``group_sum_kernel`` sums each group once in between (same helper, same order, same
``num_warps``) and the update kernel reads that sum (``FINALIZED``).

Vector width is decided per chunk: a chunk whose pointers are all 16-byte aligned (the
table's flag, or computed from the common base misalignment ``mis`` in ``ROWS`` mode)
runs the vectorised body, any other chunk the scalar one -- the same arithmetic in the
same order, so the results do not depend on it.

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


@triton.jit
def _locate(tab_ptr, groups_ptr, x_base, g_base, b_base, pid, row_len, row_chunks, chunk, mis,
            ESIZE: tl.constexpr, ROWS: tl.constexpr):
    """``(x, g, b addresses, len, group, pbegin, pend, aligned)`` of chunk ``pid``.

    ``ROWS``: chunk ``pid % row_chunks`` of row ``pid // row_chunks`` of ``[C, N]``
    tensors at ``x_base`` / ``g_base`` / ``b_base`` (addresses); otherwise row ``pid``
    of the chunk table.
    """
    if ROWS:
        r = pid // row_chunks
        start = (pid - r * row_chunks) * chunk
        n = tl.minimum(chunk, row_len - start)
        off = r * row_len + start
        x_ptr = x_base + off * ESIZE
        g_ptr = g_base + off * ESIZE
        b_ptr = b_base + off * ESIZE
        group = r
        pbegin = r * row_chunks
        pend = pbegin + row_chunks
        aligned = (mis >= 0) & ((mis + off * ESIZE) % 16 == 0)
    else:
        row = tab_ptr + pid * H.ROW_COLS
        x_ptr = tl.load(row + 0)
        g_ptr = tl.load(row + 1)
        b_ptr = tl.load(row + 2)
        n = tl.load(row + H.COL_LEN)
        group = tl.load(row + H.COL_GROUP)
        aligned = (tl.load(row + H.COL_FLAGS) & H.FLAG_ALIGNED16) != 0
        pbegin = tl.load(groups_ptr + 2 * group)
        pend = tl.load(groups_ptr + 2 * group + 1)
    return x_ptr, g_ptr, b_ptr, n, group, pbegin, pend, aligned


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
def _norm_chunk(x_addr, g_addr, n, wd, inv_gs, DTYPE: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                HAS_GS: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    x_ptr = H.table_ptr(x_addr, DTYPE, ALIGNED)
    g_ptr = H.table_ptr(g_addr, DTYPE, ALIGNED)
    acc = tl.zeros([BLOCK], ACC)
    n_full = n // BLOCK * BLOCK
    for start in range(0, n_full, BLOCK):
        offs = H.block_offsets(start, BLOCK)
        acc = _norm_block(x_ptr, g_ptr, offs, n, wd, inv_gs, acc, ACC, MODE, HAS_GS, False)
    if n_full < n:
        offs = H.block_offsets(n_full, BLOCK)
        acc = _norm_block(x_ptr, g_ptr, offs, n, wd, inv_gs, acc, ACC, MODE, HAS_GS, True)
    return tl.sum(acc, axis=0)


@triton.jit(do_not_specialize=["wd_value", "x_base", "g_base", "row_len", "row_chunks", "chunk", "mis"])
def nar_norm_kernel(tab_ptr, groups_ptr, part_ptr, wd_ptr, gs_ptr, wd_value: tl.float64,
                    x_base: tl.int64, g_base: tl.int64,
                    row_len: tl.int64, row_chunks: tl.int64, chunk: tl.int64, mis: tl.int64,
                    DTYPE: tl.constexpr, ESIZE: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                    WD_KIND: tl.constexpr, HAS_GS: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):
    """``part[c] = sum_{j in chunk c} norm_term(x_j, g_j / grad_scale)^2`` (acc dtype).

    Reads g (and x in mode co) once.  Grid: one program per chunk.
    """
    pid = tl.program_id(0).to(tl.int64)
    x_addr, g_addr, _b, n, group, _pb, _pe, aligned = _locate(
        tab_ptr, groups_ptr, x_base, g_base, x_base, pid, row_len, row_chunks, chunk, mis, ESIZE, ROWS)
    if MODE == H.MODE_CO:
        wd = H.load_hyper(wd_value, wd_ptr, group, WD_KIND, ACC)
    else:
        wd = tl.full((), 0.0, ACC)
    inv_gs = H.nar_inv_grad_scale(gs_ptr, HAS_GS, ACC)
    if aligned:
        s = _norm_chunk(x_addr, g_addr, n, wd, inv_gs, DTYPE, ACC, MODE, HAS_GS, True, BLOCK)
    else:
        s = _norm_chunk(x_addr, g_addr, n, wd, inv_gs, DTYPE, ACC, MODE, HAS_GS, False, BLOCK)
    tl.store(part_ptr + pid, s)


@triton.jit(do_not_specialize=["row_chunks"])
def group_sum_kernel(groups_ptr, part_ptr, sums_ptr, row_chunks: tl.int64, ACC: tl.constexpr, PBLOCK: tl.constexpr,
                     ROWS: tl.constexpr):
    """``sums[g] = sum(part[pbegin_g:pend_g])`` in the fixed order of ``sum_range``.

    Only used when a group has too many partials to re-combine in every update program.
    The range comes from the group table (list forms) or, for the table-free ``[C, N]``
    form (``ROWS``), from the row: ``[g * row_chunks, (g + 1) * row_chunks)``.
    Grid: one program per group.
    """
    gid = tl.program_id(0).to(tl.int64)
    if ROWS:
        begin = gid * row_chunks
        end = begin + row_chunks
    else:
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


@triton.jit
def _update_chunk(x_addr, g_addr, b_addr, n, scale, lr, wd, momentum, inv_gs, DTYPE: tl.constexpr,
                  ACC: tl.constexpr, MODE: tl.constexpr, HAS_MOM: tl.constexpr,
                  HAS_GS: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    x_ptr = H.table_ptr(x_addr, DTYPE, ALIGNED)
    g_ptr = H.table_ptr(g_addr, DTYPE, ALIGNED)
    if HAS_MOM:
        b_ptr = H.table_ptr(b_addr, DTYPE, ALIGNED)
    else:
        b_ptr = x_ptr  # unused
    n_full = n // BLOCK * BLOCK
    for start in range(0, n_full, BLOCK):
        offs = H.block_offsets(start, BLOCK)
        _update_block(x_ptr, g_ptr, b_ptr, offs, n, scale, lr, wd, momentum, inv_gs,
                      ACC, MODE, HAS_MOM, HAS_GS, False)
    if n_full < n:
        offs = H.block_offsets(n_full, BLOCK)
        _update_block(x_ptr, g_ptr, b_ptr, offs, n, scale, lr, wd, momentum, inv_gs,
                      ACC, MODE, HAS_MOM, HAS_GS, True)


@triton.jit(do_not_specialize=["lr_value", "wd_value", "max_norm", "momentum", "x_base", "g_base", "b_base",
                               "row_len", "row_chunks", "chunk", "mis"])
def nar_update_kernel(tab_ptr, groups_ptr, part_ptr, norm_ptr, scale_ptr, skip_ptr,
                      lr_ptr, wd_ptr, gs_ptr, fi_ptr,
                      lr_value: tl.float64, wd_value: tl.float64, max_norm: tl.float64,
                      momentum: tl.float64, x_base: tl.int64, g_base: tl.int64, b_base: tl.int64,
                      row_len: tl.int64, row_chunks: tl.int64, chunk: tl.int64, mis: tl.int64,
                      DTYPE: tl.constexpr, ESIZE: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                      LR_KIND: tl.constexpr, WD_KIND: tl.constexpr, HAS_MOM: tl.constexpr,
                      HAS_GS: tl.constexpr, HAS_FI: tl.constexpr, FINALIZED: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr):
    """Per chunk ``c`` of group ``k``::

        n_k = sqrt(sum(part[pbegin_k:pend_k]))      (or sqrt(part[k]) if FINALIZED)
        s_k = clip_scale(n_k) ; skipped_k = not isfinite(n_k) or found_inf != 0
        c is the group's first chunk: norm[k], scale[k], skipped[k] = n_k, s_k, skipped_k
        not skipped_k: x, b = update(x, g / grad_scale, b, s_k) over the chunk, in place

    Reads x, g (and b), writes x (and b).  Grid: one program per chunk.
    """
    pid = tl.program_id(0).to(tl.int64)
    x_addr, g_addr, b_addr, n, group, pbegin, pend, aligned = _locate(
        tab_ptr, groups_ptr, x_base, g_base, b_base, pid, row_len, row_chunks, chunk, mis, ESIZE, ROWS)
    if FINALIZED:
        sumsq = tl.load(part_ptr + group).to(ACC)
    else:
        sumsq = H.sum_range(part_ptr, pbegin, pend, ACC, PBLOCK)
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
        lr = H.load_hyper(lr_value, lr_ptr, group, LR_KIND, ACC)
        wd = H.load_hyper(wd_value, wd_ptr, group, WD_KIND, ACC)
        mom = H.scalar_arg(momentum, ACC)
        inv_gs = H.nar_inv_grad_scale(gs_ptr, HAS_GS, ACC)
        if aligned:
            _update_chunk(x_addr, g_addr, b_addr, n, scale, lr, wd, mom, inv_gs, DTYPE, ACC, MODE, HAS_MOM,
                          HAS_GS, True, BLOCK)
        else:
            _update_chunk(x_addr, g_addr, b_addr, n, scale, lr, wd, mom, inv_gs, DTYPE, ACC, MODE, HAS_MOM,
                          HAS_GS, False, BLOCK)
