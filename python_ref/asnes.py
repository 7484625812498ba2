"""ASNES server step: AdaScale gain ratio + Nesterov momentum (the oracle).

Source: Wang, Feng and Luo, "Federated Learning Optimization Algorithm Based on Dynamic
Client Scale" ([ASNES] in the README's references), eq. (3) and (4a)-(4c), with the clamps of
AdaScale (Johnson et al., ICML 2020; fairscale's ``adascale.py``).

``S`` clients send updates ``D_i = x_start - x_end_i`` (the paper's ``nabla_{n,t}``);
``D = (1/S) sum_i D_i``.  The paper's eq. (3)::

    sigma2 = 1/(S-1) sum_i ||D_i||^2 - S/(S-1) ||D||^2      # variance of ONE update
    nu2    = ||D||^2 - sigma2 / S                           # squared norm of the mean
    r      = (sigma2 + nu2) / (sigma2 / S + nu2)            # the gain ratio, in [1, S]

and eq. (4a)-(4c), Nesterov momentum with the server lr ``eta0 * r``::

    u <- beta * u + D ;   v = beta * u + D ;   w <- w - eta0 * r * v

Clamps (AdaScale): ``sigma2 >= 1e-6``; ``nu2`` is computed from the UNclamped sigma2
and then clamped ``>= 0``.  Then ``r`` lies in ``[1, S]`` (it is clamped to that
interval as well, against rounding).  ``S == 1``: no variance can be estimated and
``r = 1``.

Weighted clients (not in the paper).  With normalised weights ``p_i`` the unbiased
estimates, for independent updates of common mean and variance, are::

    D      = sum_i p_i D_i
    sigma2 = (sum_i p_i ||D_i||^2 - ||D||^2) / (1 - sum_i p_i^2)
    S_eff  = 1 / sum_i p_i^2                   # Kish's effective number of clients
    nu2    = ||D||^2 - sigma2 / S_eff ;   r = (sigma2 + nu2) / (sigma2 / S_eff + nu2)

since ``E[sum_i p_i ||D_i||^2 - ||D||^2] = sigma^2 (1 - sum_i p_i^2)`` and
``Var(D) = sigma^2 sum_i p_i^2``.  For ``p_i = 1/S`` this is exactly eq. (3)
(``1/(1 - 1/S) = S/(S-1)``, ``S_eff = S``).  A client of weight 0 (or excluded for
NaN) drops out by itself; ``sum_i p_i^2 = 1`` (one client carries all the weight) is
the ``S == 1`` case.

Optional smoothing across rounds (AdaScale, fairscale ``_update_avg`` with
``debias_ewma=True``): with factor ``f`` in ``[0, 1)`` the CLAMPED estimates are
averaged, ``b <- f b + (1-f) value``, ``c <- f c + (1-f)``, ``avg = b / c`` (``c`` is
the bias correction), and ``r`` uses the averages with this round's ``S_eff``.
``f = 0`` is no smoothing.  Rounds with ``S_eff == 1`` leave the averages untouched.
"""

from __future__ import annotations

from typing import Sequence

import torch

SIGMA2_MIN = 1e-6


def variance_stats(updates: Sequence[torch.Tensor], p: torch.Tensor):
    """``(sigma2_raw, nu2_raw, S_eff, D)`` by explicit loops; ``S_eff`` None when it is 1."""
    D = torch.zeros_like(updates[0])
    mean_sq = 0.0
    for pi, Di in zip(p.tolist(), updates):
        D = D + pi * Di
        mean_sq += pi * float(torch.dot(Di, Di))
    Q = float(torch.dot(D, D))
    sumsq = sum(pi * pi for pi in p.tolist())
    if 1.0 - sumsq <= 0.0:
        return None, None, None, D
    sigma2_raw = (mean_sq - Q) / (1.0 - sumsq)
    S_eff = 1.0 / sumsq
    nu2_raw = Q - sigma2_raw / S_eff
    return sigma2_raw, nu2_raw, S_eff, D


def gain_ratio(sigma2: float, nu2: float, S: float) -> float:
    """Eq. (3): ``(sigma2 + nu2) / (sigma2 / S + nu2)``, clamped to ``[1, S]``."""
    r = (sigma2 + nu2) / (sigma2 / S + nu2)
    return min(max(r, 1.0), S)


class ASNESReference:
    """ASNES on one flat vector, round after round (state kept in plain attributes)."""

    def __init__(self, x: torch.Tensor, *, lr: float = 1.0, momentum: float = 0.9, smoothing: float = 0.0):
        self.x = x.clone()
        self.u = torch.zeros_like(x)
        self.lr, self.momentum, self.smoothing = lr, momentum, smoothing
        self.b_sigma2 = self.b_nu2 = self.c = 0.0

    def step(self, updates: Sequence[torch.Tensor], p: torch.Tensor):
        """One round; returns ``(r, sigma2, nu2)`` (the clamped, smoothed estimates)."""
        sigma2_raw, nu2_raw, S_eff, D = variance_stats(updates, p)
        if S_eff is None:
            r, sigma2, nu2 = 1.0, None, None
        else:
            sigma2 = max(sigma2_raw, SIGMA2_MIN)
            nu2 = max(nu2_raw, 0.0)
            f = self.smoothing
            self.b_sigma2 = f * self.b_sigma2 + (1 - f) * sigma2
            self.b_nu2 = f * self.b_nu2 + (1 - f) * nu2
            self.c = f * self.c + (1 - f)
            sigma2, nu2 = self.b_sigma2 / self.c, self.b_nu2 / self.c
            r = gain_ratio(sigma2, nu2, S_eff)
        # eq. (4a)-(4c)
        self.u = self.momentum * self.u + D
        v = self.momentum * self.u + D
        self.x = self.x - self.lr * r * v
        return r, sigma2, nu2
