"""Triton kernel of the server optimizer step (``server_update_``): FedAvg, FedExP,
FedAvgM, ASNES, FedAdagrad, FedAdam and FedYogi in one pass over the data.

One launch for all tensors of a call, over a chunk table of the original tensors
(``_tables.ServerTable``, rows ``[x, D, m, v, len, 0, flags, 0]`` of
``backends/_chunks.py``), one program per chunk, each program looping over its chunk
in ``BLOCK``-wide steps (unmasked full blocks, one masked tail).  Nothing is reduced,
so the result is purely elementwise and deterministic.  Vector width is decided per
chunk (the row's aligned flag): the update views at odd offsets of one flat mean
vector only cost their own chunks the 16-byte accesses.

Reference (math.h ``server_update_*``, python_ref/server_optimizers.py), per element,
all in ``ACC`` (fp32; fp64 for fp64 params), each operation separately rounded::

    RULE 0 sgd:       x <- gamma * (x - lr * D)
    RULE 1 momentum:  b <- beta1 * b + D ;  s = beta1 * b + D if NESTEROV else b
                      x <- x - lr * s
    RULE 2-4:         m <- beta1 * m + (1 - beta1) * D ;  d2 = D * D
                      2 adagrad: v <- v + d2
                      3 adam:    v <- beta2 * v + (1 - beta2) * d2
                      4 yogi:    v <- v - (1 - beta2) * d2 * sign(v - d2)
                      x <- x - lr * (m / (sqrt(v) + tau))

``D`` (the round's mean update) is read in the acc dtype; ``x``, ``b`` = ``m`` and
``v`` are read and written in the params' dtype (the new ``m``, ``v`` are used in acc
precision before their store rounds them).  Traffic per element, in words: sgd 3
(read x, D; write x), momentum 5 (+ read/write b), adaptive 7 (+ read/write m and v).

``skip`` (0-d bool, optional) is read by every program: when true the program writes
nothing, so a skipped step leaves every bit in place without a host sync.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _helpers as H

@triton.jit
def _server_block(x_ptr, d_ptr, m_ptr, v_ptr, offs, n, lr, gamma, beta1, beta2, tau,
                  ACC: tl.constexpr, RULE: tl.constexpr, NESTEROV: tl.constexpr,
                  MASKED: tl.constexpr):
    x = H.load_block(x_ptr, offs, n, ACC, MASKED)
    d = H.load_block(d_ptr, offs, n, ACC, MASKED)
    if RULE == H.SERVER_SGD:
        x = H.server_update_sgd(x, d, lr, gamma)
    elif RULE == H.SERVER_MOMENTUM:
        b = H.load_block(m_ptr, offs, n, ACC, MASKED)
        x, b = H.server_update_momentum(x, d, b, lr, beta1, NESTEROV)
        H.store_block(m_ptr, offs, n, b, MASKED)
    else:
        # Masked-off tail lanes read v = 0 and may compute 0 / 0 here; they are never
        # stored (and GPUs do not trap on it).
        m = H.load_block(m_ptr, offs, n, ACC, MASKED)
        v = H.load_block(v_ptr, offs, n, ACC, MASKED)
        x, m, v = H.server_update_adaptive(x, d, m, v, lr, beta1, beta2, tau, RULE, ACC)
        H.store_block(m_ptr, offs, n, m, MASKED)
        H.store_block(v_ptr, offs, n, v, MASKED)
    H.store_block(x_ptr, offs, n, x, MASKED)


@triton.jit
def _server_chunk(row, n, lr, gamma, beta1, beta2, tau, DTYPE: tl.constexpr, ACC: tl.constexpr,
                  RULE: tl.constexpr, NESTEROV: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    x_ptr = H.table_ptr(tl.load(row + 0), DTYPE, ALIGNED)
    d_ptr = H.table_ptr(tl.load(row + 1), ACC, ALIGNED)
    if RULE == H.SERVER_SGD:
        m_ptr = x_ptr  # unused
    else:
        m_ptr = H.table_ptr(tl.load(row + 2), DTYPE, ALIGNED)
    if RULE >= H.SERVER_ADAGRAD:
        v_ptr = H.table_ptr(tl.load(row + 3), DTYPE, ALIGNED)
    else:
        v_ptr = x_ptr  # unused
    n_full = n // BLOCK * BLOCK
    for start in range(0, n_full, BLOCK):
        offs = H.block_offsets(start, BLOCK)
        _server_block(x_ptr, d_ptr, m_ptr, v_ptr, offs, n, lr, gamma, beta1, beta2, tau,
                      ACC, RULE, NESTEROV, False)
    if n_full < n:
        offs = H.block_offsets(n_full, BLOCK)
        _server_block(x_ptr, d_ptr, m_ptr, v_ptr, offs, n, lr, gamma, beta1, beta2, tau,
                      ACC, RULE, NESTEROV, True)


@triton.jit(do_not_specialize=["lr_value", "gamma_value", "beta1", "beta2", "tau"])
def server_update_kernel(tab_ptr, lr_ptr, gamma_ptr, skip_ptr,
                         lr_value: tl.float64, gamma_value: tl.float64, beta1: tl.float64,
                         beta2: tl.float64, tau: tl.float64,
                         DTYPE: tl.constexpr, ACC: tl.constexpr, RULE: tl.constexpr,
                         NESTEROV: tl.constexpr, LR_KIND: tl.constexpr, GAMMA_KIND: tl.constexpr,
                         HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    """Per chunk ``[x, D, m, v, len, 0, flags, 0]`` of the table: unless ``skip[0]``,
    apply ``RULE`` over the chunk in place (x, and m = b / v where the rule has them).

    ``x``, ``m``, ``v`` are ``DTYPE``; ``D``, ``lr_ptr[0]``, ``gamma_ptr[0]`` are ``ACC``.
    ``LR_KIND`` / ``GAMMA_KIND``: ``H.HYPER_FLOAT`` (the fp64 argument) or
    ``H.HYPER_SCALAR`` (the 0-d tensor, loaded here).  Grid: one program per chunk.
    """
    run = True
    if HAS_SKIP:
        run = tl.load(skip_ptr) == 0
    if run:
        pid = tl.program_id(0).to(tl.int64)
        row = tab_ptr + pid * H.ROW_COLS
        n = tl.load(row + H.COL_LEN)
        aligned = (tl.load(row + H.COL_FLAGS) & H.FLAG_ALIGNED16) != 0
        lr = H.load_hyper(lr_value, lr_ptr, 0, LR_KIND, ACC)
        if RULE == H.SERVER_SGD:
            gamma = H.load_hyper(gamma_value, gamma_ptr, 0, GAMMA_KIND, ACC)
        else:
            gamma = lr  # unused: only sgd has gamma (a gamma tensor is never read)
        b1 = H.scalar_arg(beta1, ACC)
        b2 = H.scalar_arg(beta2, ACC)
        t = H.scalar_arg(tau, ACC)
        if aligned:
            _server_chunk(row, n, lr, gamma, b1, b2, t, DTYPE, ACC, RULE, NESTEROV, True, BLOCK)
        else:
            _server_chunk(row, n, lr, gamma, b1, b2, t, DTYPE, ACC, RULE, NESTEROV, False, BLOCK)
