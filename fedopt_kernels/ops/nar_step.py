"""``nar_step_``: the fused FedNAR local step (public functional op)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .. import backends
from ..backends.hyper import split
from . import _dtensor, _library, validation as V

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


def _check_mode(mode) -> int:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return MODES.index(mode)


def _check_common(lr, weight_decay, max_norm, mode, momentum, backend, device, dtype, lr_sizes):
    mode_id = _check_mode(mode)
    acc = V.acc_dtype(dtype)
    lr = V.check_hyper(lr, "lr", device, acc, sizes=lr_sizes)
    weight_decay = V.check_hyper(weight_decay, "weight_decay", device, acc, sizes=lr_sizes)
    max_norm = V.check_real(max_norm, "max_norm", low=0.0, low_open=True, allow_inf=True)
    momentum = V.check_real(momentum, "momentum", low=0.0, high=1.0, high_open=True)
    V.check_backend(backend)
    return lr, weight_decay, max_norm, mode_id, momentum


def _check_lists(params, grads):
    """Detailed checks of params and grads, raising a message that names the argument.
    Returns ``(params, grads, mixed)``: ``mixed`` when the tensors span several dtypes or
    devices (one norm over them all is then taken by ``nar_step_groups_``)."""
    params = V.check_tensor_list(params, "params")
    grads = V.check_tensor_list(grads, "grads")
    if not params:
        raise ValueError("params must contain at least one tensor")
    if len(grads) != len(params):
        raise ValueError(f"grads has {len(grads)} tensors but params has {len(params)}")
    for i, p in enumerate(params):
        V.check_like(grads[i], p, f"grads[{i}]", f"params[{i}]")
    mixed = any(p.dtype != params[0].dtype or p.device != params[0].device for p in params)
    return params, grads, mixed


def _check_buffers(momentum_buffers, params) -> list:
    if momentum_buffers is None:
        raise ValueError("momentum_buffers is required when momentum != 0 (one zero-initialised tensor per param)")
    bufs = V.check_tensor_list(momentum_buffers, "momentum_buffers")
    if len(bufs) != len(params):
        raise ValueError(f"momentum_buffers has {len(bufs)} tensors but params has {len(params)}")
    for i, p in enumerate(params):
        V.check_like(bufs[i], p, f"momentum_buffers[{i}]", f"params[{i}]")
    return bufs


def nar_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    lr,
    weight_decay=0.0,
    max_norm: float = 10.0,
    mode: str = "co",
    momentum: float = 0.0,
    momentum_buffers: Optional[Sequence[torch.Tensor]] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> NarStats:
    r"""One fused FedNAR local step, in place, over all ``params`` taken as ONE vector.

    With ``x`` the concatenation of ``params`` and ``g`` of ``grads`` ([FedNAR]
    eq. 3-5; python_ref/fednar.py), ``eps = 1e-6``:

    * ``mode="co"`` (FedNAR):  ``v = g + wd x``, ``s = min(1, A / (||v|| + eps))``,
      ``x <- x - lr * s * v``
    * ``mode="grad"`` (gradient clipping): ``s = min(1, A / (||g|| + eps))``,
      ``x <- x - lr * (s g + wd x)``
    * ``mode="none"``: ``x <- x - lr * (g + wd x)``

    With ``momentum = beta > 0`` the direction ``d`` goes through a heavy-ball buffer:
    ``b <- beta b + d``, ``x <- x - lr b`` (``momentum_buffers`` required, updated in
    place).  ``grad_scale`` (a GradScaler's scale) divides ``g`` first; a non-zero
    ``found_inf`` skips the step.  A non-finite norm skips the step too: params and
    buffers keep their exact bits and ``stats.skipped`` is True.

    Tensors of several dtypes or devices (as ``clip_grad_norm_`` accepts them) still form
    ONE vector: the call then runs as :func:`~fedopt_kernels.ops.nar_step_groups_` with
    one group (a norm pass per dtype and device, partial sums combined in a fixed order
    on the first tensor's device, stats in float32, float64 if any tensor is float64).

    Args:
        params, grads: equally long lists of same-shaped tensors (fp16/bf16/fp32/fp64,
            contiguous or dense; ``grads[i]`` like ``params[i]``).
        lr, weight_decay: numbers ``>= 0`` or 0-d tensors on the device (a tensor can
            change without recompiling under ``torch.compile``).
        max_norm: the clip threshold ``A > 0`` (``inf`` disables clipping).
        backend: ``"reference"``, ``"cpu"``, ``"triton"``, ``"cuda"`` or None (the
            ``FEDOPT_BACKEND`` environment variable, else chosen by device).

    Returns:
        :class:`NarStats` of 0-d tensors; ``norm``/``scale`` in float32 (float64 for
        float64 params).  Runs two passes over the data (norm, then update) whatever the
        number of tensors, and never synchronises with the device.
    """
    if _dtensor.any_dtensor(params if isinstance(params, (list, tuple)) else ()):
        # sharded parameters: one norm over the whole model (ops/_dtensor.py), as a group call
        from .nar_step_groups import NarGroup, nar_step_groups_

        group = NarGroup(params, grads, lr, weight_decay, momentum, momentum_buffers)
        return nar_step_groups_([group], max_norm=max_norm, mode=mode, grad_scale=grad_scale,
                                found_inf=found_inf, backend=backend, _plain_names=True)
    V.check_untracked(params, "params", written=True)
    V.check_untracked(momentum_buffers or [], "momentum_buffers", written=True)
    V.check_untracked(grads, "grads", written=False)
    # The common case is checked in one tight pass; anything unusual takes the detailed
    # checks, which raise the message naming the argument.
    fast = V.lists_match_fast(params, grads, momentum_buffers if momentum != 0.0 else None)
    if fast:
        params, grads = list(params), list(grads)
    else:
        params, grads, mixed = _check_lists(params, grads)
        if mixed:
            from .nar_step_groups import NarGroup, nar_step_groups_

            group = NarGroup(params, grads, lr, weight_decay, momentum, momentum_buffers)
            return nar_step_groups_([group], max_norm=max_norm, mode=mode, grad_scale=grad_scale,
                                    found_inf=found_inf, backend=backend, _plain_names=True)
    device, dtype = params[0].device, params[0].dtype
    lr, weight_decay, max_norm, mode_id, momentum = _check_common(
        lr, weight_decay, max_norm, mode, momentum, backend, device, dtype, lr_sizes=((),))
    bufs: list = []
    if momentum != 0.0:
        fast_bufs = fast and momentum_buffers is not None  # the fast pass checked them
        bufs = list(momentum_buffers) if fast_bufs else _check_buffers(momentum_buffers, params)
    grad_scale = V.check_scalar_tensor(grad_scale, "grad_scale", device)
    found_inf = V.check_scalar_tensor(found_inf, "found_inf", device)
    if grad_scale is not None:
        grad_scale = grad_scale.to(V.acc_dtype(dtype))
    args = (params, grads, bufs, *split(lr), *split(weight_decay), max_norm, mode_id, momentum, grad_scale,
            found_inf)
    if torch.compiler.is_compiling():
        result = _library.nar_step_op(*args, backends.resolve_name(backend, device.type))
    else:
        result = backends.resolve(backend, device).nar_step_(*args)
    return NarStats(*result)


def nar_step_batched_(
    X: torch.Tensor,
    G: torch.Tensor,
    *,
    lr,
    weight_decay=0.0,
    max_norm: float = 10.0,
    mode: str = "co",
    momentum: float = 0.0,
    momentum_buffers: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> NarStats:
    """Row-wise :func:`nar_step_` on ``[C, N]`` tensors: row ``i`` is client ``i``.

    Every row has its own norm, scale and skip flag (stats of shape ``[C]``); a
    non-finite row is skipped while the others step.  ``lr`` and ``weight_decay`` may be
    numbers, 0-d tensors or ``[C]`` tensors (clients at different points of a
    schedule).  One norm pass and one update pass over all rows.
    """
    V.check_untracked(X, "X", written=True)
    V.check_untracked(momentum_buffers, "momentum_buffers", written=True)
    V.check_untracked(G, "G", written=False)
    X = V.check_tensor(X, "X", dims=2)
    G = V.check_tensor(G, "G", dims=2)
    if not X.is_contiguous():
        raise ValueError("X must be contiguous ([C, N] with one client per row)")
    V.check_like(G, X, "G", "X")
    C = X.shape[0]
    lr, weight_decay, max_norm, mode_id, momentum = _check_common(
        lr, weight_decay, max_norm, mode, momentum, backend, X.device, X.dtype, lr_sizes=((), (C,)))
    B = None
    if momentum != 0.0:
        if momentum_buffers is None:
            raise ValueError("momentum_buffers is required when momentum != 0 (a zero-initialised [C, N] tensor)")
        B = V.check_tensor(momentum_buffers, "momentum_buffers", dims=2)
        V.check_like(B, X, "momentum_buffers", "X")
    grad_scale = V.check_scalar_tensor(grad_scale, "grad_scale", X.device)
    found_inf = V.check_scalar_tensor(found_inf, "found_inf", X.device)
    if grad_scale is not None:
        grad_scale = grad_scale.to(V.acc_dtype(X.dtype))
    args = (X, G, B, *split(lr), *split(weight_decay), max_norm, mode_id, momentum, grad_scale, found_inf)
    if torch.compiler.is_compiling():
        result = _library.nar_step_batched_op(*args, backends.resolve_name(backend, X.device.type))
    else:
        result = backends.resolve(backend, X.device).nar_step_batched_(*args)
    return NarStats(*result)
