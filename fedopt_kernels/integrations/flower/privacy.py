"""DP-FedAvg on Flower (docs/privacy.md): the simulator's mechanism and accountant.

Every update is clipped to ``clip`` (the initial clip with ``target_quantile``), the
clipped updates summed, Gaussian noise added and the sum divided by the nodes sampled
per round ``m`` (:class:`fedopt_kernels.server.RoundPrivacy`, the round's privacy
component, so a round equals the simulator's on the same updates).  The settings are
``fedopt simulate``'s ``--dp-*`` flags, same names and meanings: ``noise_multiplier``
(``z``: noise std ``z`` times the clip), ``target_quantile`` (adaptive clipping, Andrew
et al. 2021), ``delta`` (the round's metrics carry ``dp_epsilon`` at it), ``mode``
(``"server"``, or ``"client"``: the current clip goes to the clients in the train
``ConfigRecord`` as ``"dp-clip"``, for them to clip to -- the server bounds every update
all the same), ``clip_lr`` and ``clip_count_stddev`` (adaptive clipping's ``eta_C``,
default 0.2, and ``sigma_b``, default ``m / 20``), ``seed`` (round ``t``'s noise key is
``dp_noise_key(seed, t)``).  ``num_clients`` is ``n``, the nodes of the federation:
Flower's ``FedAvg`` samples ``m = max(int(fraction_train n), min_train_nodes)`` of them
uniformly without replacement, which the accountant models (``"fixed"``; ``"all"`` when
``m = n``); ``configure_train`` refuses a round where the grid has another number of
nodes.  The round's metrics carry ``dp_clip``, ``dp_noise_std``,
``dp_unclipped_fraction`` (adaptive) and ``dp_epsilon`` (with noise), as results.json
does.  Settings that would void the guarantee are refused, naming the argument, by the
checks of ``fedopt simulate`` (:func:`~fedopt_kernels.server.differential_privacy.dp_settings.check_dp_settings`):
data-size weighting (``weighting="uniform"`` is needed), SCAFFOLD, FedExP, ASNES, FedLAW,
a robust aggregator, noise without ``delta``.
"""

from __future__ import annotations

from typing import List, Optional

from flwr.app import Message
from flwr.serverapp import Grid

from ...server import RoundPrivacy
from ...server.differential_privacy.dp_settings import PYTHON_NAMES, check_dp_settings, robust_with_dp_error
from .concern import Concern, ConcernWrapper

__all__ = ["DifferentialPrivacy", "PrivacyConcern", "DP_CLIP_KEY"]

DP_CLIP_KEY = "dp-clip"  # the train ConfigRecord's entry with mode="client": the clip the clients clip to


class PrivacyConcern(Concern):
    """DP-FedAvg as a concern of a fused strategy (module docstring); the arguments are
    the strategy's ``dp_*`` without the prefix (``num_clients`` is ``dp_num_clients``)."""

    order = 2
    state_key = "privacy"

    def __init__(self, clip: float, num_clients: Optional[int] = None, noise_multiplier: float = 0.0,
                 target_quantile: Optional[float] = None, delta: Optional[float] = None, mode: str = "server",
                 clip_lr: Optional[float] = None, clip_count_stddev: Optional[float] = None, seed: int = 0):
        n = num_clients
        if n is None:
            raise ValueError("dp_clip needs dp_num_clients, the number of nodes in the federation, which Flower "
                             "samples from each round: the privacy accountant needs it")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"dp_num_clients must be a positive integer, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"dp_seed must be an integer >= 0, got {seed!r}")
        self.settings = dict(clip=clip, noise_multiplier=noise_multiplier, target_quantile=target_quantile,
                             delta=delta, mode=mode, clip_lr=clip_lr, clip_count_stddev=clip_count_stddev)
        self.num_clients, self.seed = n, seed
        self.per_round: Optional[int] = None
        self.privacy: Optional[RoundPrivacy] = None

    @staticmethod
    def refuse_without_clip(dp: dict) -> None:
        """The ``dp_*`` arguments given without ``dp_clip`` (``dp``: without the prefix):
        any of them is refused by name."""
        given = {k: v for k, v in dp.items() if k not in ("clip", "num_clients", "seed")}
        check_dp_settings(clip=None, **given, algo="", weighting="", resolved_weighting="", clients=1, per_round=1,
                          names=PYTHON_NAMES)
        if dp.get("num_clients") is not None:
            raise ValueError("dp_num_clients needs dp_clip (the clip C): it is the population differential "
                             "privacy is accounted over")

    def prepare(self, strategy) -> None:
        n = self.num_clients
        m = self.per_round = max(int(n * strategy.fraction_train), strategy.min_train_nodes)
        if m > n:
            raise ValueError(f"the nodes sampled per round, max(int(fraction_train * dp_num_clients), "
                             f"min_train_nodes) = {m}, exceed dp_num_clients = {n}")
        check_dp_settings(**self.settings, algo="", weighting="uniform", resolved_weighting="uniform", clients=n,
                          per_round=m, names=PYTHON_NAMES)

    def bind(self, strategy) -> None:
        if strategy.robust is not None:
            raise ValueError(robust_with_dp_error(strategy.robust.rule, PYTHON_NAMES))
        check_dp_settings(**self.settings, algo=strategy.algorithm, weighting=strategy.weighting_rule,
                          resolved_weighting=strategy.weighting, clients=self.num_clients, per_round=self.per_round,
                          names=PYTHON_NAMES)
        self.privacy = self.stateful = RoundPrivacy(**self.settings, seed=self.seed, clients=self.num_clients,
                                                    per_round=self.per_round)

    def round_parts(self) -> dict:
        return {"privacy": self.privacy}

    def configure(self, strategy, messages: List[Message], grid: Grid) -> None:
        """Refuse a round whose sampling the accountant does not model (``m`` of ``n``
        nodes, uniformly without replacement); with ``mode="client"`` send the clip."""
        if not messages:
            return
        n, m = self.num_clients, self.per_round
        sampled, connected = len(messages), len(list(grid.get_node_ids()))
        if connected != n or sampled != m:
            raise ValueError(f"differential privacy is accounted for {m} of dp_num_clients = {n} nodes sampled per "
                             f"round, but this round sampled {sampled} of {connected} connected nodes: the accountant "
                             "would report a wrong epsilon; set dp_num_clients to the federation's size")
        if self.privacy.mode == "client":  # the clip the clients clip to (one host read)
            clip = self.privacy.current_clip()
            for msg in messages:
                msg.content[strategy.configrecord_key][DP_CLIP_KEY] = clip

    def describe(self):
        return "differential privacy", str(self.privacy.meta())


class DifferentialPrivacy(ConcernWrapper):
    """DP-FedAvg around a fused strategy, as Flower's DP wrappers around its strategies
    (module docstring): ``clip`` and ``num_clients`` (``n``) required."""

    def __init__(self, strategy, clip: float, num_clients: int, *, noise_multiplier: float = 0.0,
                 target_quantile: Optional[float] = None, delta: Optional[float] = None, mode: str = "server",
                 clip_lr: Optional[float] = None, clip_count_stddev: Optional[float] = None, seed: int = 0):
        super().__init__(strategy, PrivacyConcern(clip, num_clients, noise_multiplier, target_quantile, delta, mode,
                                                  clip_lr, clip_count_stddev, seed))
