"""``FedNAR``: the FedNAR local optimizer as a ``torch.optim.Optimizer``."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from .. import defaults as D
from .eager_base import EagerOptimizer

from ..ops import MODES, NarGroup, NarStats, nar_step_, nar_step_groups_
from ..ops import validation as V

CLIP_SCOPES = ("optimizer", "group")


class FedNAR(EagerOptimizer):
    r"""Local SGD with FedNAR's co-clipping of gradient and weight decay.

    All parameters of all param groups are ONE vector (``clip_scope="optimizer"``, the
    default), as the authors clip once over ``model.parameters()``; group ``k`` keeps its
    own ``lr_k``, ``wd_k`` and momentum.  Per step, with ``eps = 1e-6`` ([FedNAR]
    Algorithm 2, eq. 3-5; python_ref/fednar.py)::

        mode="co"   (FedNAR)  v_k = g_k + wd_k x_k ;  n = ||(v_1, ..., v_K)||
                              s = min(1, A / (n + eps)) ;            d_k = s v_k
        mode="grad" (clip g)  n = ||(g_1, ..., g_K)|| ;  s as above ;  d_k = s g_k + wd_k x_k
        mode="none"           d_k = g_k + wd_k x_k
        momentum_k = 0:  x_k <- x_k - lr_k d_k
        momentum_k > 0:  b_k <- momentum_k b_k + d_k ;  x_k <- x_k - lr_k b_k

    The usual no-decay group (biases, norm layers: ``weight_decay=0``) is just
    ``wd_k = 0`` inside the same norm.  ``clip_scope="group"`` takes one norm per group
    instead (each group clipped as if alone; not the paper's recipe).

    ``weight_decay`` is in the PyTorch-SGD sense: the paper's ``u_t = lr * wd``, so
    annealing ``lr`` across rounds (the paper: ``lr_t = lr_0 * 0.998^t``) anneals the
    decay with it.  ``mode="co"`` equals the authors' released recipe (add
    ``0.5 wd_k ||x_k||^2`` to the loss for each decayed group, one
    ``clip_grad_norm_(model.parameters(), A)``, SGD with per-group lr).

    Parameters may mix dtypes (fp32/fp16/bf16/fp64) and devices, as
    ``clip_grad_norm_`` allows: squares are summed in float32 (float64 for float64) per
    group, dtype and device and combined in a fixed order on the first parameter's
    device.  The step is one norm pass and one update pass over all the data (one
    launch each per group, dtype and device; see
    :func:`~fedopt_kernels.ops.nar_step_groups_`), no host sync, deterministic.  A
    non-finite norm skips the step of every group sharing it: parameters and momentum
    buffers keep their exact bits.  The last step's statistics are in
    :attr:`last_stats`, one entry per group (``norm``, ``scale``, ``skipped`` as device
    tensors, ``scale < 1`` means clipped); with ``clip_scope="optimizer"`` every group
    with gradients holds the same shared statistics.

    Mixed precision: ``torch.amp.GradScaler`` hands this optimizer its scale and inf flag
    (``_step_supports_amp_scaling``), so gradients are unscaled inside the fused step,
    the norm is that of the unscaled gradient and an overflow skips the step without a
    host sync.  ``scaler.unscale_(optimizer)`` before ``scaler.step`` is not needed but
    allowed (e.g. to look at the gradients): the step then gets the unscaled gradients
    and only the inf flag, for one more pass over them, and takes the same step
    (``tests/test_amp.py``; ``docs/compile.md``).

    Args:
        params: parameters or param-group dicts (each group may set ``lr``,
            ``weight_decay``, ``momentum``; with ``clip_scope="optimizer"`` ``max_norm``,
            ``mode`` and ``backend`` must be the same in every group).
        lr: learning rate ``>= 0`` (a float, or a 0-d tensor on the params' device to
            change it without recompiling under ``torch.compile``).
        weight_decay: ``wd >= 0`` (float or 0-d tensor); default 1e-3
            (:data:`fedopt_kernels.defaults.LOCAL`, as the simulator and the Flower
            client).  With 0, co-clipping is plain gradient clipping.
        max_norm: clip threshold ``A > 0`` (default 10, the paper's).
        mode: ``"co"``, ``"grad"`` or ``"none"``.
        momentum: heavy-ball factor in ``[0, 1)`` (not in the paper).
        backend: kernel backend (``"reference"``, ``"cpu"``, ``"triton"``, ``"cuda"``)
            or None to choose by device / ``FEDOPT_BACKEND``.
        clip_scope: ``"optimizer"`` (default: one norm over every parameter of every
            group, the paper's recipe) or ``"group"`` (one norm per group).
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, lr, weight_decay=D.LOCAL["weight_decay"], max_norm: float = D.LOCAL["max_norm"],
                 mode: str = D.LOCAL["nar"], momentum: float = D.LOCAL["momentum"], backend: Optional[str] = None, *,
                 clip_scope: str = "optimizer"):
        if clip_scope not in CLIP_SCOPES:
            raise ValueError(f"clip_scope must be one of {CLIP_SCOPES}, got {clip_scope!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, max_norm=max_norm, mode=mode, momentum=momentum,
                        backend=backend)
        _check_hyperparameters(defaults)
        self.clip_scope = clip_scope
        super().__init__(params, defaults)
        self.last_stats: list = [None] * len(self.param_groups)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyperparameters(group)
            for i, p in enumerate(group["params"]):
                if p.is_complex():
                    raise ValueError(f"FedNAR does not support complex parameters (param {i} of the new group)")
            if self.clip_scope == "optimizer":
                _check_shared(self.param_groups)
        except (ValueError, TypeError):
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise
        if hasattr(self, "last_stats"):
            self.last_stats.append(None)

    def state_dict(self):
        state = super().state_dict()
        state["clip_scope"] = self.clip_scope
        return state

    def load_state_dict(self, state_dict):
        """Load a state saved by :meth:`state_dict`, also from an older version or from
        ``torch.optim.SGD``: a hyperparameter the saved groups lack (``max_norm``,
        ``mode``, ``backend``, ``momentum``, ...) keeps this optimizer's value for that
        group, as ``torch.optim`` fills keys newer than a checkpoint.  Refused, with
        nothing changed: another ``clip_scope``, a group count that differs, invalid
        values, and SGD settings FedNAR has no equivalent for (``nesterov=True``,
        ``dampening != 0``, ``maximize=True``)."""
        scope = state_dict.get("clip_scope", self.clip_scope)
        if scope != self.clip_scope:
            raise ValueError(f"the state_dict was saved with clip_scope={scope!r} but this optimizer has "
                             f"clip_scope={self.clip_scope!r}; build it with the same clip_scope")
        saved = state_dict.get("param_groups")
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.param_groups):
            raise ValueError(f"the state_dict has {len(saved) if isinstance(saved, (list, tuple)) else 'no'} param "
                             f"groups but this optimizer has {len(self.param_groups)}")
        groups = []
        for k, (mine, theirs) in enumerate(zip(self.param_groups, saved)):
            for key, neutral in (("nesterov", False), ("dampening", 0), ("maximize", False)):
                if theirs.get(key, neutral) != neutral:
                    raise ValueError(f"param group {k} of the state_dict has {key}={theirs[key]!r}, which FedNAR "
                                     f"has no equivalent for (it comes from another optimizer)")
            group = {key: value for key, value in mine.items() if key != "params"}
            group.update(theirs)
            try:
                _check_hyperparameters(group)
            except (ValueError, TypeError) as e:
                raise ValueError(f"param group {k} of the state_dict: {e}") from None
            groups.append(group)
        if self.clip_scope == "optimizer":
            _check_shared(groups)
        state_dict = {k: v for k, v in state_dict.items() if k != "clip_scope"}
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("clip_scope", "group")  # pickled before clip_scope existed
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
        stepped = []  # (index, NarGroup) of the groups with gradients
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            self.last_stats[index] = None
            if not params:
                continue
            grads = []
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("FedNAR does not support sparse gradients")
                grads.append(_in_layout_of(p.grad, p))
            bufs = None
            if group["momentum"] != 0.0:
                bufs = []
                for p in params:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    bufs.append(state["momentum_buffer"])
            stepped.append((index, NarGroup(params, grads, group["lr"], group["weight_decay"], group["momentum"],
                                            bufs)))
        if not stepped:
            return loss
        if self.clip_scope == "group" or len(stepped) == 1:  # one group: its norm is the optimizer's
            for index, g in stepped:
                group = self.param_groups[index]
                self.last_stats[index] = nar_step_(
                    g.params, g.grads, lr=g.lr, weight_decay=g.weight_decay, max_norm=group["max_norm"],
                    mode=group["mode"], momentum=g.momentum, momentum_buffers=g.momentum_buffers,
                    grad_scale=grad_scale, found_inf=found_inf, backend=group["backend"])
            return loss
        _check_shared(self.param_groups)  # a user may have edited the groups since
        first = self.param_groups[stepped[0][0]]
        stats = nar_step_groups_([g for _, g in stepped], max_norm=first["max_norm"], mode=first["mode"],
                                 grad_scale=grad_scale, found_inf=found_inf, backend=first["backend"])
        for index, _ in stepped:
            self.last_stats[index] = stats
        return loss

    def clip_stats(self) -> list:
        """The last step's :class:`~fedopt_kernels.ops.NarStats` per group (None if the
        group had no gradients)."""
        return list(self.last_stats)


def _in_layout_of(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``p``'s memory layout (the fused kernels walk both as one flat
    array).  A gradient laid out otherwise -- a channels_last weight whose gradient came
    back contiguous, as torch.optim.SGD accepts -- is copied into ``p``'s layout: one
    extra pass over that tensor, none for the usual matching layouts."""
    if grad.stride() == p.stride() or p.numel() <= 1:
        return grad
    return torch.empty_like(p, dtype=grad.dtype).copy_(grad)


def _check_shared(groups: list) -> None:
    """With one norm over all groups, the settings of the norm must be one value."""
    for key in ("max_norm", "mode", "backend"):
        first = groups[0][key]
        for k, group in enumerate(groups[1:], start=1):
            if group[key] != first:
                raise ValueError(
                    f"clip_scope='optimizer' takes one norm over all param groups, so {key} must be the same in "
                    f"every group: group 0 has {key}={first!r}, group {k} has {key}={group[key]!r}; use "
                    f"clip_scope='group' for one norm per group")


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
    V.check_backend(backend)


__all__ = ["FedNAR", "NarStats", "CLIP_SCOPES"]
