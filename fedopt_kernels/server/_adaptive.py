"""Shared body of FedAdagrad, FedAdam and FedYogi (Reddi et al. 2021, Algorithm 2)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._base import ServerOptimizer, axpy, check_nonneg, commit_


class AdaptiveServerOptimizer(ServerOptimizer):
    r"""``m <- b1 m + (1 - b1) D``; ``v <- second_moment(v, D^2)``;
    ``x <- x - lr m / (sqrt(v) + tau)`` with ``m_0 = 0``, ``v_0 = tau^2``; no bias
    correction.  Subclasses define :meth:`_second_moment` and the group's ``b1``."""

    def _beta1(self, group) -> float:
        return group["betas"][0]

    def _second_moment(self, group, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _server_step(self, d_views, info):
        for group, views in zip(self.param_groups, d_views):
            lr, tau, b1 = group["lr"], group["tau"], self._beta1(group)
            for p, d in zip(group["params"], views):
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    # Reddi et al. require v_{-1} >= tau^2; start at tau^2.
                    state["exp_avg_sq"] = torch.full_like(p, tau * tau, memory_format=torch.preserve_format)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m_new = axpy(m.to(d.dtype) * b1, 1 - b1, d)  # b1 m + (1 - b1) D
                v_new = self._second_moment(group, v.to(d.dtype), d * d)
                denom = torch.sqrt(v_new).add_(tau)
                x_new = p.to(d.dtype) - (m_new / denom).mul_(lr)
                commit_(m, m_new, info.skip)
                commit_(v, v_new, info.skip)
                commit_(p, x_new, info.skip)
        return dict(lr_scale=torch.ones((), dtype=info.sq_norm.dtype, device=info.sq_norm.device))


class BetasServerOptimizer(AdaptiveServerOptimizer):
    """The constructor FedAdam and FedYogi share: ``lr``, ``betas=(beta1, beta2)``, ``tau``."""

    def __init__(self, params, lr: float = 1e-2, betas: Tuple[float, float] = (0.9, 0.99), tau: float = 1e-3, *,
                 nonfinite: str = "exclude", max_client_norm: Optional[float] = None,
                 backend: Optional[str] = None):
        check_nonneg(lr, "lr")
        check_nonneg(betas[0], "betas[0]", high=1.0, high_open=True)
        check_nonneg(betas[1], "betas[1]", high=1.0, high_open=True)
        check_nonneg(tau, "tau", low_open=True)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), tau=tau), nonfinite=nonfinite,
                         max_client_norm=max_client_norm, backend=backend)
