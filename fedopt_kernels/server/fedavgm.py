"""FedAvgM: FedAvg with server momentum."""

from __future__ import annotations

from typing import Optional

import torch

from .. import defaults as D
from ._base import ServerOptimizer, check_nonneg, state_buffers


class FedAvgM(ServerOptimizer):
    r"""FedAvg with server (heavy-ball) momentum (Hsu et al. 2019; Reddi et al. 2021).

    PyTorch-SGD form on the mean update :math:`D = \sum_i p_i D_i`, ``b`` starting at 0::

        b <- momentum * b + D
        x <- x - lr * b                       (nesterov: x <- x - lr * (momentum * b + D))

    Args:
        params: the global model's parameters (or param groups).
        lr (float): server learning rate (default 1).
        momentum (float): in ``[0, 1)`` (default 0.9).
        nesterov (bool): Nesterov's form (default False).
        nonfinite, max_client_norm, backend, aggregator: see :class:`ServerOptimizer`.
    """

    def __init__(self, params, lr: float = D.SERVER["fedavgm"]["lr"], momentum: float = D.SERVER["fedavgm"]["momentum"],
                 *, nesterov: bool = False,
                 nonfinite: str = "exclude", max_client_norm: Optional[float] = None,
                 backend: Optional[str] = None, aggregator=None):
        check_nonneg(lr, "lr")
        check_nonneg(momentum, "momentum", high=1.0, high_open=True)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=bool(nesterov)), nonfinite=nonfinite,
                         max_client_norm=max_client_norm, backend=backend, aggregator=aggregator)

    def _server_step(self, d_views, info):
        for group, views in zip(self.param_groups, d_views):
            bufs = state_buffers(self, group["params"], "momentum_buffer",
                                 lambda p: torch.zeros_like(p, memory_format=torch.preserve_format))
            self._update(group["params"], views, "momentum", info.skip, exp_avg=bufs, lr=group["lr"],
                         beta1=group["momentum"], nesterov=group["nesterov"])
        return dict(lr_scale=torch.ones((), dtype=info.sq_norm.dtype, device=info.sq_norm.device))
