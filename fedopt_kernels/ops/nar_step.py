"""``nar_step_``: the fused FedNAR local step (public functional op)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..backends.hyper import split
from . import _dispatch, _dtensor, validation as V
from .. import defaults as D
from ._nar import MODES, NarStats, check_clip, check_common, checked_lists, step
from .nar_step_groups import NarGroup, nar_step_groups_

__all__ = ["MODES", "NarStats", "nar_step_", "nar_step_batched_"]


def nar_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    lr,
    weight_decay=0.0,
    max_norm: float = D.LOCAL["max_norm"],
    mode: str = D.LOCAL["nar"],
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
    if not _dtensor.any_dtensor(params if isinstance(params, (list, tuple)) else ()):
        checked_params, checked_grads, fast, mixed = checked_lists(params, grads, momentum, momentum_buffers)
        if not mixed:
            max_norm, mode_id = check_clip(max_norm, mode, backend)
            return step(checked_params, checked_grads, fast, lr=lr, weight_decay=weight_decay, max_norm=max_norm,
                        mode_id=mode_id, momentum=momentum, momentum_buffers=momentum_buffers,
                        grad_scale=grad_scale, found_inf=found_inf, backend=backend)
        params, grads = checked_params, checked_grads
    # sharded parameters (one norm over the whole model, ops/_dtensor.py) or tensors of
    # several dtypes or devices: one group of nar_step_groups_
    group = NarGroup(params, grads, lr, weight_decay, momentum, momentum_buffers)
    return nar_step_groups_([group], max_norm=max_norm, mode=mode, grad_scale=grad_scale, found_inf=found_inf,
                            backend=backend, _plain_names=True)


def nar_step_batched_(
    X: torch.Tensor,
    G: torch.Tensor,
    *,
    lr,
    weight_decay=0.0,
    max_norm: float = D.LOCAL["max_norm"],
    mode: str = D.LOCAL["nar"],
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
    lr, weight_decay, max_norm, mode_id, momentum = check_common(
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
    run = _dispatch.kernel("nar_step_batched_", backend, X.device)
    return NarStats(*run(X, G, B, *split(lr), *split(weight_decay), max_norm, mode_id, momentum, grad_scale,
                         found_inf))
