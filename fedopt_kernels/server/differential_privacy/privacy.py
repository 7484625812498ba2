"""DP-FedAvg as a component of the server round: the mechanism and its accountant.

:class:`RoundPrivacy` is what :class:`~fedopt_kernels.server.ServerRound` takes as its
``privacy``: a :class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator` (clip every update, sum,
add Gaussian noise, divide by the clients sampled per round ``m``) that becomes the
server optimizer's aggregation, and a
:class:`~fedopt_kernels.server.differential_privacy.privacy_accountant.PrivacyAccountant` of the rounds run.
``per_round`` of ``clients`` are taken to be sampled uniformly without replacement each
round (``"fixed"``; ``"all"`` when they are equal): the simulator's sampling
(:func:`~fedopt_kernels.fl.run.simulation.sample_clients`) and Flower ``FedAvg``'s.
Which settings would void the guarantee is decided before this is built, by
:func:`~fedopt_kernels.server.differential_privacy.dp_settings.check_dp_settings` (the simulator's config,
the Flower privacy concern).

Per round it records ``dp_clip`` (the clip the round used), ``dp_noise_std`` (the
noise's std in the mean update), ``dp_unclipped_fraction`` (adaptive clipping's
privatised ``b_bar``) and ``dp_epsilon`` (epsilon at ``delta`` after the rounds so far;
only with noise: without it nothing is private).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.dp_noise import clip_updates_
from .dp import DPAggregator
from .privacy_accountant import PrivacyAccountant

__all__ = ["RoundPrivacy"]


class RoundPrivacy:
    """DP-FedAvg's mechanism and accountant (see the module docstring).

    Args:
        clip: the clip ``C`` (the initial clip with ``target_quantile``).
        noise_multiplier: ``z``, the noise std in units of the clip.
        target_quantile: adaptive clipping's target (None: a fixed clip).
        delta: the delta epsilon is reported at (needed with noise).
        mode: ``"server"`` (the server clips) or ``"client"`` (the clients clip to the
            current clip; the server bounds every update all the same).
        seed: the noise's seed.
        clients, per_round: ``n`` and ``m`` of the sampling the accountant models.
        clip_lr, clip_count_stddev: adaptive clipping's ``eta_C`` and ``sigma_b`` (None:
            :class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator`'s defaults).
    """

    def __init__(self, *, clip: float, noise_multiplier: float = 0.0, target_quantile: Optional[float] = None,
                 delta: Optional[float] = None, mode: str = "server", seed: int = 0, clients: int, per_round: int,
                 clip_lr: Optional[float] = None, clip_count_stddev: Optional[float] = None):
        adaptive = {} if clip_lr is None else {"clip_lr": clip_lr}
        self.aggregator = DPAggregator(clip=clip, noise_multiplier=noise_multiplier, expected_clients=per_round,
                                       target_quantile=target_quantile, clip_count_stddev=clip_count_stddev,
                                       mode=mode, seed=seed, **adaptive)
        self.sampling = "all" if per_round == clients else "fixed"
        self.accountant: Optional[PrivacyAccountant] = None
        if noise_multiplier > 0:
            self.accountant = PrivacyAccountant(noise_multiplier, sampling=self.sampling, num_clients=clients,
                                                clients_per_round=per_round, delta=delta)

    @classmethod
    def attach(cls, optimizer, **settings) -> "RoundPrivacy":
        """The mechanism built from ``settings`` (the constructor's) and made the
        aggregation of ``optimizer`` (a :class:`~fedopt_kernels.server.ServerOptimizer`)."""
        self = RoundPrivacy(**settings)  # the mechanism itself, whatever builds it from a config
        optimizer.aggregator = self.aggregator
        return self

    @property
    def mode(self) -> str:
        """Who clips: ``"server"`` or ``"client"``."""
        return self.aggregator.mode

    def current_clip(self) -> float:
        """The clip the next round uses (one host read): what ``mode="client"`` sends."""
        return float(self.aggregator.clip)

    @torch.no_grad()
    def clip_client_updates_(self, rows: torch.Tensor) -> None:
        """``mode="client"``: the clients' own clipping, on the rows of their updates
        (a simulated round does it for them); else nothing."""
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
