"""ASNES: adaptive-scale Nesterov server step (AdaScale gain ratio + Nesterov momentum)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import defaults as D
from ._base import ServerOptimizer, check_nonneg, commit_, state_buffers

SIGMA2_MIN = 1e-6  # AdaScale's floor on the variance estimate


class ASNES(ServerOptimizer):
    r"""ASNES (Wang, Feng and Luo: [ASNES], eq. 3 and 4a-4c).

    From the statistics of the round's single fused aggregation (updates ``D_i``,
    normalised weights ``p_i``, ``D = sum_i p_i D_i``)::

        sigma2 = (sum_i p_i ||D_i||^2 - ||D||^2) / (1 - sum_i p_i^2)     # eq. 3
        S      = 1 / sum_i p_i^2
        nu2    = ||D||^2 - sigma2 / S                                   # eq. 3
        sigma2 <- max(sigma2, 1e-6) ;  nu2 <- max(nu2, 0)               # AdaScale clamps
        r      = (sigma2 + nu2) / (sigma2 / S + nu2)    in [1, S]       # eq. 3

        u <- beta u + D ;  v = beta u + D ;  x <- x - lr * r * v          # eq. 4a-4c

    The paper averages the participating clients uniformly (eq. 2, Algorithm 1 line
    13: ``1/|S_t| sum``), and ``S = |S_t|`` is their number: pass no weights (the
    simulator's and the Flower strategy's ``weighting="auto"`` do so for ASNES).
    For uniform weights ``p_i = 1/S`` this is the paper's eq. (3) exactly
    (``1/(1 - 1/S) = S/(S-1)``); for other weights it is the unbiased weighted
    generalisation, with Kish's effective number of clients ``S = 1/sum_i p_i^2``
    (see ``python_ref/asnes.py``).  nu2 is computed from the UNclamped sigma2, as
    fairscale's AdaScale does.  A round with ``S == 1`` (one client, or one carrying all
    the weight) gives ``r = 1``, reports ``sigma2 = 0``, ``nu2 = ||D||^2``, and leaves
    the smoothed estimates untouched.

    Smoothing (``smoothing = f`` in ``[0, 1)``, default 0 = off): the clamped sigma2
    and nu2 are averaged across rounds with AdaScale's bias-corrected EMA
    (``b <- f b + (1-f) x``, ``c <- f c + (1-f)``, estimate ``b / c``) and ``r`` uses
    the averages with this round's ``S``.  The EMA lives in the state of the first
    parameter (so it round-trips through ``state_dict``); ``smoothing`` is read from the
    first param group (the gain ratio is one number for the model).

    Args:
        params: the global model's parameters (or param groups).
        lr (float): the base server lr ``eta0`` (default 1: the paper's step is
            ``eta_t = r`` itself, eq. 3 and 4c; the simulator and the Flower strategy
            use 1 too).
        momentum (float): ``beta`` in ``[0, 1)`` (default 0.9, the paper's Fashion-MNIST
            value; 0.85 for CIFAR-10).
        smoothing (float): EMA factor in ``[0, 1)`` (default 0).
        nonfinite, max_client_norm, backend, aggregator: see :class:`ServerOptimizer`.
    """

    needs_client_sq_norms = True  # eta_g / the gain ratio read sum_i p_i ||D_i||^2

    def __init__(self, params, lr: float = D.SERVER["asnes"]["lr"], momentum: float = D.SERVER["asnes"]["momentum"], *,
                 smoothing: float = D.ASNES_SMOOTHING,
                 nonfinite: str = "exclude", max_client_norm: Optional[float] = None,
                 backend: Optional[str] = None, aggregator=None):
        check_nonneg(lr, "lr")
        check_nonneg(momentum, "momentum", high=1.0, high_open=True)
        check_nonneg(smoothing, "smoothing", high=1.0, high_open=True)
        super().__init__(params, dict(lr=lr, momentum=momentum, smoothing=smoothing), nonfinite=nonfinite,
                         max_client_norm=max_client_norm, backend=backend, aggregator=aggregator)

    def _gain_ratio(self, info):
        """``(r, sigma2, nu2)`` of this round, updating the EMA state (no host sync)."""
        dtype, device = info.sq_norm.dtype, info.sq_norm.device
        zero = torch.zeros((), dtype=dtype, device=device)
        one = torch.ones((), dtype=dtype, device=device)
        Q = info.sq_norm
        denom = 1 - info.sum_p_sq
        # At least two clients carry weight: a variance can be estimated (a skipped
        # round has none, and sum_p_sq = 0 there).
        multi = (denom > 0) & (info.num_clients >= 2)
        sigma2_raw = (info.mean_sq - Q) / torch.where(multi, denom, one)
        S = torch.where(multi, 1 / torch.where(multi, info.sum_p_sq, one), one)
        nu2_raw = Q - sigma2_raw / S  # from the UNclamped sigma2 (AdaScale)
        sigma2 = torch.clamp(sigma2_raw, min=SIGMA2_MIN)
        nu2 = torch.clamp(nu2_raw, min=0.0)

        f = self.param_groups[0]["smoothing"]
        state = self.state[self.param_groups[0]["params"][0]]
        if "sigma2_ema" not in state:
            state["sigma2_ema"] = zero.clone()
            state["nu2_ema"] = zero.clone()
            state["ema_weight"] = zero.clone()
        update = multi & ~info.skip
        b_s = f * state["sigma2_ema"] + (1 - f) * sigma2
        b_n = f * state["nu2_ema"] + (1 - f) * nu2
        c = f * state["ema_weight"] + (1 - f)
        commit_(state["sigma2_ema"], b_s, ~update)
        commit_(state["nu2_ema"], b_n, ~update)
        commit_(state["ema_weight"], c, ~update)
        sigma2_avg, nu2_avg = b_s / c, b_n / c  # used only when `update` (c > 0 then)

        r = (sigma2_avg + nu2_avg) / (sigma2_avg / S + nu2_avg)
        r = torch.minimum(torch.clamp(r, min=1.0), S)  # [1, S], against rounding
        r = torch.where(multi, r, one)
        return r, torch.where(multi, sigma2_avg, zero), torch.where(multi, nu2_avg, Q)

    def _server_step(self, d_views, info):
        r, sigma2, nu2 = self._gain_ratio(info)
        for group, views in zip(self.param_groups, d_views):
            bufs = state_buffers(self, group["params"], "momentum_buffer",
                                 lambda p: torch.zeros_like(p, memory_format=torch.preserve_format))
            # eq. 4a-4c are heavy-ball momentum in Nesterov's form with lr * r.
            self._update(group["params"], views, "momentum", info.skip, exp_avg=bufs, lr=group["lr"] * r,
                         beta1=group["momentum"], nesterov=True)
        return dict(lr_scale=r, gain_ratio=r, sigma2=sigma2, nu2=nu2)
