"""Differential privacy in the simulator: the settings of a run as the server round's
privacy component.

The mechanism and its accountant are :class:`fedopt_kernels.server.differential_privacy.privacy.RoundPrivacy`
(the component :class:`~fedopt_kernels.server.ServerRound` takes, the Flower privacy
concern's too).  The simulator samples ``per_round`` of the ``clients`` uniformly
without replacement (:func:`~fedopt_kernels.fl.run.simulation.sample_clients`): fixed-size
sampling, accounted as such (``"all"`` when every client takes part), the divisor
``m = per_round``, the noise seeded by ``--seed``.  Which settings would void the
guarantee is decided once, by :meth:`SimulationConfig.validate
<fedopt_kernels.fl.run.config.SimulationConfig.validate>`
(:func:`~fedopt_kernels.server.differential_privacy.dp_settings.check_dp_settings`).
"""

from __future__ import annotations

from typing import Optional

from ...server.differential_privacy.privacy import RoundPrivacy as _Mechanism
from .config import SimulationConfig

__all__ = ["RoundPrivacy", "privacy_of"]


def _settings(config: SimulationConfig) -> dict:
    return dict(clip=config.dp_clip, noise_multiplier=config.dp_noise_multiplier,
                target_quantile=config.dp_target_quantile, delta=config.dp_delta, mode=config.dp_mode,
                seed=config.seed, clients=config.clients, per_round=config.per_round)


def privacy_of(config: SimulationConfig) -> Optional[_Mechanism]:
    """The run's DP-FedAvg, the privacy component of its round (None without
    ``config.dp_clip``)."""
    return None if config.dp_clip is None else _Mechanism(**_settings(config))


class RoundPrivacy(_Mechanism):
    """The run's mechanism made the aggregation of ``server``'s optimizer (``server``:
    anything with an ``optimizer``): what this name has always built."""

    def __init__(self, config: SimulationConfig, server):
        if config.dp_clip is None:
            raise ValueError("RoundPrivacy needs config.dp_clip")
        if server.optimizer is None:  # pragma: no cover - the config refuses fedlaw with DP
            raise ValueError(f"algo {config.algo} has no server optimizer to aggregate with differential privacy")
        super().__init__(**_settings(config))
        server.optimizer.aggregator = self.aggregator
