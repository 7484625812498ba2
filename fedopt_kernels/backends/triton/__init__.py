"""The ``triton`` backend: fused Triton kernels behind the backend contract
(fedopt_kernels/backends/__init__.py; semantics in csrc/registration.cpp).

Kernels: ``nar_step.py`` (FedNAR: one norm launch + one update launch for all tensors
of a call, over a chunk table of the original tensors, or table-free over the rows of
``[C, N]`` tensors), ``aggregate.py`` (aggregation
and ``client_dots``: one pass over the clients + a tiny fixed-order finalize),
``server_update.py`` (the server optimizers' elementwise step: one launch over a chunk
table, no reduction), ``add_noise.py`` (DP noise added in place; the same noise is drawn
in the aggregation's epilogue), math in ``_helpers.py`` (mirrors
csrc/include/fedopt/math.h), the counter-based Gaussian noise in ``_noise.py`` (mirrors
csrc/include/fedopt/gaussian_noise.h),
host tables in ``_tables.py``, the chunk rule and row layout shared with the CUDA
backend in ``backends/_chunks.py``.

Host side rules: tables come from metadata only (addresses, sizes), every branch here
is on metadata (never on a tensor value: no ``.item()``, no host sync), float
hyperparameters are runtime kernel arguments (a new lr never recompiles) and tensor
hyperparameters are loaded inside the kernels.  On CUDA the kernels run on the current
stream; on CPU tensors they run in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import triton.language as tl

from .. import _chunks, hyper
from ..dtypes import acc_dtype
from ..gram import client_gram  # noqa: F401 - torch's batched products on the device
from . import _interpreter_compat, _tables
from ._helpers import HYPER_FLOAT, HYPER_ROW, HYPER_SCALAR
from .add_noise import add_noise_kernel
from .aggregate import aggregate_kernel, client_dots_kernel, row_sum_kernel
from .nar_step import group_sum_kernel, nar_norm_kernel, nar_update_kernel
from .robust import MAX_CLIENTS, coordinate_select_kernel, tile_shape
from .server_update import server_update_kernel

_interpreter_compat.install()  # Triton 3.6's interpreter under NumPy >= 2.4 (see there)

__all__ = ["nar_step_", "nar_step_batched_", "nar_sq_norm", "nar_apply_", "aggregate", "client_dots",
           "server_update_", "add_noise_", "coordinate_select", "client_gram"]

TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
ESIZES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}
EPS = 1e-6  # clip epsilon (torch.nn.utils.clip_grad_norm_), as in the kernels
PBLOCK = 256  # width of the fixed-order partial-sum reductions
SMALL_NUM_WARPS = 4  # the finalize kernels that have no in-kernel twin (aggregate's row sums)


def launch_config(dtype: torch.dtype):
    """``(BLOCK, num_warps)`` of the streaming kernels for data of ``dtype``.

    8 elements per thread and loop step: one or two 16-byte vector accesses per thread
    and array.  16 per thread (BLOCK 2048 at 4 warps) made ptxas use 88-152 registers
    for the fp32 update kernel (occupancy 3 CTAs/SM), 8 per thread 36-50.
    """
    if dtype == torch.float64:
        return 1024, 4
    return 2048, 8


def norm_launch_config(dtype: torch.dtype):
    """``(BLOCK, num_warps)`` of ``nar_norm_kernel``: ``launch_config`` except for 16-bit
    data, which the norm pass reads at 16 elements per thread (BLOCK 2048 at 4 warps:
    two 16-byte loads per array and thread, the bytes in flight of the fp32 kernel).

    At 8 per thread (8 warps) Triton 3.6's PTX for the bf16 row kernel (mode co, float
    weight decay) made ptxas (12.8 and 13.0) spill one loop-carried value on sm_90a
    (40 registers, 36 bytes of spill stores); Triton 3.8's did not.  At 16 per thread
    both use 56-60 registers and spill nothing on sm_80 and sm_90
    (tests/test_triton_aot.py checks every variant under the installed Triton).  The
    partial sums are this kernel's own: the update kernel combines them at its own
    ``num_warps`` either way.
    """
    if ESIZES[dtype] == 2:
        return 2048, 4
    return launch_config(dtype)


def server_launch_config(dtype: torch.dtype, rule: int):
    """``(BLOCK, num_warps)`` of ``server_update_kernel``: ``launch_config`` except for
    the adaptive rules (2-4), which keep 4 arrays in flight plus a correctly rounded
    division and square root per element, in a kernel that holds both the 16-byte and
    the scalar body (vector width is chosen per chunk).

    ptxas registers (sm_90, no spills), measured with tests/_aot_compile.py:

    * 16-bit: 8 per thread at 8 warps (BLOCK 2048) used 124-127; the same 8 per thread
      at 4 warps (BLOCK 1024) 94-95 -- one 16-byte access of 2-byte elements needs 8.
    * fp32: 4 per thread at 8 warps (BLOCK 1024): one 16-byte access per array.
    * fp64: 4 per thread at 8 warps used 106-118, at 4 warps (BLOCK 512) 92-94 (two
      16-byte accesses per array); 8 per thread at 4 warps 128.
    """
    if rule >= 2:
        if dtype == torch.float64:
            return 512, 4
        if dtype == torch.float32:
            return 1024, 8
        return 1024, 4
    return launch_config(dtype)


def noise_launch_config(dtype: torch.dtype):
    """``(BLOCK, num_warps)`` of ``add_noise_kernel`` for an ``out`` of ``dtype``.

    The kernel is compute-bound (ten Philox rounds and ~35 fp32 operations per element),
    so 4 elements per thread (BLOCK 1024 at 8 warps) rather than the streaming kernels'
    8: the same threads in flight with half the registers per thread.
    """
    return 1024, 8


def _on(device: torch.device):
    """Make ``device`` current for the launches (Triton launches on the current device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# The kernels' HYPER_* constexprs are backends.hyper's kinds.
assert (HYPER_FLOAT.value, HYPER_SCALAR.value, HYPER_ROW.value) == (hyper.FLOAT, hyper.SCALAR, hyper.ROW)


def _hyper(value: float, tensor, per_row: bool):
    """``(kind, value, tensor or None)``: a hyperparameter's ``(value, tensor)`` pair
    (:mod:`~fedopt_kernels.backends.hyper`) plus the kernels' compile-time kind; a
    ``[C]`` tensor made contiguous for the per-row load."""
    t = tensor.contiguous() if tensor is not None and tensor.dim() != 0 else tensor
    return hyper.kind(tensor, per_row), float(value), t


def _empty_stats(G, acc, device, max_norm, mode, found_inf, norm=None):
    """Stats of groups without any element: their norm is 0 (python_ref: the norm of an
    empty vector), or the given ``[G]`` ``norm`` (``nar_apply_``'s sqrt of sq_norm)."""
    if norm is None:
        norm = torch.zeros(G, dtype=acc, device=device)
    if mode == 2:
        scale = torch.ones(G, dtype=acc, device=device)
    else:
        scale = torch.clamp(max_norm / (norm + EPS), max=1.0)
    skipped = ~torch.isfinite(norm)
    if found_inf is not None:
        skipped = skipped | (found_inf.reshape(()) != 0)
    return norm, scale, skipped


@dataclass(frozen=True)
class _NarWork:
    """Where the chunks of a FedNAR call are: a table (list forms) or the rows of
    contiguous ``[C, N]`` tensors (``rows``: no table, chunk from ``program_id``)."""
    n_chunks: int
    num_groups: int
    max_group_chunks: int
    tab: Optional[torch.Tensor] = None
    groups: Optional[torch.Tensor] = None
    rows: bool = False
    x_base: int = 0  # rows: base addresses of X, G, B (0: absent)
    g_base: int = 0
    b_base: int = 0
    row_len: int = 0
    row_chunks: int = 1
    chunk: int = 0
    mis: int = 0


def _list_work(params, grads, bufs) -> _NarWork:
    t = _tables.nar_table(params, grads, bufs)
    return _NarWork(t.n_chunks, 1, t.max_group_chunks, tab=t.chunks, groups=t.groups, chunk=t.chunk_size)


def _rows_work(X, G, B) -> _NarWork:
    C, N = X.shape
    chunk = _chunks.chunk_size_for(N)
    row_chunks = -(-N // chunk)
    bases = [X.data_ptr(), G.data_ptr(), B.data_ptr() if B is not None else 0]
    return _NarWork(C * row_chunks, C, row_chunks, rows=True, x_base=bases[0], g_base=bases[1], b_base=bases[2],
                    row_len=N, row_chunks=max(row_chunks, 1), chunk=chunk, mis=_chunks.rows_misalignment(bases))


def _norm_launch(w: _NarWork, part, dtype, wd_t, wd_f, wd_kind, gs, mode):
    block, warps = norm_launch_config(dtype)
    dummy = part  # stands for absent optional pointers (never read)
    nar_norm_kernel[(w.n_chunks,)](
        w.tab if w.tab is not None else dummy, w.groups if w.groups is not None else dummy, part,
        wd_t if wd_t is not None else dummy, gs if gs is not None else dummy, wd_f,
        w.x_base, w.g_base, w.row_len, w.row_chunks, w.chunk, w.mis,
        DTYPE=TL_DTYPES[dtype], ESIZE=_esize(dtype), ACC=TL_DTYPES[acc_dtype(dtype)], MODE=mode, WD_KIND=wd_kind,
        HAS_GS=gs is not None, ROWS=w.rows, BLOCK=block, num_warps=warps)


def _esize(dtype: torch.dtype) -> int:
    return ESIZES[dtype]


def _run_nar(w: _NarWork, dtype, device, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm, mode,
             momentum, grad_scale, found_inf, per_row, sq_in=None):
    """The two launches of a FedNAR step (``sq_in``: ``nar_apply_``'s given sum of
    squares replaces the norm launch and the combine)."""
    acc = acc_dtype(dtype)
    G = w.num_groups
    if w.n_chunks == 0:
        norm = None if sq_in is None else torch.sqrt(sq_in)
        return _empty_stats(G, acc, device, max_norm, mode, found_inf, norm=norm)
    block, warps = launch_config(dtype)
    norm = torch.empty(G, dtype=acc, device=device)
    scale = torch.empty(G, dtype=acc, device=device)
    skipped = torch.empty(G, dtype=torch.bool, device=device)
    lr_kind, lr_f, lr_t = _hyper(lr, lr_tensor, per_row)
    wd_kind, wd_f, wd_t = _hyper(weight_decay, weight_decay_tensor, per_row)
    if sq_in is None:
        part = torch.empty(w.n_chunks, dtype=acc, device=device)
        _norm_launch(w, part, dtype, wd_t, wd_f, wd_kind, grad_scale, mode)
        finalized = w.max_group_chunks > _chunks.max_redundant_partials()
        if finalized:
            sums = torch.empty(G, dtype=acc, device=device)
            # num_warps=warps, as the update kernel's in-kernel sum: tl.sum's tree follows
            # the warp layout, so this keeps both paths (and nar_sq_norm) bitwise one sum.
            group_sum_kernel[(G,)](w.groups if w.groups is not None else part, part, sums, w.row_chunks,
                                   ACC=TL_DTYPES[acc], PBLOCK=PBLOCK, ROWS=w.rows, num_warps=warps)
            part = sums
    else:
        part, finalized = sq_in, True
    dummy = part  # stands for absent optional pointers (never read)
    has_gs, has_fi, has_mom = grad_scale is not None, found_inf is not None, momentum != 0.0
    nar_update_kernel[(w.n_chunks,)](
        w.tab if w.tab is not None else dummy, w.groups if w.groups is not None else dummy,
        part, norm, scale, skipped,
        lr_t if lr_t is not None else dummy, wd_t if wd_t is not None else dummy,
        grad_scale if has_gs else dummy, found_inf if has_fi else dummy,
        lr_f, wd_f, float(max_norm), float(momentum), w.x_base, w.g_base, w.b_base if has_mom else 0,
        w.row_len, w.row_chunks, w.chunk, w.mis,
        DTYPE=TL_DTYPES[dtype], ESIZE=_esize(dtype), ACC=TL_DTYPES[acc], MODE=mode, LR_KIND=lr_kind,
        WD_KIND=wd_kind, HAS_MOM=has_mom, HAS_GS=has_gs, HAS_FI=has_fi, FINALIZED=finalized,
        ROWS=w.rows, BLOCK=block, PBLOCK=PBLOCK, num_warps=warps)
    return norm, scale, skipped


def nar_step_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm, mode,
              momentum, grad_scale, found_inf):
    """One FedNAR step over ``params`` taken as one vector; 0-d stats (contract)."""
    params, grads = list(params), list(grads)
    bufs = list(momentum_buffers) if momentum != 0.0 else []
    device = params[0].device
    with _on(device):
        norm, scale, skipped = _run_nar(
            _list_work(params, grads, bufs), params[0].dtype, device, lr, lr_tensor, weight_decay,
            weight_decay_tensor, max_norm, int(mode), float(momentum), grad_scale, found_inf, per_row=False)
    return norm.reshape(()), scale.reshape(()), skipped.reshape(())


def nar_sq_norm(params, grads, weight_decay, weight_decay_tensor, mode, grad_scale):
    """0-d sum of squares of the clipped-on vector of ``params`` (contract): the norm
    kernel, then ``group_sum_kernel`` over the one group, the same fixed-order sum the
    update kernel would compute."""
    params, grads = list(params), list(grads)
    dtype, device = params[0].dtype, params[0].device
    acc = acc_dtype(dtype)
    with _on(device):
        w = _list_work(params, grads, [])
        sums = torch.zeros(1, dtype=acc, device=device)
        if w.n_chunks == 0:
            return sums.reshape(())
        block, warps = launch_config(dtype)
        part = torch.empty(w.n_chunks, dtype=acc, device=device)
        wd_kind, wd_f, wd_t = _hyper(weight_decay, weight_decay_tensor, per_row=False)
        _norm_launch(w, part, dtype, wd_t, wd_f, wd_kind, grad_scale, int(mode))
        # the update kernel's num_warps: the same reduction tree as nar_step_'s own sum
        group_sum_kernel[(1,)](w.groups, part, sums, w.row_chunks, ACC=TL_DTYPES[acc], PBLOCK=PBLOCK, ROWS=False,
                               num_warps=warps)
    return sums.reshape(())


def nar_apply_(params, grads, momentum_buffers, sq_norm, lr, lr_tensor, weight_decay, weight_decay_tensor,
               max_norm, mode, momentum, grad_scale, found_inf):
    """The update kernel of :func:`nar_step_` with ``norm = sqrt(sq_norm)`` (the
    ``FINALIZED`` variant reading the one group's sum); 0-d stats (contract)."""
    params, grads = list(params), list(grads)
    bufs = list(momentum_buffers) if momentum != 0.0 else []
    dtype, device = params[0].dtype, params[0].device
    sq = sq_norm.reshape(1).to(acc_dtype(dtype))
    with _on(device):
        stats = _run_nar(_list_work(params, grads, bufs), dtype, device, lr, lr_tensor, weight_decay,
                         weight_decay_tensor, max_norm, int(mode), float(momentum), grad_scale, found_inf,
                         per_row=False, sq_in=sq)
    return tuple(t.reshape(()) for t in stats)


def nar_step_batched_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm,
                      mode, momentum, grad_scale, found_inf):
    """Row-wise FedNAR on contiguous ``[C, N]`` tensors (no table); ``[C]`` stats (contract)."""
    X, G = params, grads
    B = momentum_buffers if momentum != 0.0 else None
    with _on(X.device):
        return _run_nar(_rows_work(X, G, B), X.dtype, X.device, lr, lr_tensor, weight_decay, weight_decay_tensor,
                        max_norm, int(mode), float(momentum), grad_scale, found_inf, per_row=True)


def _clients_meta(clients):
    if isinstance(clients, torch.Tensor):
        C, N = clients.shape
        return C, N, clients.dtype, clients.device
    return len(clients), clients[0].numel(), clients[0].dtype, clients[0].device


def aggregate(clients, weights, gamma, gamma_tensor, out, skip, noise_key=None, noise_std=0.0,
              noise_std_tensor=None):
    """``out = gamma * sum_i weights[i] * clients[i]`` (``+ std * normal(noise_key, j)``
    with a ``noise_key``); returns ``(q [C], Q [])`` of the sum without noise (contract)."""
    with _on(out.device):
        return _aggregate(clients, weights, gamma, gamma_tensor, out, skip, noise_key, noise_std, noise_std_tensor)


def _clients_work(clients):
    """``(table or None, base address, two_d, mis)`` of the clients' locations."""
    if isinstance(clients, torch.Tensor):
        return None, clients.data_ptr(), True, _chunks.rows_misalignment([clients.data_ptr()])
    return _tables.client_table(clients).addrs, 0, False, 0


def aggregate_tiling(N: int, dtype: torch.dtype):
    """``(BLOCK, num_warps, programs)`` of the aggregation kernels: the tile from N and
    the dtype only (``_chunks.aggregate_tile``), 8 elements per thread."""
    widest, _ = launch_config(dtype)
    block = _chunks.aggregate_tile(N, widest)
    return block, max(1, block // 256), -(-N // block)


def _aggregate(clients, weights, gamma, gamma_tensor, out, skip, noise_key=None, noise_std=0.0,
               noise_std_tensor=None):
    C, N, dtype, device = _clients_meta(clients)
    acc = acc_dtype(dtype)
    block, warps, nblk = aggregate_tiling(N, dtype)
    q = torch.empty(C, dtype=acc, device=device)
    total = torch.empty((), dtype=acc, device=device)
    part = torch.empty((C + 1) * nblk, dtype=acc, device=device)
    g_kind, g_f, g_t = _hyper(gamma, gamma_tensor, per_row=False)
    noise = noise_key is not None
    # Without noise the std pair is not even passed (its pointer type would select
    # another compiled variant for nothing): the kernel is the one it always was.
    s_kind, s_f, s_t = (_hyper(noise_std, noise_std_tensor, per_row=False) if noise
                        else (HYPER_FLOAT.value, 0.0, None))
    has_skip = skip is not None
    weights = weights.contiguous()
    if nblk > 0:
        tab, x_base, two_d, mis = _clients_work(clients)
        # FP contraction stays as it was (no enable_fp_fusion=False here): the clients'
        # sum must keep its bits when noise is added; the noise epilogue rounds every
        # operation itself (_noise.py says why).
        aggregate_kernel[(nblk,)](
            tab if tab is not None else part, weights, out, part,
            skip if has_skip else part, g_t if g_t is not None else part, s_t if s_t is not None else part,
            g_f, s_f, int(noise_key) if noise else 0, x_base, C, N, nblk, mis,
            DTYPE=TL_DTYPES[dtype], ESIZE=_esize(dtype), ACC=TL_DTYPES[acc], TWO_D=two_d, HAS_SKIP=has_skip,
            GAMMA_KIND=g_kind, NOISE=noise, STD_KIND=s_kind, BLOCK=block, num_warps=warps)
    row_sum_kernel[(C + 1,)](part, q, total, skip if has_skip else part, nblk, C, ACC=TL_DTYPES[acc],
                             HAS_SKIP=has_skip, PBLOCK=PBLOCK, num_warps=SMALL_NUM_WARPS)
    return q, total


def client_dots(clients, g):
    """``[<clients[i], g>]`` in acc dtype, ``[C]`` (contract)."""
    with _on(g.device):
        return _client_dots(clients, g)


def _client_dots(clients, g):
    C, N, dtype, device = _clients_meta(clients)
    acc = acc_dtype(dtype)
    res = torch.empty(C, dtype=acc, device=device)
    if C == 0:
        return res
    block, warps, nblk = aggregate_tiling(N, dtype)
    part = torch.empty(C * nblk, dtype=acc, device=device)
    if nblk > 0:
        tab, x_base, two_d, mis = _clients_work(clients)
        client_dots_kernel[(nblk,)](
            tab if tab is not None else part, g, part, x_base, C, N, nblk, mis,
            DTYPE=TL_DTYPES[dtype], ESIZE=_esize(dtype), ACC=TL_DTYPES[acc], TWO_D=two_d, BLOCK=block,
            num_warps=warps)
    row_sum_kernel[(C,)](part, res, res, res, nblk, C, ACC=TL_DTYPES[acc], HAS_SKIP=False, PBLOCK=PBLOCK,
                         num_warps=SMALL_NUM_WARPS)
    return res


def server_update_(params, updates, exp_avg, exp_avg_sq, rule, lr, lr_tensor, gamma, gamma_tensor, beta1, beta2,
                   tau, nesterov, skip):
    """One server optimizer step (math.h ``ServerRule`` ``rule``) over ``params`` in place,
    one launch for all tensors (contract; validated by the ops layer).

    ``lr`` / ``gamma``: ``(value, tensor)`` pairs, the tensor None or 0-d acc on the
    device (read in the kernel);
    ``skip``: None or a 0-d bool tensor, read in the kernel (true: nothing written).
    """
    rule = int(rule)
    params, updates = list(params), list(updates)
    # Only the state the rule uses enters the table (and its cache key).
    exp_avg = list(exp_avg) if rule != 0 else []
    exp_avg_sq = list(exp_avg_sq) if rule >= 2 else []
    if sum(p.numel() for p in params) == 0:  # also T == 0: nothing to launch
        return
    dtype, device = params[0].dtype, params[0].device
    acc = acc_dtype(dtype)
    with _on(device):
        table = _tables.server_table(params, updates, exp_avg, exp_avg_sq)
        block, warps = server_launch_config(dtype, rule)
        lr_kind, lr_f, lr_t = _hyper(lr, lr_tensor, per_row=False)
        # Only sgd reads gamma: elsewhere a gamma tensor is not even passed (its pointer
        # type would select another compiled variant for nothing).
        g_kind, g_f, g_t = (_hyper(gamma, gamma_tensor, per_row=False) if rule == 0
                            else (HYPER_FLOAT.value, 0.0, None))
        if table.n_chunks == 0:
            return
        dummy = table.chunks  # stands for absent optional pointers (never read)
        has_skip = skip is not None
        server_update_kernel[(table.n_chunks,)](
            table.chunks, lr_t if lr_t is not None else dummy, g_t if g_t is not None else dummy,
            skip if has_skip else dummy, lr_f, g_f, float(beta1), float(beta2), float(tau),
            DTYPE=TL_DTYPES[dtype], ACC=TL_DTYPES[acc], RULE=rule, NESTEROV=bool(nesterov) and rule == 1,
            LR_KIND=lr_kind, GAMMA_KIND=g_kind, HAS_SKIP=has_skip, BLOCK=block, num_warps=warps,
            # The contract rounds every operation separately (math.h, as the CPU
            # kernels do): no FMA contraction by LLVM or ptxas (--fmad=false).
            enable_fp_fusion=False)


def add_noise_(out, noise_key, noise_std, noise_std_tensor, skip=None):
    """``out[j] += std * normal(noise_key, j)`` in ``out``'s acc dtype, in place; ``out``
    1-D contiguous, any length; ``std`` = ``noise_std_tensor`` (one element, read in
    the kernel) if given, else ``noise_std``; ``skip`` None or a one-element tensor read
    in the kernel (true: nothing written) (contract)."""
    N = out.numel()
    if N == 0:
        return
    acc = acc_dtype(out.dtype)
    s_kind, s_f, s_t = _hyper(noise_std, noise_std_tensor, per_row=False)
    block, warps = noise_launch_config(out.dtype)
    with _on(out.device):
        add_noise_kernel[(-(-N // block),)](
            out, s_t if s_t is not None else out, skip if skip is not None else out, s_f, int(noise_key), N,
            ACC=TL_DTYPES[acc], STD_KIND=s_kind, HAS_SKIP=skip is not None, BLOCK=block, num_warps=warps,
            # the noise rounds every operation itself (_noise.py); nothing else here to contract
            enable_fp_fusion=False)


def coordinate_select(clients, keep, count, mode, out, skip):
    X = clients if isinstance(clients, torch.Tensor) else torch.stack(list(clients))
    C, N = X.shape
    if C > MAX_CLIENTS:
        raise ValueError(f"the triton backend's coordinate_select takes at most {MAX_CLIENTS} clients, got {C}")
    cp, block = tile_shape(C)
    nblk = max(1, -(-N // block))
    bad = torch.zeros(C, nblk, dtype=torch.int8, device=X.device)
    if N == 0:
        return bad.any(dim=1)
    with _on(X.device):
        coordinate_select_kernel[(nblk,)](
            X, keep, count.reshape(1), out, bad, skip if skip is not None else keep, C, N, nblk,
            ACC=TL_DTYPES[acc_dtype(X.dtype)], CP=cp, BLOCK=block, MODE=int(mode), HAS_SKIP=skip is not None,
            num_warps=4)
    return bad.any(dim=1)
