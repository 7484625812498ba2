"""``FedNAR``: the FedNAR local optimizer as a ``torch.optim.Optimizer``."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.optim import Optimizer

from .. import backends
from ..ops import MODES, NarStats, nar_step_
from ..ops import _validation as V


class FedNAR(Optimizer):
    r"""Local SGD with FedNAR's co-clipping of gradient and weight decay.

    Each parameter group is one vector ``x`` (all its parameters flattened together) with
    gradient ``g``; per step, with ``eps = 1e-6`` (fednar.txt Algorithm 2, eq. 3-5)::

        mode="co"   (FedNAR)  v = g + wd x ;  s = min(1, A / (||v|| + eps)) ;  d = s v
        mode="grad" (clip g)  s = min(1, A / (||g|| + eps)) ;              d = s g + wd x
        mode="none"           d = g + wd x
        momentum = 0:  x <- x - lr d
        momentum > 0:  b <- momentum b + d ;  x <- x - lr b

    ``weight_decay`` is in the PyTorch-SGD sense: the paper's ``u_t = lr * wd``, so
    annealing ``lr`` across rounds (the paper: ``lr_t = lr_0 * 0.998^t``) anneals the
    decay with it.  ``mode="co"`` equals the authors' released recipe (add
    ``0.5 wd ||x||^2`` to the loss, ``clip_grad_norm_(params, A)``, plain SGD).

    The step is one fused op per group (two passes over the data, no host sync). A group
    whose norm is not finite is skipped: its parameters and momentum buffers keep their
    exact bits.  The last step's statistics of each group are in :attr:`last_stats`
    (``norm``, ``scale``, ``skipped`` as device tensors; ``scale < 1`` means clipped).

    Mixed precision: ``torch.amp.GradScaler`` hands this optimizer its scale and inf flag
    (``_step_supports_amp_scaling``), so gradients are unscaled inside the fused step,
    the norm is that of the unscaled gradient and an overflow skips the step without a
    host sync.  Do not call ``scaler.unscale_(optimizer)`` before ``scaler.step``.

    Args:
        params: parameters or param-group dicts.  A group's parameters must share one
            dtype and device (its norm is taken over all of them together).
        lr: learning rate ``>= 0`` (a float, or a 0-d tensor on the params' device to
            change it without recompiling under ``torch.compile``).
        weight_decay: ``wd >= 0`` (float or 0-d tensor).
        max_norm: clip threshold ``A > 0`` (the paper uses 10).
        mode: ``"co"``, ``"grad"`` or ``"none"``.
        momentum: heavy-ball factor in ``[0, 1)`` (not in the paper).
        backend: kernel backend (``"reference"``, ``"cpu"``, ``"triton"``, ``"cuda"``)
            or None to choose by device / ``FEDOPT_BACKEND``.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, lr, weight_decay=0.0, max_norm: float = 10.0, mode: str = "co",
                 momentum: float = 0.0, backend: Optional[str] = None):
        defaults = dict(lr=lr, weight_decay=weight_decay, max_norm=max_norm, mode=mode, momentum=momentum,
                        backend=backend)
        _check_hyperparameters(defaults)
        super().__init__(params, defaults)
        self.last_stats: list = [None] * len(self.param_groups)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _check_hyperparameters(self.param_groups[-1])
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if p.is_complex():
                raise ValueError(f"FedNAR does not support complex parameters (param {i} of the new group)")
        if hasattr(self, "last_stats"):
            self.last_stats.append(None)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.last_stats = [None] * len(self.param_groups)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """Perform one step; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                self.last_stats[index] = None
                continue
            grads = []
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("FedNAR does not support sparse gradients")
                grads.append(p.grad)
            bufs = None
            if group["momentum"] != 0.0:
                bufs = []
                for p in params:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    bufs.append(state["momentum_buffer"])
            self.last_stats[index] = nar_step_(
                params, grads, lr=group["lr"], weight_decay=group["weight_decay"], max_norm=group["max_norm"],
                mode=group["mode"], momentum=group["momentum"], momentum_buffers=bufs,
                grad_scale=grad_scale, found_inf=found_inf, backend=group["backend"])
        return loss

    def clip_stats(self) -> list:
        """The last step's :class:`~fedopt_kernels.ops.NarStats` per group (None if the
        group had no gradients)."""
        return list(self.last_stats)


def _check_hyperparameters(group: dict) -> None:
    """Reject bad hyperparameters with a message naming them (device-tensor values can
    only be checked for shape and dtype without a sync)."""
    for name in ("lr", "weight_decay"):
        value = group[name]
        if isinstance(value, torch.Tensor):
            if value.dim() != 0 or not value.is_floating_point():
                raise ValueError(f"{name} as a tensor must be a 0-d floating tensor, got shape "
                                 f"{tuple(value.shape)} and dtype {value.dtype}")
        else:
            V.check_real(value, name, low=0.0)
    V.check_real(group["max_norm"], "max_norm", low=0.0, low_open=True, allow_inf=True)
    V.check_real(group["momentum"], "momentum", low=0.0, high=1.0, high_open=True)
    if group["mode"] not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {group['mode']!r}")
    backend = group["backend"]
    if backend is not None and backend not in backends.BACKENDS:
        raise ValueError(f"backend must be one of {backends.BACKENDS} or None, got {backend!r}")


__all__ = ["FedNAR", "NarStats"]
