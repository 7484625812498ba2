"""FedExP server step size (the oracle).

Source: Jhunjhunwala, Wang and Joshi, "FedExP: Speeding Up Federated Averaging via
Extrapolation", ICLR 2023: its adaptive server step size.  With normalised client
weights ``p_i`` and updates ``D_i = x_start - x_end_i``::

    D     = sum_i p_i D_i
    eta_g = max(1, sum_i p_i ||D_i||^2 / (2 (||D||^2 + eps)))
    x    <- x - eta_g * D

For uniform weights ``sum_i p_i ||D_i||^2 = (1/M) sum_i ||D_i||^2``, which is the
paper's ``sum_i ||D_i||^2 / (2 M (||D||^2 + eps))``.

``eps``: the paper's formula (above) is the default.  The authors' released code
(``Divyansh03/FedExP``, ``main.py``) puts ``M * eps`` in the denominator (``M`` the
number of participating clients) and decays ``eps`` by ``0.998^2`` per round;
``scale_eps_by_clients=True`` gives the first (the decay is a schedule on ``eps``).
Its default in the paper's CIFAR experiments is ``eps = 1e-3``.

Guard (not in the paper): if the ratio is not finite (``eps = 0`` with ``D = 0``)
``eta_g = 1``; the step ``eta_g * D`` is then zero anyway.
"""

from __future__ import annotations

from typing import Sequence

import torch


def fedexp_step_size(updates: Sequence[torch.Tensor], p: torch.Tensor, *, eps: float = 1e-3,
                     scale_eps_by_clients: bool = False) -> torch.Tensor:
    """``eta_g`` computed from the updates directly (explicit loops)."""
    D = torch.zeros_like(updates[0])
    mean_sq = torch.zeros((), dtype=updates[0].dtype, device=updates[0].device)
    for pi, Di in zip(p, updates):
        pi = pi.to(Di.dtype)
        D = D + pi * Di
        mean_sq = mean_sq + pi * torch.dot(Di, Di)
    M = int((p > 0).sum()) if scale_eps_by_clients else 1
    ratio = mean_sq / (2 * (torch.dot(D, D) + M * eps))
    one = torch.ones_like(ratio)
    return torch.where(torch.isfinite(ratio), torch.maximum(one, ratio), one)


def fedexp(x, updates: Sequence[torch.Tensor], p: torch.Tensor, *, lr: float = 1.0, eps: float = 1e-3,
           scale_eps_by_clients: bool = False):
    """One FedExP round: returns ``(x_new, eta_g)`` (``lr`` multiplies ``eta_g``; 1 in the paper)."""
    eta_g = fedexp_step_size(updates, p, eps=eps, scale_eps_by_clients=scale_eps_by_clients)
    D = torch.zeros_like(x)
    for pi, Di in zip(p, updates):
        D = D + pi.to(Di.dtype) * Di
    return x - lr * eta_g * D, eta_g
