"""FedAvg with a server learning rate and global weight shrinking."""

from __future__ import annotations

from typing import Optional

import torch

from .. import defaults as D
from ._base import ServerOptimizer, check_nonneg


class FedAvg(ServerOptimizer):
    r"""FedAvg on the server, with server lr and FedLAW's global weight shrinking.

    With the normalised weighted mean update :math:`D = \sum_i p_i D_i`
    (:math:`D_i = x_{start} - x_{end,i}`)::

        x <- gamma * (x - lr * D)

    ``lr = gamma = 1`` is McMahan et al.'s FedAvg (``x <- sum_i p_i x_i``); ``lr`` is
    the server step size of Reddi et al. 2021 / Karimireddy et al. 2020; ``gamma < 1``
    is the fixed global weight shrinking of Li et al. 2023 ([FedLAW] eq. 3-4:
    ``gamma * sum_i lambda_i w_i`` = ``x - gamma D - (1 - gamma) x`` for ``lr = 1``).

    Args:
        params: the global model's parameters (or param groups).
        lr (float): server learning rate (default 1).
        gamma (float): shrinking factor, ``> 0`` (default 1: no shrinking).
        nonfinite, max_client_norm, backend, aggregator: see :class:`ServerOptimizer`.
    """

    def __init__(self, params, lr: float = D.SERVER["fedavg"]["lr"], gamma: float = 1.0, *, nonfinite: str = "exclude",
                 max_client_norm: Optional[float] = None, backend: Optional[str] = None, aggregator=None):
        check_nonneg(lr, "lr")
        check_nonneg(gamma, "gamma", low_open=True)
        super().__init__(params, dict(lr=lr, gamma=gamma), nonfinite=nonfinite,
                         max_client_norm=max_client_norm, backend=backend, aggregator=aggregator)

    def _server_step(self, d_views, info):
        for group, views in zip(self.param_groups, d_views):
            self._update(group["params"], views, "sgd", info.skip, lr=group["lr"], gamma=group["gamma"])
        return dict(lr_scale=torch.ones((), dtype=info.sq_norm.dtype, device=info.sq_norm.device))
