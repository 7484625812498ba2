"""FedAdagrad (Reddi et al., "Adaptive Federated Optimization", ICLR 2021)."""

from __future__ import annotations

from typing import Optional

from .. import defaults as D
from ._adaptive import AdaptiveServerOptimizer
from ._base import check_nonneg


class FedAdagrad(AdaptiveServerOptimizer):
    r"""FedAdagrad, Reddi et al. 2021 Algorithm 2, on the mean update ``D = sum_i p_i D_i``::

        m <- momentum m + (1 - momentum) D
        v <- v + D^2
        x <- x - lr m / (sqrt(v) + tau)

    ``m`` starts at 0 and ``v`` at ``tau^2``.  Algorithm 2 writes the first moment
    ``beta1`` for all three methods; for FedAdagrad the default is ``beta1 = 0`` (plain
    Adagrad, ``m = D``): the paper's released code runs FedAdagrad as
    ``tf.keras.optimizers.Adagrad``, which has no first moment
    (google-research/federated ``utils/optimizers/optimizer_utils.py``), and Flower's
    FedAdagrad fixes ``beta_1 = 0``.  The simulator and
    :class:`fedopt_kernels.integrations.flower.FedAdagrad` use the same defaults.

    Args:
        params: the global model's parameters (or param groups).
        lr (float): server lr (default 0.1: the FedAdagrad server lr of Flower's
            reproduction of the paper's CIFAR-10/100 runs, ``flwr_baselines``
            ``adaptive_federated_optimization``; the paper tunes it per task).
        momentum (float): ``beta1`` in ``[0, 1)`` (default 0, see above).
        tau (float): ``> 0`` (default 1e-3, as FedAdam and FedYogi here).
        nonfinite, max_client_norm, backend, aggregator: see :class:`ServerOptimizer`.
    """

    rule = "adagrad"

    def __init__(self, params, lr: float = D.SERVER["fedadagrad"]["lr"],
                 momentum: float = D.SERVER["fedadagrad"]["momentum"], tau: float = D.ADAPTIVE["tau"], *,
                 nonfinite: str = "exclude", max_client_norm: Optional[float] = None,
                 backend: Optional[str] = None, aggregator=None):
        check_nonneg(lr, "lr")
        check_nonneg(momentum, "momentum", high=1.0, high_open=True)
        check_nonneg(tau, "tau", low_open=True)
        super().__init__(params, dict(lr=lr, momentum=momentum, tau=tau), nonfinite=nonfinite,
                         max_client_norm=max_client_norm, backend=backend, aggregator=aggregator)

    def _betas(self, group):
        return group["momentum"], 0.0
