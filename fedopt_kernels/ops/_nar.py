"""The FedNAR step of tensors of ONE dtype and device: the fused kernel both public
entries end in.  :func:`~fedopt_kernels.ops.nar_step_` runs it directly, and hands a
call over several dtypes, devices or shards to
:func:`~fedopt_kernels.ops.nar_step_groups_`, which runs it for a call of one part.
Both import it; neither imports the other back."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends.hyper import split
from . import _dispatch, validation as V

MODES = ("co", "grad", "none")


class NarStats(NamedTuple):
    """Statistics of a FedNAR step, as tensors on the params' device (no host sync).

    ``norm`` is the norm that was clipped on (``||g + wd x||`` in mode co, ``||g||``
    otherwise), ``scale`` the clip factor ``s = min(1, max_norm / (norm + 1e-6))`` (1 in
    mode none), ``skipped`` whether the step was not applied (non-finite norm, or
    ``found_inf`` set by a GradScaler).
    """

    norm: torch.Tensor
    scale: torch.Tensor
    skipped: torch.Tensor


NarStats.__module__ = "fedopt_kernels.ops.nar_step"  # where it was defined before: pickles keep loading


def check_mode(mode) -> int:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return MODES.index(mode)


def check_clip(max_norm, mode, backend):
    """``(max_norm, mode_id)``: the arguments one FedNAR call shares, checked once at the
    public op's entry and passed down as the kernels take them (``mode`` as its index in
    :data:`MODES`, the encoding every backend shares)."""
    mode_id = check_mode(mode)
    max_norm = V.check_real(max_norm, "max_norm", low=0.0, low_open=True, allow_inf=True)
    V.check_backend(backend)
    return max_norm, mode_id


def check_part(lr, weight_decay, momentum, device, dtype, lr_sizes):
    """``(lr, weight_decay, momentum)`` of one part (one dtype and device), checked."""
    acc = V.acc_dtype(dtype)
    lr = V.check_hyper(lr, "lr", device, acc, sizes=lr_sizes)
    weight_decay = V.check_hyper(weight_decay, "weight_decay", device, acc, sizes=lr_sizes)
    momentum = V.check_real(momentum, "momentum", low=0.0, high=1.0, high_open=True)
    return lr, weight_decay, momentum


def check_common(lr, weight_decay, max_norm, mode, momentum, backend, device, dtype, lr_sizes):
    max_norm, mode_id = check_clip(max_norm, mode, backend)
    lr, weight_decay, momentum = check_part(lr, weight_decay, momentum, device, dtype, lr_sizes)
    return lr, weight_decay, max_norm, mode_id, momentum


def checked_lists(params, grads, momentum: float, momentum_buffers):
    """``(params, grads, fast, mixed)``: the lists checked, ``fast`` when the common case
    (one dtype and device, contiguous, matching; buffers included) passed the one tight
    pass, ``mixed`` when the tensors span several dtypes or devices (then they are not
    one part: ``nar_step_groups_`` takes them).  Anything unusual takes the detailed
    checks, which raise the message naming the argument."""
    V.check_untracked(params, "params", written=True)
    V.check_untracked(momentum_buffers or [], "momentum_buffers", written=True)
    V.check_untracked(grads, "grads", written=False)
    if V.lists_match_fast(params, grads, momentum_buffers if momentum != 0.0 else None):
        return list(params), list(grads), True, False
    params = V.check_tensor_list(params, "params")
    grads = V.check_tensor_list(grads, "grads")
    if not params:
        raise ValueError("params must contain at least one tensor")
    if len(grads) != len(params):
        raise ValueError(f"grads has {len(grads)} tensors but params has {len(params)}")
    for i, p in enumerate(params):
        V.check_like(grads[i], p, f"grads[{i}]", f"params[{i}]")
    mixed = any(p.dtype != params[0].dtype or p.device != params[0].device for p in params)
    return params, grads, False, mixed


def _check_buffers(momentum_buffers, params) -> list:
    if momentum_buffers is None:
        raise ValueError("momentum_buffers is required when momentum != 0 (one zero-initialised tensor per param)")
    bufs = V.check_tensor_list(momentum_buffers, "momentum_buffers")
    if len(bufs) != len(params):
        raise ValueError(f"momentum_buffers has {len(bufs)} tensors but params has {len(params)}")
    for i, p in enumerate(params):
        V.check_like(bufs[i], p, f"momentum_buffers[{i}]", f"params[{i}]")
    return bufs


def step(params: list, grads: list, fast: bool, *, lr, weight_decay, max_norm: float, mode_id: int, momentum,
         momentum_buffers, grad_scale, found_inf, backend) -> NarStats:
    """The fused step of lists from :func:`checked_lists` (not ``mixed``), ``max_norm``
    and ``mode_id`` from :func:`check_clip`: the part's hyperparameters checked, then one
    backend call (see :func:`nar_step_`)."""
    device, dtype = params[0].device, params[0].dtype
    lr, weight_decay, momentum = check_part(lr, weight_decay, momentum, device, dtype, lr_sizes=((),))
    bufs: list = []
    if momentum != 0.0:
        fast_bufs = fast and momentum_buffers is not None  # the fast pass checked them
        bufs = list(momentum_buffers) if fast_bufs else _check_buffers(momentum_buffers, params)
    grad_scale = V.check_scalar_tensor(grad_scale, "grad_scale", device)
    found_inf = V.check_scalar_tensor(found_inf, "found_inf", device)
    if grad_scale is not None:
        grad_scale = grad_scale.to(V.acc_dtype(dtype))
    run = _dispatch.kernel("nar_step_", backend, device)
    return NarStats(*run(params, grads, bufs, *split(lr), *split(weight_decay), max_norm, mode_id, momentum,
                         grad_scale, found_inf))
