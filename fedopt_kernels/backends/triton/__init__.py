"""The ``triton`` backend: fused Triton kernels behind the backend contract
(fedopt_kernels/backends/__init__.py; semantics in csrc/registration.cpp).

Kernels: ``nar_step.py`` (FedNAR: one norm launch + one update launch for all tensors
of a call, over a chunk table of the original tensors), ``aggregate.py`` (aggregation
and ``client_dots``: one pass over the clients + a tiny fixed-order finalize),
``server_update.py`` (the server optimizers' elementwise step: one launch over a chunk
table, no reduction), math in ``_helpers.py`` (mirrors csrc/include/fedopt/math.h),
host tables in ``_tables.py``.

Host side rules: tables come from metadata only (addresses, sizes), every branch here
is on metadata (never on a tensor value: no ``.item()``, no host sync), float
hyperparameters are runtime kernel arguments (a new lr never recompiles) and tensor
hyperparameters are loaded inside the kernels.  On CUDA the kernels run on the current
stream; on CPU tensors they run in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib

import torch
import triton.language as tl

from . import _tables
from ._helpers import HYPER_FLOAT, HYPER_ROW, HYPER_SCALAR
from .aggregate import aggregate_kernel, client_dots_kernel, row_sum_kernel
from .nar_step import group_sum_kernel, nar_norm_kernel, nar_update_kernel
from .server_update import server_update_kernel

__all__ = ["nar_step_", "nar_step_batched_", "nar_sq_norm", "nar_apply_", "aggregate", "client_dots",
           "server_update_"]

TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
EPS = 1e-6  # clip epsilon (torch.nn.utils.clip_grad_norm_), as in the kernels
PBLOCK = 256  # width of the fixed-order partial-sum reductions
SMALL_NUM_WARPS = 4  # the finalize kernels that have no in-kernel twin (aggregate's row sums)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def launch_config(dtype: torch.dtype):
    """``(BLOCK, num_warps)`` of the streaming kernels for data of ``dtype``.

    8 elements per thread and loop step: one or two 16-byte vector accesses per thread
    and array.  16 per thread (BLOCK 2048 at 4 warps) made ptxas use 88-152 registers
    for the fp32 update kernel (occupancy 3 CTAs/SM), 8 per thread 36-50.
    """
    if dtype == torch.float64:
        return 1024, 4
    return 2048, 8


def server_launch_config(dtype: torch.dtype, rule: int):
    """``(BLOCK, num_warps)`` of ``server_update_kernel``: ``launch_config`` except for
    the adaptive rules (2-4) on fp32 / fp64 data, which take 4 elements per thread at 8
    warps (still one 16-byte access per thread and array for fp32, two for fp64).

    Those rules keep 4 arrays in flight plus a correctly rounded division and square
    root per element.  At 8 elements per thread ptxas used 96-98 registers (fp32,
    unaligned variant) and 110-128 (fp64); at 4 per thread 48-64 (fp32) and 76-92
    (fp64), no spills (fp64 at 4 warps x 4 elements spilled 8 bytes on sm_80).  16-bit
    data keeps 8 per thread: one 16-byte access of 2-byte elements needs them, and it
    stays at 64-93 registers.
    """
    if rule >= 2 and dtype in (torch.float32, torch.float64):
        return 1024, 8
    return launch_config(dtype)


def _on(device: torch.device):
    """Make ``device`` current for the launches (Triton launches on the current device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _hyper(value, per_row: bool):
    """(kind, float value, tensor or None) of a float / 0-d / [C] hyperparameter."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return HYPER_SCALAR.value, 0.0, value
        return (HYPER_ROW.value if per_row else HYPER_SCALAR.value), 0.0, value.contiguous()
    return HYPER_FLOAT.value, float(value), None


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


def _run_nar(table, dtype, device, lr, weight_decay, max_norm, mode, momentum, grad_scale,
             found_inf, per_row):
    acc = acc_dtype(dtype)
    G = table.num_groups
    if table.n_chunks == 0:
        return _empty_stats(G, acc, device, max_norm, mode, found_inf)
    block, warps = launch_config(dtype)
    part = torch.empty(table.n_chunks, dtype=acc, device=device)
    norm = torch.empty(G, dtype=acc, device=device)
    scale = torch.empty(G, dtype=acc, device=device)
    skipped = torch.empty(G, dtype=torch.bool, device=device)
    lr_kind, lr_f, lr_t = _hyper(lr, per_row)
    wd_kind, wd_f, wd_t = _hyper(weight_decay, per_row)
    dummy = part  # stands for absent optional pointers (never read)
    has_gs, has_fi, has_mom = grad_scale is not None, found_inf is not None, momentum != 0.0
    tl_dtype, tl_acc = TL_DTYPES[dtype], TL_DTYPES[acc]
    grid = (table.n_chunks,)
    nar_norm_kernel[grid](
        table.chunks, part, wd_t if wd_t is not None else dummy,
        grad_scale if has_gs else dummy, wd_f,
        DTYPE=tl_dtype, ACC=tl_acc, MODE=mode, WD_KIND=wd_kind, HAS_GS=has_gs,
        ALIGNED=table.aligned, BLOCK=block, num_warps=warps)
    finalized = table.max_group_chunks > _tables.MAX_REDUNDANT_PARTIALS
    if finalized:
        sums = torch.empty(G, dtype=acc, device=device)
        # num_warps=warps, as the update kernel's in-kernel sum: tl.sum's tree follows
        # the warp layout, so this keeps both paths (and nar_sq_norm) bitwise one sum.
        group_sum_kernel[(G,)](table.groups, part, sums, ACC=tl_acc, PBLOCK=PBLOCK, num_warps=warps)
        part = sums
    nar_update_kernel[grid](
        table.chunks, part, norm, scale, skipped,
        lr_t if lr_t is not None else dummy, wd_t if wd_t is not None else dummy,
        grad_scale if has_gs else dummy, found_inf if has_fi else dummy,
        lr_f, wd_f, float(max_norm), float(momentum),
        DTYPE=tl_dtype, ACC=tl_acc, MODE=mode, LR_KIND=lr_kind, WD_KIND=wd_kind,
        HAS_MOM=has_mom, HAS_GS=has_gs, HAS_FI=has_fi, FINALIZED=finalized,
        ALIGNED=table.aligned, BLOCK=block, PBLOCK=PBLOCK, num_warps=warps)
    return norm, scale, skipped


def nar_step_(params, grads, momentum_buffers, lr, weight_decay, max_norm, mode, momentum,
              grad_scale, found_inf):
    """One FedNAR step over ``params`` taken as one vector; 0-d stats (contract)."""
    params, grads = list(params), list(grads)
    bufs = list(momentum_buffers) if momentum != 0.0 else []
    device = params[0].device
    with _on(device):
        table = _tables.nar_table(params, grads, bufs)
        norm, scale, skipped = _run_nar(
            table, params[0].dtype, device, lr, weight_decay, max_norm, int(mode),
            float(momentum), grad_scale, found_inf, per_row=False)
    return norm.reshape(()), scale.reshape(()), skipped.reshape(())


def nar_sq_norm(params, grads, weight_decay, mode, grad_scale):
    """0-d sum of squares of the clipped-on vector of ``params`` (contract): the norm
    kernel, then ``group_sum_kernel`` over the one group, the same fixed-order sum the
    update kernel would compute."""
    params, grads = list(params), list(grads)
    dtype, device = params[0].dtype, params[0].device
    acc = acc_dtype(dtype)
    with _on(device):
        table = _tables.nar_table(params, grads, [])
        sums = torch.zeros(1, dtype=acc, device=device)
        if table.n_chunks == 0:
            return sums.reshape(())
        block, warps = launch_config(dtype)
        part = torch.empty(table.n_chunks, dtype=acc, device=device)
        wd_kind, wd_f, wd_t = _hyper(weight_decay, per_row=False)
        tl_acc = TL_DTYPES[acc]
        nar_norm_kernel[(table.n_chunks,)](
            table.chunks, part, wd_t if wd_t is not None else part,
            grad_scale if grad_scale is not None else part, wd_f,
            DTYPE=TL_DTYPES[dtype], ACC=tl_acc, MODE=int(mode), WD_KIND=wd_kind,
            HAS_GS=grad_scale is not None, ALIGNED=table.aligned, BLOCK=block, num_warps=warps)
        # the update kernel's num_warps: the same reduction tree as nar_step_'s own sum
        group_sum_kernel[(1,)](table.groups, part, sums, ACC=tl_acc, PBLOCK=PBLOCK, num_warps=warps)
    return sums.reshape(())


def nar_apply_(params, grads, momentum_buffers, sq_norm, lr, weight_decay, max_norm, mode, momentum,
               grad_scale, found_inf):
    """The update kernel of :func:`nar_step_` with ``norm = sqrt(sq_norm)`` (the
    ``FINALIZED`` variant reading the one group's sum); 0-d stats (contract)."""
    params, grads = list(params), list(grads)
    bufs = list(momentum_buffers) if momentum != 0.0 else []
    dtype, device = params[0].dtype, params[0].device
    acc = acc_dtype(dtype)
    sq = sq_norm.reshape(1).to(acc)
    with _on(device):
        table = _tables.nar_table(params, grads, bufs)
        if table.n_chunks == 0:
            stats = _empty_stats(1, acc, device, max_norm, int(mode), found_inf, norm=torch.sqrt(sq))
            return tuple(t.reshape(()) for t in stats)
        block, warps = launch_config(dtype)
        norm = torch.empty(1, dtype=acc, device=device)
        scale = torch.empty(1, dtype=acc, device=device)
        skipped = torch.empty(1, dtype=torch.bool, device=device)
        lr_kind, lr_f, lr_t = _hyper(lr, per_row=False)
        wd_kind, wd_f, wd_t = _hyper(weight_decay, per_row=False)
        has_gs, has_fi = grad_scale is not None, found_inf is not None
        nar_update_kernel[(table.n_chunks,)](
            table.chunks, sq, norm, scale, skipped,
            lr_t if lr_t is not None else sq, wd_t if wd_t is not None else sq,
            grad_scale if has_gs else sq, found_inf if has_fi else sq,
            lr_f, wd_f, float(max_norm), float(momentum),
            DTYPE=TL_DTYPES[dtype], ACC=TL_DTYPES[acc], MODE=int(mode), LR_KIND=lr_kind, WD_KIND=wd_kind,
            HAS_MOM=momentum != 0.0, HAS_GS=has_gs, HAS_FI=has_fi, FINALIZED=True,
            ALIGNED=table.aligned, BLOCK=block, PBLOCK=PBLOCK, num_warps=warps)
    return norm.reshape(()), scale.reshape(()), skipped.reshape(())


def nar_step_batched_(X, G, B, lr, weight_decay, max_norm, mode, momentum, grad_scale, found_inf):
    """Row-wise FedNAR on contiguous ``[C, N]`` tensors; ``[C]`` stats (contract)."""
    B = B if momentum != 0.0 else None
    with _on(X.device):
        table = _tables.nar_batched_table(X, G, B)
        return _run_nar(table, X.dtype, X.device, lr, weight_decay, max_norm, int(mode),
                        float(momentum), grad_scale, found_inf, per_row=True)


def _clients_meta(clients):
    if isinstance(clients, torch.Tensor):
        C, N = clients.shape
        return C, N, clients.dtype, clients.device
    return len(clients), clients[0].numel(), clients[0].dtype, clients[0].device


def aggregate(clients, weights, gamma, out, enabled):
    """``out = gamma * sum_i weights[i] * clients[i]``; returns ``(q [C], Q [])`` (contract)."""
    with _on(out.device):
        return _aggregate(clients, weights, gamma, out, enabled)


def _aggregate(clients, weights, gamma, out, enabled):
    C, N, dtype, device = _clients_meta(clients)
    acc = acc_dtype(dtype)
    block, warps = launch_config(dtype)
    nblk = -(-N // block)
    table = _tables.client_table(clients)
    part = torch.empty((C + 1) * nblk, dtype=acc, device=device)
    res = torch.empty(C + 1, dtype=acc, device=device)
    g_kind, g_f, g_t = _hyper(gamma, per_row=False)
    has_en = enabled is not None
    weights = weights.contiguous()
    if nblk > 0:
        aggregate_kernel[(nblk,)](
            table.addrs, weights, out, part, enabled if has_en else res,
            g_t if g_t is not None else res, g_f, C, N, nblk,
            DTYPE=TL_DTYPES[dtype], ACC=TL_DTYPES[acc], HAS_EN=has_en, GAMMA_KIND=g_kind,
            ALIGNED=table.aligned, BLOCK=block, num_warps=warps)
    row_sum_kernel[(C + 1,)](part, res, enabled if has_en else res, nblk, ACC=TL_DTYPES[acc],
                             HAS_EN=has_en, PBLOCK=PBLOCK, num_warps=SMALL_NUM_WARPS)
    return res[:C], res[C]


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
    block, warps = launch_config(dtype)
    nblk = -(-N // block)
    table = _tables.client_table(clients)
    part = torch.empty(C * nblk, dtype=acc, device=device)
    if nblk > 0:
        client_dots_kernel[(nblk,)](
            table.addrs, g, part, C, N, nblk, DTYPE=TL_DTYPES[dtype], ACC=TL_DTYPES[acc],
            ALIGNED=table.aligned, BLOCK=block,
            num_warps=warps)
    row_sum_kernel[(C,)](part, res, res, nblk, ACC=TL_DTYPES[acc], HAS_EN=False, PBLOCK=PBLOCK,
                         num_warps=SMALL_NUM_WARPS)
    return res


def server_update_(params, updates, exp_avg, exp_avg_sq, rule, lr, gamma, beta1, beta2, tau,
                   nesterov, skip):
    """One server optimizer step (math.h ``ServerRule`` ``rule``) over ``params`` in place,
    one launch for all tensors (contract; validated by the ops layer).

    ``lr`` / ``gamma``: floats or 0-d acc tensors on the device (read in the kernel);
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
        lr_kind, lr_f, lr_t = _hyper(lr, per_row=False)
        # Only sgd reads gamma: elsewhere a gamma tensor is not even passed (its pointer
        # type would select another compiled variant for nothing).
        g_kind, g_f, g_t = _hyper(gamma, per_row=False) if rule == 0 else (HYPER_FLOAT.value, 0.0, None)
        dummy = table.chunks  # stands for absent optional pointers (never read)
        has_skip = skip is not None
        server_update_kernel[(table.n_chunks,)](
            table.chunks, lr_t if lr_t is not None else dummy, g_t if g_t is not None else dummy,
            skip if has_skip else dummy, lr_f, g_f, float(beta1), float(beta2), float(tau),
            DTYPE=TL_DTYPES[dtype], ACC=TL_DTYPES[acc], RULE=rule, NESTEROV=bool(nesterov) and rule == 1,
            LR_KIND=lr_kind, GAMMA_KIND=g_kind, HAS_SKIP=has_skip,
            ALIGNED=table.aligned, BLOCK=block, num_warps=warps,
            # The contract rounds every operation separately (math.h, as the CPU
            # kernels do): no FMA contraction by LLVM or ptxas (--fmad=false).
            enable_fp_fusion=False)
