"""FedProx's and SCAFFOLD's client-side corrections, written literally (the oracle).

FedProx (Li et al., MLSys 2020, eq. 2): client ``k`` minimises
``h_k(w) = F_k(w) + mu/2 ||w - w^t||^2``, whose gradient is ``g + mu (w - w^t)``.

SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1):
  line 10   ``y <- y - eta_l (g_i(y) - c_i + c)``       (local step with correction)
  line 12   option II: ``c_i^+ = c_i - c + (x - y_i) / (K eta_l)``
  line 17   ``c <- c + (1/N) sum_{i in S} (c_i^+ - c_i)``  (N: all clients)
With a local lr that changes within the round (FedDecay, annealing) ``K eta_l`` is the
sum of the lrs of the round's K steps (the same quantity for a constant lr).

Both corrections are added to ``g`` BEFORE the FedNAR step, i.e. inside the clip and
the norm (as the FedNAR authors' released code does), so
:func:`local_train` feeds ``g + corrections`` to :func:`python_ref.fednar.nar_update`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .fednar import nar_update


def fedprox_gradient(g: torch.Tensor, x: torch.Tensor, x0: torch.Tensor, mu: float) -> torch.Tensor:
    """``g + mu (x - x0)``: the gradient of FedProx's proximal objective."""
    return g + mu * (x - x0)


def scaffold_gradient(g: torch.Tensor, c: torch.Tensor, c_i: torch.Tensor) -> torch.Tensor:
    """``g - c_i + c``: SCAFFOLD's corrected gradient (Algorithm 1, line 10)."""
    return g - c_i + c


def scaffold_control_variate(c_i: torch.Tensor, c: torch.Tensor, x0: torch.Tensor, x_end: torch.Tensor,
                             lr_sum: float) -> torch.Tensor:
    """Option II: ``c_i^+ = c_i - c + (x0 - x_end) / lr_sum`` (``lr_sum = K eta_l``)."""
    return c_i - c + (x0 - x_end) / lr_sum


def scaffold_server_control(c: torch.Tensor, deltas: Sequence[torch.Tensor], num_clients: int) -> torch.Tensor:
    """``c + (1/N) sum_i (c_i^+ - c_i)`` over the round's sampled clients."""
    total = torch.zeros_like(c)
    for d in deltas:
        total = total + d
    return c + total / num_clients


def local_train(x0: torch.Tensor, grad_fn: Callable[[int, torch.Tensor], torch.Tensor], lrs: Sequence[float], *,
                weight_decay: float = 0.0, max_norm: float = 10.0, mode: str = "co", momentum: float = 0.0,
                mu: float = 0.0, c: Optional[torch.Tensor] = None, c_i: Optional[torch.Tensor] = None):
    """One client's local training from ``x0``: step ``k`` uses ``g = grad_fn(k, x)``
    plus FedProx's term (``mu > 0``) and SCAFFOLD's correction (``c``, ``c_i`` given),
    then the FedNAR step with lr ``lrs[k]``.  Returns ``(x_end, stats)`` with the list of
    each step's :class:`python_ref.fednar.NarStats`.
    """
    x = x0.clone()
    b = torch.zeros_like(x) if momentum != 0.0 else None
    stats = []
    for k, lr in enumerate(lrs):
        g = grad_fn(k, x)
        if mu != 0.0:
            g = fedprox_gradient(g, x, x0, mu)
        if c is not None:
            g = scaffold_gradient(g, c, c_i)
        x, b, st = nar_update(x, g, lr=lr, weight_decay=weight_decay, max_norm=max_norm, mode=mode,
                              momentum=momentum, b=b)
        stats.append(st)
    return x, stats
