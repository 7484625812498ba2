"""Differential privacy in the simulator: DP-FedAvg on the server optimizer, and the
privacy spent after every round.

:class:`RoundPrivacy` puts a :class:`~fedopt_kernels.server.dp.DPAggregator` on the
server optimizer of a :class:`~fedopt_kernels.fl.server_side.ServerSide` (its step then
aggregates with clipping and noise, whatever its formula does with the mean) and
accounts the rounds with :class:`~fedopt_kernels.server.privacy_accountant.PrivacyAccountant`.
The simulator samples ``per_round`` of the ``clients`` uniformly without replacement
(:func:`~fedopt_kernels.fl.simulation.sample_clients`): fixed-size sampling, accounted
as such (``"all"`` when every client takes part), the divisor ``m = per_round``.
Which settings would void the guarantee is decided once, by
:meth:`SimulationConfig.validate <fedopt_kernels.fl.config.SimulationConfig.validate>`
(:func:`~fedopt_kernels.fl.dp_settings.check_dp_settings`).  The Flower strategies'
``dp_*`` arguments build the same mechanism and accountant with :meth:`RoundPrivacy.attach`
(Flower samples ``m`` of ``n`` nodes uniformly without replacement too).

Per round it records ``dp_clip`` (the clip the round used), ``dp_noise_std`` (the
noise's std in the mean update), ``dp_unclipped_fraction`` (adaptive clipping's
privatised ``b_bar``) and ``dp_epsilon`` (epsilon at ``dp_delta`` after the rounds so
far; only with noise: without it nothing is private).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.dp_noise import clip_updates_
from ..server.dp import DPAggregator
from ..server.privacy_accountant import PrivacyAccountant
from .config import SimulationConfig

__all__ = ["RoundPrivacy"]


class RoundPrivacy:
    """DP-FedAvg of a simulated run (see the module docstring); ``server`` is the run's
    :class:`~fedopt_kernels.fl.server_side.ServerSide`.  :meth:`attach` builds the same
    mechanism and accountant on any server optimizer (the Flower strategies' ``dp_*``)."""

    def __init__(self, config: SimulationConfig, server):
        if config.dp_clip is None:
            raise ValueError("RoundPrivacy needs config.dp_clip")
        if server.optimizer is None:  # pragma: no cover - the config refuses fedlaw with DP
            raise ValueError(f"algo {config.algo} has no server optimizer to aggregate with differential privacy")
        self._build(server.optimizer, clip=config.dp_clip, noise_multiplier=config.dp_noise_multiplier,
                    target_quantile=config.dp_target_quantile, delta=config.dp_delta, mode=config.dp_mode,
                    seed=config.seed, clients=config.clients, per_round=config.per_round)

    @classmethod
    def attach(cls, optimizer, *, clip: float, noise_multiplier: float = 0.0, target_quantile: Optional[float] = None,
               delta: Optional[float] = None, mode: str = "server", seed: int = 0, clients: int, per_round: int,
               clip_lr: Optional[float] = None, clip_count_stddev: Optional[float] = None) -> "RoundPrivacy":
        """The simulator's DP-FedAvg on ``optimizer`` (its aggregator is replaced) for
        ``per_round`` of ``clients`` sampled uniformly without replacement each round
        (``"all"`` when they are equal); the settings checked by
        :func:`~fedopt_kernels.fl.dp_settings.check_dp_settings` beforehand."""
        self = cls.__new__(cls)
        self._build(optimizer, clip=clip, noise_multiplier=noise_multiplier, target_quantile=target_quantile,
                    delta=delta, mode=mode, seed=seed, clients=clients, per_round=per_round, clip_lr=clip_lr,
                    clip_count_stddev=clip_count_stddev)
        return self

    def _build(self, optimizer, *, clip, noise_multiplier, target_quantile, delta, mode, seed, clients, per_round,
               clip_lr=None, clip_count_stddev=None) -> None:
        adaptive = {} if clip_lr is None else {"clip_lr": clip_lr}
        self.aggregator = DPAggregator(clip=clip, noise_multiplier=noise_multiplier, expected_clients=per_round,
                                       target_quantile=target_quantile, clip_count_stddev=clip_count_stddev,
                                       mode=mode, seed=seed, **adaptive)
        optimizer.aggregator = self.aggregator
        self.sampling = "all" if per_round == clients else "fixed"
        self.accountant: Optional[PrivacyAccountant] = None
        if noise_multiplier > 0:
            self.accountant = PrivacyAccountant(noise_multiplier, sampling=self.sampling, num_clients=clients,
                                                clients_per_round=per_round, delta=delta)

    @torch.no_grad()
    def clip_client_updates_(self, rows: torch.Tensor) -> None:
        """``dp_mode="client"``: the clients clip their own updates (rows of the round's
        ``[C, N]`` updates) to the current clip before sending them; else nothing."""
        if self.aggregator.mode == "client" and rows.shape[0]:
            clip_updates_(rows, self.aggregator.clip.to(rows.device))

    def record(self) -> dict:
        """The round's DP numbers (after its server step; one host read)."""
        out = self.aggregator.record()
        if self.accountant is not None:
            out["dp_epsilon"] = self.accountant.epsilon(self.aggregator.rounds)
        return out

    def meta(self) -> dict:
        """The settings, for ``results.json`` ``meta["dp"]``."""
        out = {"mechanism": self.aggregator.to_dict(), "private": self.accountant is not None}
        if self.accountant is not None:
            out["accountant"] = self.accountant.to_dict()
        return out

    def state_dict(self) -> dict:
        return self.aggregator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.aggregator.load_state_dict(state)
