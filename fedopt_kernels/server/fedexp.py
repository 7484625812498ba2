"""FedExP: FedAvg with an extrapolated, adaptive server step size."""

from __future__ import annotations

from typing import Optional

import torch

from .. import defaults as D
from ._base import ServerOptimizer, check_nonneg


class FedExP(ServerOptimizer):
    r"""FedExP (Jhunjhunwala, Wang and Joshi, ICLR 2023).

    From the statistics of the round's single fused aggregation (normalised weights
    ``p_i``, mean update ``D = sum_i p_i D_i``)::

        eta_g = max(1, sum_i p_i ||D_i||^2 / (2 (||D||^2 + eps')))
        x    <- x - lr * eta_g * D

    ``eps' = eps`` (the paper's formula, default) or ``M * eps`` with ``M`` the number
    of clients that entered the mean (``scale_eps_by_clients=True``: the authors'
    released code, which also decays ``eps`` by ``0.998^2`` per round -- a schedule a
    user can apply to ``param_groups[i]["eps"]``).  ``lr`` is an extra multiplier,
    1 in the paper.  If the ratio is not finite (``eps = 0`` and ``D = 0``)
    ``eta_g = 1`` (the step is zero anyway).  Excluded (NaN) clients do not count;
    with norm bounding, ``||D_i||`` is the bounded norm.  ``eta_g`` is computed per
    param group (from that group's ``eps``); the returned ``lr_scale`` is the first
    group's.

    The paper evaluates the average of the last two iterates; that is an evaluation
    choice outside the optimizer.

    Args:
        params: the global model's parameters (or param groups).
        lr (float): multiplier of ``eta_g`` (default 1).
        eps (float): ``>= 0`` (default 1e-3, the paper's CIFAR-10 value).
        scale_eps_by_clients (bool): use ``M * eps`` as the released code (default False).
        nonfinite, max_client_norm, backend, aggregator: see :class:`ServerOptimizer`.
    """

    needs_client_sq_norms = True  # eta_g / the gain ratio read sum_i p_i ||D_i||^2

    def __init__(self, params, lr: float = D.SERVER["fedexp"]["lr"], eps: float = D.FEDEXP_EPS, *,
                 scale_eps_by_clients: bool = False,
                 nonfinite: str = "exclude", max_client_norm: Optional[float] = None,
                 backend: Optional[str] = None, aggregator=None):
        check_nonneg(lr, "lr")
        check_nonneg(eps, "eps")
        super().__init__(params, dict(lr=lr, eps=eps, scale_eps_by_clients=bool(scale_eps_by_clients)),
                         nonfinite=nonfinite, max_client_norm=max_client_norm, backend=backend, aggregator=aggregator)

    @staticmethod
    def step_size(info, eps, scale_eps_by_clients: bool) -> torch.Tensor:
        """``eta_g`` from a round's statistics (0-d tensor, on the device)."""
        eps_ = eps * info.num_clients.to(info.mean_sq.dtype) if scale_eps_by_clients else eps
        ratio = info.mean_sq / (2 * (info.sq_norm + eps_))
        one = torch.ones_like(ratio)
        return torch.where(torch.isfinite(ratio), torch.clamp(ratio, min=1.0), one)

    def _server_step(self, d_views, info):
        first = None
        for group, views in zip(self.param_groups, d_views):
            eta_g = self.step_size(info, group["eps"], group["scale_eps_by_clients"])
            first = eta_g if first is None else first
            self._update(group["params"], views, "sgd", info.skip, lr=group["lr"] * eta_g)
        return dict(lr_scale=first)
