"""The ``reference`` backend: python_ref behind the backend contract (see __init__;
python_ref as this installation has it: :mod:`.oracle`).

python_ref, the oracle, keeps the plain API -- a hyperparameter is a number or a
tensor -- so this is the one backend that joins the contract's ``(value, tensor)``
pairs back (:func:`~fedopt_kernels.backends.hyper.join`)."""

from __future__ import annotations

import torch

from .dtypes import acc_dtype
from .gram import gram_float64
from .hyper import join
from .oracle import aggregation as _agg, fednar as _nar, gaussian_noise as _noise, server_optimizers as _srv

_MODE_NAMES = _nar.MODES  # index = the integer mode of the contract
MODE_TRIM = 0  # coordinate_select's modes
MODE_CLOSEST = 1


def nar_step_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm, mode,
              momentum, grad_scale, found_inf):
    return tuple(_nar.nar_step_(
        params, grads, lr=join(lr, lr_tensor), weight_decay=join(weight_decay, weight_decay_tensor),
        max_norm=max_norm, mode=_MODE_NAMES[mode], momentum=momentum, momentum_buffers=momentum_buffers or None,
        grad_scale=grad_scale, found_inf=found_inf))


def nar_sq_norm(params, grads, weight_decay, weight_decay_tensor, mode, grad_scale):
    return _nar.nar_sq_norm(params, grads, weight_decay=join(weight_decay, weight_decay_tensor),
                            mode=_MODE_NAMES[mode], grad_scale=grad_scale)


def nar_apply_(params, grads, momentum_buffers, sq_norm, lr, lr_tensor, weight_decay, weight_decay_tensor,
               max_norm, mode, momentum, grad_scale, found_inf):
    return tuple(_nar.nar_apply_(
        params, grads, sq_norm, lr=join(lr, lr_tensor), weight_decay=join(weight_decay, weight_decay_tensor),
        max_norm=max_norm, mode=_MODE_NAMES[mode], momentum=momentum, momentum_buffers=momentum_buffers or None,
        grad_scale=grad_scale, found_inf=found_inf))


def nar_step_batched_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm,
                      mode, momentum, grad_scale, found_inf):
    X, G, B = params, grads, momentum_buffers
    return tuple(_nar.nar_step_batched_(
        X, G, lr=join(lr, lr_tensor), weight_decay=join(weight_decay, weight_decay_tensor), max_norm=max_norm,
        mode=_MODE_NAMES[mode], momentum=momentum, momentum_buffers=B, grad_scale=grad_scale, found_inf=found_inf))


def _noised(value, noise_key, noise_std, noise_std_tensor):
    """``value + std * n`` in ``value``'s (acc) dtype, each op rounded once: the noise
    step of ``aggregate`` and ``add_noise_`` (python_ref/gaussian_noise.py)."""
    acc = value.dtype
    n = _noise.noise(noise_key, value.numel()).to(device=value.device, dtype=acc)
    std = join(noise_std, noise_std_tensor)
    std = std.reshape(()).to(acc) if isinstance(std, torch.Tensor) else torch.tensor(std, dtype=acc)
    return value + std.to(value.device) * n


def aggregate(clients, weights, gamma, gamma_tensor, out, skip, noise_key=None, noise_std=0.0,
              noise_std_tensor=None):
    result, q, Q = _agg.aggregate(clients, weights, join(gamma, gamma_tensor))
    if noise_key is not None:
        result = _noised(result, noise_key, noise_std, noise_std_tensor)
    if skip is not None:
        skip = skip.reshape(()) != 0
        out.copy_(torch.where(skip, out, result.to(out.dtype)))
        return torch.where(skip, torch.zeros_like(q), q), torch.where(skip, torch.zeros_like(Q), Q)
    out.copy_(result)
    return q, Q


def add_noise_(out, noise_key, noise_std, noise_std_tensor, skip=None):
    noised = _noised(out.to(_nar.compute_dtype(out.dtype)), noise_key, noise_std, noise_std_tensor).to(out.dtype)
    out.copy_(noised if skip is None else torch.where(skip.reshape(()) != 0, out, noised))


def client_dots(clients, g):
    return _agg.client_dots(clients, g)


def _server_rule(rule, x, d, m, v, lr, gamma, beta1, beta2, tau, nesterov):
    """New ``(x, m, v)`` of one tensor (flat, acc dtype) by python_ref's formulas."""
    if rule == 0:
        return _srv.fedavg(x, d, lr=lr, gamma=gamma), m, v
    if rule == 1:
        x, m = _srv.fedavgm(x, d, m, lr=lr, momentum=beta1, nesterov=nesterov)
        return x, m, v
    if rule == 2:
        return _srv.fedadagrad(x, d, m, v, lr=lr, momentum=beta1, tau=tau)
    step = _srv.fedadam if rule == 3 else _srv.fedyogi
    return step(x, d, m, v, lr=lr, betas=(beta1, beta2), tau=tau)


def server_update_(params, updates, exp_avg, exp_avg_sq, rule, lr, lr_tensor, gamma, gamma_tensor, beta1, beta2,
                   tau, nesterov, skip):
    lr, gamma = join(lr, lr_tensor), join(gamma, gamma_tensor)
    for i, (p, d) in enumerate(zip(params, updates)):
        d = d.reshape(-1)
        acc = d.dtype
        m = exp_avg[i].reshape(-1).to(acc) if exp_avg else None
        v = exp_avg_sq[i].reshape(-1).to(acc) if exp_avg_sq else None
        new = _server_rule(rule, p.reshape(-1).to(acc), d, m, v, lr, gamma, beta1, beta2, tau, nesterov)
        targets = [p] + ([exp_avg[i]] if exp_avg else []) + ([exp_avg_sq[i]] if exp_avg_sq else [])
        for dst, val in zip(targets, new):
            val = val.view(dst.shape).to(dst.dtype)
            if skip is None:
                dst.copy_(val)
            else:
                torch.where(skip, dst, val, out=dst)


def coordinate_select(clients, keep, count, mode, out, skip):
    """torch, in the acc dtype: ``sort`` along the clients (NaN after every number, as in
    python_ref/robust.py; left-out clients as NaN, so they sort last and rows ``[0, m)``
    are exactly the kept values in that order, a kept NaN last among them -- as ``+inf``
    they sorted before a kept NaN), then the same reductions as the kernels."""
    X = clients if isinstance(clients, torch.Tensor) else torch.stack(list(clients))
    C, N = X.shape
    acc = acc_dtype(X.dtype)
    flags = torch.zeros(C, dtype=torch.bool, device=X.device)
    if skip is not None and bool(skip.reshape(())):
        return flags
    x = X.to(acc)
    flags = keep & ~torch.isfinite(x).all(dim=1) if N else flags
    v = torch.where(keep[:, None], x, torch.full((), float("nan"), dtype=acc, device=X.device))
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


def client_gram(clients, float64_products):
    """Float64 products of float64 blocks whatever ``float64_products`` asks
    (:func:`~fedopt_kernels.backends.gram.gram_float64`)."""
    return gram_float64(clients)


def ragged_bmm(a, b, lengths, dim, zero_fill, use_blas=True):
    """A loop of ``@`` over the clients' real parts (``use_blas`` has no meaning here)."""
    out = torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    for i, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        if dim == 1:
            out[i, :n] = a[i, :n] @ b[i]
            if not zero_fill:
                out[i, n:] = out[i, :1]
        elif dim == 2:
            out[i] = a[i, :, :n] @ b[i, :n]
        else:
            out[i, :, :n] = a[i] @ b[i, :, :n]
            if not zero_fill:
                out[i, :, n:] = out[i, :, :1]
    return out


def ragged_bmm_out(a, b, lengths, dim, zero_fill, use_blas=True, *, out):
    return out.copy_(ragged_bmm(a, b, lengths, dim, zero_fill, use_blas))
