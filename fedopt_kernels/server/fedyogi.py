"""FedYogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021)."""

from __future__ import annotations

from ._adaptive import BetasServerOptimizer


class FedYogi(BetasServerOptimizer):
    r"""FedYogi, Reddi et al. 2021 Algorithm 2, on the mean update ``D = sum_i p_i D_i``::

        m <- beta1 m + (1 - beta1) D
        v <- v - (1 - beta2) D^2 sign(v - D^2)
        x <- x - lr m / (sqrt(v) + tau)

    ``m`` starts at 0 and ``v`` at ``tau^2``; no bias correction.

    Args:
        params: the global model's parameters (or param groups).
        lr (float): server lr (default 1e-2; the paper tunes it per task).
        betas (tuple): ``(beta1, beta2)`` (default ``(0.9, 0.99)``, the paper's).
        tau (float): ``> 0`` (default 1e-3).
        nonfinite, max_client_norm, backend, aggregator: see :class:`ServerOptimizer`.
    """

    rule = "yogi"
