"""``RoundAnnealing``: FedNAR's per-round annealing of the local lr (and weight decay)."""

from __future__ import annotations

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..ops.validation import check_real
from .feddecay import composed_lrs


def annealing_factor(round_index: int, decay: float) -> float:
    """``decay ** round_index``: the factor of round ``round_index`` (0-based)."""
    return float(decay) ** max(int(round_index), 0)


class RoundAnnealing(LRScheduler):
    r"""Per-round annealing of the local learning rate, as in FedNAR's experiments.

    Call :meth:`step` once per communication round (after the round).  In round ``t``
    (0-based, ``t = last_epoch``)::

        lr_t           = lr_0 * lr_decay ** t                  # [FedNAR] section 5: 0.998
        weight_decay_t = wd_0 * weight_decay_decay ** t        # optional extra factor

    With a :class:`~fedopt_kernels.lr_scheduler.FedDecay` on the same optimizer the two
    multiply (``lr = lr_0 * lr_decay^t * beta_k``, in either order of construction;
    :func:`~fedopt_kernels.lr_scheduler.feddecay.composed_lrs`): neither overwrites
    the other's factor.
    FedNAR's weight decay is in the PyTorch-SGD sense, so the paper's decay
    ``u_t = lr_t * wd`` already anneals with ``lr_t``; ``weight_decay_decay`` (default 1:
    off) anneals ``wd`` on top of that, for groups that have a ``"weight_decay"`` key.
    Both are closed forms of ``last_epoch``; the initial values are kept in the param
    groups (``initial_lr``, ``initial_weight_decay``) so ``state_dict()`` round-trips.

    Args:
        optimizer: the local optimizer (e.g. :class:`~fedopt_kernels.optim.FedNAR`).
        lr_decay: per-round factor in ``(0, 1]`` (default 0.998).
        weight_decay_decay: per-round extra factor of the weight decay, ``(0, 1]``.
        last_epoch: index of the last round (``-1`` to start).
    """

    def __init__(self, optimizer: Optimizer, lr_decay: float = 0.998, weight_decay_decay: float = 1.0,
                 last_epoch: int = -1):
        self.lr_decay = check_real(lr_decay, "lr_decay", low=0.0, high=1.0)
        self.weight_decay_decay = check_real(weight_decay_decay, "weight_decay_decay", low=0.0, high=1.0)
        if self.lr_decay == 0.0 or self.weight_decay_decay == 0.0:
            raise ValueError("lr_decay and weight_decay_decay must be > 0")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        for i, group in enumerate(optimizer.param_groups):
            if "weight_decay" not in group:
                continue
            if last_epoch == -1:
                wd = group["weight_decay"]
                group.setdefault("initial_weight_decay", wd.clone() if isinstance(wd, torch.Tensor) else wd)
            elif "initial_weight_decay" not in group:
                raise KeyError(f"param 'initial_weight_decay' is not specified in param_groups[{i}] "
                               "when resuming the scheduler with last_epoch >= 0")
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return composed_lrs(self, annealing_factor(self.last_epoch, self.lr_decay))

    def _get_closed_form_lr(self):
        return self.get_lr()

    def weight_decay_factor(self) -> float:
        return annealing_factor(self.last_epoch, self.weight_decay_decay)

    def step(self, epoch=None) -> None:  # noqa: D102 (LRScheduler.step, plus the weight decay)
        super().step(epoch)
        f = self.weight_decay_factor()
        for group in self.optimizer.param_groups:
            if "initial_weight_decay" not in group:
                continue
            value = group["initial_weight_decay"] * f
            if isinstance(group["weight_decay"], torch.Tensor):
                group["weight_decay"].fill_(float(value))
            else:
                group["weight_decay"] = value

    def get_last_weight_decay(self) -> list:
        """The weight decay of each param group (None for groups without one)."""
        return [g.get("weight_decay") for g in self.optimizer.param_groups]


__all__ = ["RoundAnnealing", "annealing_factor"]
