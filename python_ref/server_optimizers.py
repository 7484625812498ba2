"""Standard server optimizers on the pseudo-gradient (the oracle).

Source: Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2
(FedOpt), plus FedAvg with FedLAW's global weight shrinking ([FedLAW] eq. 3-4).

Every method works on ONE flat vector ``x`` (all parameters flattened together) and the
clients' updates ``D_i = x_start - x_end_i`` (so ``D`` points like a gradient, uphill;
Reddi et al. write ``Delta_i = x_end_i - x_start = -D_i``).  With
normalised client weights ``p_i`` (uniform by default, ``sum_i p_i = 1``)::

    D = sum_i p_i D_i                                    # the pseudo-gradient

FedAvg with server lr ``eta`` and shrink ``gamma`` ([FedLAW] eq. 4)::

    x <- gamma * (x - eta * D)          # eta = gamma = 1: plain FedAvg, x <- sum_i p_i x_i

FedAvgM (Hsu et al. 2019; Reddi et al.'s "FedAvgM"), heavy ball, PyTorch-SGD form::

    b <- beta * b + D ;  x <- x - eta * b          (nesterov: x <- x - eta * (beta * b + D))

FedAdagrad / FedAdam / FedYogi (Reddi et al. Algorithm 2, written for ``D = -Delta``)::

    m <- beta1 * m + (1 - beta1) * D
    v <- v + D^2                                     # FedAdagrad
    v <- beta2 * v + (1 - beta2) * D^2               # FedAdam
    v <- v - (1 - beta2) * D^2 * sign(v - D^2)       # FedYogi
    x <- x - eta * m / (sqrt(v) + tau)

No bias correction (the paper has none), ``m`` starts at 0 and ``v`` at ``tau^2`` (the
paper requires ``v_{-1} >= tau^2``; we take equality).  Defaults follow the paper's
experiments: ``beta1 = 0.9``, ``beta2 = 0.99``, ``tau = 1e-3``; the server lr ``eta``
is tuned per task in the paper (no universal default).

Plain PyTorch, out of place, on vectors in the compute dtype: the fused classes of
``fedopt_kernels.server`` are tested against these functions.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def normalized_weights(weights: Optional[torch.Tensor], C: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """``p_i = w_i / sum_j w_j`` (uniform ``1/C`` when ``weights`` is None)."""
    if weights is None:
        return torch.full((C,), 1.0 / C, dtype=dtype, device=device)
    w = torch.as_tensor(weights, dtype=dtype, device=device)
    return w / w.sum()


def mean_update(updates: Sequence[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """``D = sum_i p_i D_i`` by an explicit loop."""
    D = torch.zeros_like(updates[0])
    for pi, Di in zip(p, updates):
        D = D + pi.to(Di.dtype) * Di
    return D


def fedavg(x, D, *, lr=1.0, gamma=1.0):
    """FedAvg with server lr and global weight shrinking: ``x <- gamma (x - lr D)``."""
    return gamma * (x - lr * D)


def fedavgm(x, D, b, *, lr=1.0, momentum=0.9, nesterov=False):
    """FedAvgM: returns ``(x, b)``; ``b`` starts at zeros."""
    b = momentum * b + D
    step = momentum * b + D if nesterov else b
    return x - lr * step, b


def init_adaptive_state(x, tau):
    """``(m, v) = (0, tau^2)`` as in Reddi et al. Algorithm 2."""
    return torch.zeros_like(x), torch.full_like(x, tau * tau)


def fedadagrad(x, D, m, v, *, lr=1e-2, momentum=0.0, tau=1e-3):
    """FedAdagrad: returns ``(x, m, v)``."""
    m = momentum * m + (1 - momentum) * D
    v = v + D * D
    return x - lr * m / (torch.sqrt(v) + tau), m, v


def fedadam(x, D, m, v, *, lr=1e-2, betas=(0.9, 0.99), tau=1e-3):
    """FedAdam (no bias correction): returns ``(x, m, v)``."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * D
    v = b2 * v + (1 - b2) * D * D
    return x - lr * m / (torch.sqrt(v) + tau), m, v


def fedyogi(x, D, m, v, *, lr=1e-2, betas=(0.9, 0.99), tau=1e-3):
    """FedYogi: returns ``(x, m, v)``."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * D
    D2 = D * D
    v = v - (1 - b2) * D2 * torch.sign(v - D2)
    return x - lr * m / (torch.sqrt(v) + tau), m, v
