"""Shared body of FedAdagrad, FedAdam and FedYogi (Reddi et al. 2021, Algorithm 2)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import defaults as D
from ._base import ServerOptimizer, check_nonneg, state_buffers


class AdaptiveServerOptimizer(ServerOptimizer):
    r"""``m <- b1 m + (1 - b1) D``; ``v <- second_moment(v, D^2)``;
    ``x <- x - lr m / (sqrt(v) + tau)`` with ``m_0 = 0``, ``v_0 = tau^2``; no bias
    correction.  Subclasses name their ``rule`` of :func:`fedopt_kernels.ops.server_update_`
    (which fuses the three lines into one pass) and the group's ``b1``/``b2``."""

    rule: str = ""

    def _betas(self, group) -> Tuple[float, float]:
        return group["betas"]

    def _server_step(self, d_views, info):
        for group, views in zip(self.param_groups, d_views):
            params, tau = group["params"], group["tau"]
            b1, b2 = self._betas(group)
            m = state_buffers(self, params, "exp_avg",
                              lambda p: torch.zeros_like(p, memory_format=torch.preserve_format))
            # Reddi et al. require v_{-1} >= tau^2; start at tau^2.
            v = state_buffers(self, params, "exp_avg_sq",
                              lambda p: torch.full_like(p, tau * tau, memory_format=torch.preserve_format))
            self._update(params, views, self.rule, info.skip, exp_avg=m, exp_avg_sq=v, lr=group["lr"], beta1=b1,
                         beta2=b2, tau=tau)
        return dict(lr_scale=torch.ones((), dtype=info.sq_norm.dtype, device=info.sq_norm.device))


def check_betas(betas, name: str = "betas") -> None:
    """``betas`` must be a pair ``(beta1, beta2)`` (a tuple or list of two numbers)."""
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"{name} must be a pair (beta1, beta2) of numbers in [0, 1), got {betas!r}")


class BetasServerOptimizer(AdaptiveServerOptimizer):
    """The constructor FedAdam and FedYogi share: ``lr``, ``betas=(beta1, beta2)``, ``tau``."""

    def __init__(self, params, lr: float = D.SERVER["fedadam"]["lr"], betas: Tuple[float, float] = D.ADAPTIVE["betas"],
                 tau: float = D.ADAPTIVE["tau"], *, nonfinite: str = "exclude", max_client_norm: Optional[float] = None,
                 backend: Optional[str] = None, aggregator=None):
        check_nonneg(lr, "lr")
        check_betas(betas)
        check_nonneg(betas[0], "betas[0]", high=1.0, high_open=True)
        check_nonneg(betas[1], "betas[1]", high=1.0, high_open=True)
        check_nonneg(tau, "tau", low_open=True)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), tau=tau), nonfinite=nonfinite,
                         max_client_norm=max_client_norm, backend=backend, aggregator=aggregator)
