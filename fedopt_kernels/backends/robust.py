"""The robust aggregators' one backend op, ``coordinate_select``, on every backend.

``coordinate_select(clients, keep, count, mode, out, skip) -> nonfinite``
    Coordinate-wise order statistics of the kept clients in one pass over them (schema
    and semantics: csrc/registration.cpp; oracle: python_ref/robust.py).  ``clients`` a
    ``[C, N]`` tensor or a list of ``C`` 1-D tensors (the CPU backend also takes
    :class:`~fedopt_kernels.ops.ClientPieces`, read in place); ``keep`` ``[C]`` bool and ``count``
    a one-element int64 tensor, both on the data's device; ``mode`` 0 (mean of the sorted
    values ``[k, m - k)``, ``k = min(count, (m - 1) // 2)``) or 1 (mean of the ``count``
    values closest to the median); ``out`` ``[N]`` in the clients' or the acc dtype;
    ``skip`` None or a one-element bool tensor (true: nothing written, no flags).
    Returns ``[C]`` bool: the kept clients holding a NaN/Inf.

Everything else the robust aggregators need (the Gram matrix, Krum's selection, the
Weiszfeld and clipping iterations on ``[C]`` coefficients, the weighted mean) is one
implementation shared by every backend (:mod:`fedopt_kernels.ops.robust_aggregate`),
over each backend's ``aggregate`` and ``client_dots``.

The backends' own modules (``backends/cpu.py`` ...) are left as they are: this table is
looked up after :func:`fedopt_kernels.backends.resolve` has checked (and loaded) the
backend, so the C++ ops are registered when they are called.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..ops.client_pieces import ClientPieces
from .dtypes import acc_dtype

MODE_TRIM = 0
MODE_CLOSEST = 1


def _reference(clients, keep, count, mode, out, skip):
    """torch, in the acc dtype: ``sort`` along the clients (left-out clients as ``+inf``,
    sorted last), then the same reductions as the kernels."""
    X = clients if isinstance(clients, torch.Tensor) else torch.stack(list(clients))
    C, N = X.shape
    acc = acc_dtype(X.dtype)
    flags = torch.zeros(C, dtype=torch.bool, device=X.device)
    if skip is not None and bool(skip.reshape(())):
        return flags
    x = X.to(acc)
    flags = keep & ~torch.isfinite(x).all(dim=1) if N else flags
    v = torch.where(keep[:, None], x, torch.full((), float("inf"), dtype=acc, device=X.device))
    v = torch.sort(v, dim=0).values
    m = int(keep.sum())
    c = int(count.reshape(()))
    if m == 0:
        out.zero_()
        return flags
    if mode == MODE_TRIM:
        k = min(c, (m - 1) // 2)
        res = v[k:m - k].sum(dim=0) / (m - 2 * k)
    else:
        beta = max(1, min(c, m))
        med = v[(m - 1) // 2] if m % 2 else (v[m // 2 - 1] + v[m // 2]) / 2
        lo = torch.zeros(N, dtype=torch.long, device=X.device)
        hi = torch.full((N,), m - 1, dtype=torch.long, device=X.device)
        for _ in range(m - beta):
            vlo = v.gather(0, lo[None]).squeeze(0)
            vhi = v.gather(0, hi[None]).squeeze(0)
            drop_lo = (vlo - med).abs() > (vhi - med).abs()
            lo, hi = torch.where(drop_lo, lo + 1, lo), torch.where(drop_lo, hi, hi - 1)
        rank = torch.arange(C, device=X.device)[:, None]
        sel = (rank >= lo[None]) & (rank <= hi[None])
        res = torch.where(sel, v, torch.zeros((), dtype=acc, device=X.device)).sum(dim=0) / beta
    out.copy_(res)
    return flags


def _cpp(clients, keep, count, mode, out, skip):
    if isinstance(clients, ClientPieces):  # CPU: read in place (coordinate_select_pieces)
        return torch.ops.fedopt_C.coordinate_select_pieces(clients.flat(), clients.num_pieces, clients.subtract_from,
                                                            keep, count, int(mode), out, skip)
    if isinstance(clients, torch.Tensor):
        clients = [clients]
    return torch.ops.fedopt_C.coordinate_select(list(clients), keep, count, int(mode), out, skip)


def _triton(clients, keep, count, mode, out, skip):
    from .triton import TL_DTYPES, _on
    from .triton.robust import MAX_CLIENTS, coordinate_select_kernel, tile_shape

    X = clients if isinstance(clients, torch.Tensor) else torch.stack(list(clients))
    C, N = X.shape
    if C > MAX_CLIENTS:
        raise ValueError(f"the triton backend's coordinate_select takes at most {MAX_CLIENTS} clients, got {C}")
    cp, block = tile_shape(C)
    nblk = max(1, triton_cdiv(N, block))
    bad = torch.zeros(C, nblk, dtype=torch.int8, device=X.device)
    if N == 0:
        return bad.any(dim=1)
    with _on(X.device):
        coordinate_select_kernel[(nblk,)](
            X, keep, count.reshape(1), out, bad, skip if skip is not None else keep, C, N, nblk,
            ACC=TL_DTYPES[acc_dtype(X.dtype)], CP=cp, BLOCK=block, MODE=int(mode), HAS_SKIP=skip is not None,
            num_warps=4)
    return bad.any(dim=1)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


_IMPLS = {"reference": _reference, "cpu": _cpp, "cuda": _cpp, "triton": _triton}


def coordinate_select(name: str) -> Callable:
    """Backend ``name``'s ``coordinate_select`` (the name already resolved and checked)."""
    return _IMPLS[name]
