"""The server algorithms by name: one table for the simulator, the Flower strategies and the CLI.

Each :class:`Algorithm` names its class, its default client weighting (the rule of
``weighting="auto"``) with the source of that rule, and the simulator's config fields
that set its hyperparameters.  Its hyperparameter defaults are not written here: they
are read from the class's own signature (:attr:`Algorithm.defaults`), whose values come
from :mod:`fedopt_kernels.defaults` with their sources -- one place per value.

=============  =========  ===========================================================
algorithm      auto       source of the weighting
=============  =========  ===========================================================
fedavg         size       McMahan et al. 2017, Algorithm 1: ``sum_k (n_k / n) w_k``
fedprox        size       Li et al. 2020, released code ``flearn/trainers/fedbase.py``
                          ``aggregate``: weighted by each client's number of samples
scaffold       uniform    Karimireddy et al. 2020, Algorithm 1: ``x += eta_g / |S|
                          sum_{i in S} dy_i``
fedavgm        size       Hsu et al. 2019: FedAvg's (size-weighted) mean + momentum
fedadam,       size       Reddi et al. 2021: Algorithm 2 writes the plain mean
fedyogi,                  ``1/|S| sum_i Delta_i`` for exposition; the released code
fedadagrad                (google-research/federated ``optimization/shared/
                          fed_avg_schedule.py``: ``client_weight = num_examples``)
                          weights by the client's examples, as FedAvg
fedexp         uniform    Jhunjhunwala et al. 2023, Algorithm 1: ``1/|S| sum_i
                          Delta_i`` (the ``p_i`` of its eta_g are ``1/|S|``)
asnes          uniform    [ASNES] eq. (2) and Algorithm 1 line 13: ``1/|S_t| sum``;
                          S_t = the participating clients (eq. 3)
fedlaw         size       [FedLAW] eq. (5) and Algorithm 1 line 10: lambda starts
                          from ``|D_i| / |D|``
=============  =========  ===========================================================

``fedprox`` and ``scaffold`` are FedAvg on the server (their correction is the
client's; SCAFFOLD adds the server's control variates).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, Mapping

from .asnes import ASNES
from .fedadagrad import FedAdagrad
from .fedadam import FedAdam
from .fedavg import FedAvg
from .fedavgm import FedAvgM
from .fedexp import FedExP
from .fedlaw import FedLAW
from .fedyogi import FedYogi

__all__ = ["Algorithm", "ALGORITHMS", "ALGORITHM_WEIGHTING", "WEIGHTINGS", "algorithm", "resolve_weighting",
           "ROUND_OPTIONS"]

WEIGHTINGS = ("auto", "size", "uniform")

# Constructor arguments that concern the round's aggregation, not the algorithm's formula
# (and the objects a class is built over): not hyperparameters.
ROUND_OPTIONS = ("self", "params", "model", "proxy_loader", "loss_fn", "nonfinite", "max_client_norm", "backend",
                 "aggregator")

# The simulator's SimulationConfig field that sets each hyperparameter (None there: the
# class's default).
_SERVER_FIELDS = MappingProxyType({"lr": "server_lr", "momentum": "server_momentum", "betas": "server_betas",
                                   "tau": "server_tau", "eps": "fedexp_eps"})
_FEDLAW_FIELDS = MappingProxyType({"learn": "fedlaw_learn", "server_epochs": "fedlaw_epochs", "lr": "fedlaw_lr"})


@dataclass(frozen=True)
class Algorithm:
    """One server algorithm: ``cls`` (a :class:`~fedopt_kernels.server.ServerOptimizer`
    subclass over the parameters, or :class:`~fedopt_kernels.server.FedLAW` over the
    model), the ``weighting`` of ``"auto"`` and its ``source``, and ``config_fields``:
    hyperparameter -> the :class:`~fedopt_kernels.fl.SimulationConfig` field that sets it."""

    name: str
    cls: type
    weighting: str
    source: str
    config_fields: Mapping[str, str] = field(default_factory=lambda: _SERVER_FIELDS)

    @property
    def defaults(self) -> Dict[str, object]:
        """The class's hyperparameters and their defaults, read from its signature (the
        round's options -- ``nonfinite``, ``max_client_norm``, ``backend``, ``aggregator``
        -- are not hyperparameters)."""
        return {n: p.default for n, p in inspect.signature(self.cls.__init__).parameters.items()
                if n not in ROUND_OPTIONS and p.default is not inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def hyperparameters(self, config) -> Dict[str, object]:
        """:attr:`defaults`, with the values ``config`` (a ``SimulationConfig``) sets."""
        hyper = self.defaults
        for name, config_field in self.config_fields.items():
            value = getattr(config, config_field, None)
            if name in hyper and value is not None:
                hyper[name] = value
        return hyper


_SIZE_REDDI = ("Reddi et al. 2021 (released code weights by num_examples, as FedAvg)")
ALGORITHMS: Mapping[str, Algorithm] = MappingProxyType({a.name: a for a in (
    Algorithm("fedavg", FedAvg, "size", "McMahan et al. 2017, Algorithm 1"),
    Algorithm("fedprox", FedAvg, "size", "Li et al. 2020, released code flearn/trainers/fedbase.py aggregate"),
    Algorithm("scaffold", FedAvg, "uniform", "Karimireddy et al. 2020, Algorithm 1"),
    Algorithm("fedavgm", FedAvgM, "size", "Hsu et al. 2019: FedAvg's mean + momentum"),
    Algorithm("fedadam", FedAdam, "size", _SIZE_REDDI),
    Algorithm("fedyogi", FedYogi, "size", _SIZE_REDDI),
    Algorithm("fedadagrad", FedAdagrad, "size", _SIZE_REDDI),
    Algorithm("fedexp", FedExP, "uniform", "Jhunjhunwala et al. 2023, Algorithm 1"),
    Algorithm("asnes", ASNES, "uniform", "[ASNES] eq. (2), Algorithm 1 line 13"),
    Algorithm("fedlaw", FedLAW, "size", "[FedLAW] eq. (5), Algorithm 1 line 10", _FEDLAW_FIELDS),
)})

# weighting="auto" per algorithm name, read from the table above.
ALGORITHM_WEIGHTING: Mapping[str, str] = MappingProxyType({n: a.weighting for n, a in ALGORITHMS.items()})


def algorithm(name: str) -> Algorithm:
    """The :class:`Algorithm` of ``name`` (a key of :data:`ALGORITHMS`)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None


def resolve_weighting(weighting: str, algorithm: str) -> str:
    """``"size"`` or ``"uniform"``: ``weighting`` itself, or with ``"auto"`` the rule of
    ``algorithm`` (a key of :data:`ALGORITHM_WEIGHTING`)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
    if weighting != "auto":
        return weighting
    if algorithm not in ALGORITHM_WEIGHTING:
        raise ValueError(f"weighting='auto' does not know the algorithm {algorithm!r}; choose one of "
                         f"{', '.join(ALGORITHM_WEIGHTING)} or pass weighting='size' or 'uniform'")
    return ALGORITHM_WEIGHTING[algorithm]
