"""Triton kernels of the weighted aggregation (``aggregate``) and of its backward
(``client_dots``).

Both are one pass over the clients: program ``p`` owns columns
``[p * BLOCK, (p + 1) * BLOCK)`` and loops over the clients, so every client element is
read once and ``out`` written once.  ``BLOCK`` comes from N and the dtype only
(``_chunks.aggregate_tile``: small N gets narrow tiles and so enough programs to fill
the GPU), never from the device, so the partial sums -- and the results -- are the same
on every GPU.  Per-client sums are written as one partial per (client, program);
``row_sum_kernel`` then adds each row of partials in a fixed order (deterministic, no
float atomics).  The finalize is a separate, tiny launch: nothing later in the pass
could combine the partials (unlike the FedNAR update kernel), and it also writes the
zero statistics of a disabled call.

Differential privacy (``NOISE``, a compile-time flag): the epilogue adds Gaussian noise
drawn in the kernel, ``out[j] = gamma * total[j] + std * n_j`` with ``n_j = normal(key,
j)`` of ``_noise.py`` (the contract of issue 31; the product and the sum each rounded
once, by ``_noise.add_noise``).  Only the epilogue changes: the clients are summed by
the same code as without noise, so ``q``, ``Q`` and ``gamma * total`` keep their bits,
and without ``NOISE`` the kernel is exactly what it was.

Clients: a contiguous ``[C, N]`` tensor (``TWO_D``: client ``i`` at address
``x_base + i * N * ESIZE``, no table) or a list of 1-D tensors (a ``[C, 2]`` table of ``(address, flags)``).  Each
client's loads are vectorised iff that client is 16-byte aligned (decided per client,
at run time); ``out`` / ``g`` are kernel arguments, whose alignment Triton specialises.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _helpers as H
from . import _noise as NZ


@triton.jit
def _load_client(ctab_ptr, x_base, i, offs, N, mis, DTYPE: tl.constexpr, ESIZE: tl.constexpr,
                 ACC: tl.constexpr, TWO_D: tl.constexpr, MASKED: tl.constexpr):
    """Columns ``offs`` of client ``i`` in ``ACC``."""
    if TWO_D:
        addr = x_base + i * N * ESIZE
        aligned = (mis >= 0) & ((mis + i * N * ESIZE) % 16 == 0)
    else:
        addr = tl.load(ctab_ptr + 2 * i)
        aligned = (tl.load(ctab_ptr + 2 * i + 1) & H.FLAG_ALIGNED16) != 0
    if aligned:
        x = H.load_block(H.table_ptr(addr, DTYPE, True), offs, N, ACC, MASKED)
    else:
        x = H.load_block(H.table_ptr(addr, DTYPE, False), offs, N, ACC, MASKED)
    return x


@triton.jit
def _aggregate_block(ctab_ptr, x_base, w_ptr, out_ptr, part_ptr, gamma, std_ptr, std_value, noise_key, C, N, nblk,
                     mis, pid, DTYPE: tl.constexpr, ESIZE: tl.constexpr, ACC: tl.constexpr, TWO_D: tl.constexpr,
                     NOISE: tl.constexpr, STD_KIND: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = H.block_offsets(pid * BLOCK, BLOCK)
    total = tl.zeros([BLOCK], ACC)
    for c in range(C):
        i = tl.cast(c, tl.int64)  # int64 before multiplying
        x = _load_client(ctab_ptr, x_base, i, offs, N, mis, DTYPE, ESIZE, ACC, TWO_D, MASKED)
        w = tl.load(w_ptr + i).to(ACC)
        tl.store(part_ptr + i * nblk + pid, tl.sum(x * x, axis=0))
        # weight exactly 0: exactly 0 (never 0 * nan); x is selected before the multiply,
        # so 0 * nan is not even computed (x * w == w * x bitwise otherwise)
        total = total + tl.where(w != 0.0, x, 0.0) * w
    tl.store(part_ptr + tl.cast(C, tl.int64) * nblk + pid, tl.sum(total * total, axis=0))
    value = gamma * total
    if NOISE:
        std = H.load_hyper(std_value, std_ptr, 0, STD_KIND, ACC)
        value = NZ.add_noise(value, std, noise_key, pid * BLOCK, ACC, BLOCK)
    H.store_block(out_ptr, offs, N, value, MASKED)


@triton.jit(do_not_specialize=["gamma_value", "std_value", "noise_key", "x_base", "C", "N", "nblk", "mis"])
def aggregate_kernel(ctab_ptr, w_ptr, out_ptr, part_ptr, skip_ptr, gamma_ptr, std_ptr,
                     gamma_value: tl.float64, std_value: tl.float64, noise_key: tl.int64, x_base: tl.int64,
                     C: tl.int64, N: tl.int64, nblk: tl.int64, mis: tl.int64,
                     DTYPE: tl.constexpr, ESIZE: tl.constexpr, ACC: tl.constexpr, TWO_D: tl.constexpr,
                     HAS_SKIP: tl.constexpr, GAMMA_KIND: tl.constexpr, NOISE: tl.constexpr,
                     STD_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """For the columns ``J`` of program ``p`` (``nblk`` programs), in acc dtype::

        total_J          = sum_i (w_i * X_i[J] if w_i != 0 else 0)   (i = 0, 1, ... in order)
        out[J]           = gamma * total_J          (cast to out's dtype)
                           gamma * total_J + std * normal(noise_key, J)   with NOISE
        part[i, p]       = sum_J X_i[J]^2           (i < C)
        part[C, p]       = sum_J total_J^2

    ``std``: ``std_value`` or ``std_ptr[0]`` (``STD_KIND``, as ``GAMMA_KIND``), in acc.
    With ``skip`` true (read here) nothing is read or written.  Grid: ``nblk``.
    """
    run = True
    if HAS_SKIP:
        run = tl.load(skip_ptr) == 0
    if run:
        pid = tl.program_id(0).to(tl.int64)
        gamma = H.load_hyper(gamma_value, gamma_ptr, 0, GAMMA_KIND, ACC)
        if (pid + 1) * BLOCK <= N:
            _aggregate_block(ctab_ptr, x_base, w_ptr, out_ptr, part_ptr, gamma, std_ptr, std_value, noise_key, C, N,
                             nblk, mis, pid, DTYPE, ESIZE, ACC, TWO_D, NOISE, STD_KIND, BLOCK, False)
        else:
            _aggregate_block(ctab_ptr, x_base, w_ptr, out_ptr, part_ptr, gamma, std_ptr, std_value, noise_key, C, N,
                             nblk, mis, pid, DTYPE, ESIZE, ACC, TWO_D, NOISE, STD_KIND, BLOCK, True)


@triton.jit
def _dots_block(ctab_ptr, x_base, g_ptr, part_ptr, C, N, nblk, mis, pid, DTYPE: tl.constexpr,
                ESIZE: tl.constexpr, ACC: tl.constexpr, TWO_D: tl.constexpr, BLOCK: tl.constexpr,
                MASKED: tl.constexpr):
    offs = H.block_offsets(pid * BLOCK, BLOCK)
    g = H.load_block(g_ptr, offs, N, ACC, MASKED)
    for c in range(C):
        i = tl.cast(c, tl.int64)  # int64 before multiplying
        x = _load_client(ctab_ptr, x_base, i, offs, N, mis, DTYPE, ESIZE, ACC, TWO_D, MASKED)
        tl.store(part_ptr + i * nblk + pid, tl.sum(x * g, axis=0))


@triton.jit(do_not_specialize=["x_base", "C", "N", "nblk", "mis"])
def client_dots_kernel(ctab_ptr, g_ptr, part_ptr, x_base: tl.int64, C: tl.int64, N: tl.int64, nblk: tl.int64,
                       mis: tl.int64,
                       DTYPE: tl.constexpr, ESIZE: tl.constexpr, ACC: tl.constexpr, TWO_D: tl.constexpr,
                       BLOCK: tl.constexpr):
    """``part[i, p] = sum_{J of program p} X_i[J] * g[J]`` (acc dtype).  Grid: ``nblk``."""
    pid = tl.program_id(0).to(tl.int64)
    if (pid + 1) * BLOCK <= N:
        _dots_block(ctab_ptr, x_base, g_ptr, part_ptr, C, N, nblk, mis, pid, DTYPE, ESIZE, ACC, TWO_D, BLOCK, False)
    else:
        _dots_block(ctab_ptr, x_base, g_ptr, part_ptr, C, N, nblk, mis, pid, DTYPE, ESIZE, ACC, TWO_D, BLOCK, True)


@triton.jit(do_not_specialize=["nblk", "C"])
def row_sum_kernel(part_ptr, q_ptr, total_ptr, skip_ptr, nblk: tl.int64, C: tl.int64, ACC: tl.constexpr,
                   HAS_SKIP: tl.constexpr, PBLOCK: tl.constexpr):
    """Row ``r`` of the partials summed in a fixed order -- 0 when ``skip`` is true --
    into ``q[r]`` for ``r < C`` and ``total[0]`` for ``r == C`` (two separate outputs:
    a custom op may not return two views of one buffer).  Grid: one program per row.
    """
    r = tl.program_id(0).to(tl.int64)
    run = True
    if HAS_SKIP:
        run = tl.load(skip_ptr) == 0
    if run:
        s = H.sum_range(part_ptr, r * nblk, (r + 1) * nblk, ACC, PBLOCK)
    else:
        s = tl.full((), 0.0, ACC)
    if r < C:
        tl.store(q_ptr + r, s)
    else:
        tl.store(total_ptr, s)
