"""Privacy accounting of DP-FedAvg rounds: epsilon at a given delta after each round.

The accounting is Google's ``dp-accounting`` (the ``privacy`` extra:
``pip install fedopt_kernels[privacy]``), its Renyi-DP accountant; nothing here is a
hand-written bound.  One round of :class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator` is a
sampled Gaussian mechanism of noise multiplier ``z`` (the std of the noise over the
sensitivity of the clipped sum; with adaptive clipping ``z`` covers the update and the
clip-count query together, Andrew et al. 2021, section 3.1), composed over rounds:

==============  ====================================================================
``sampling``    the mechanism accounted, and its neighbouring datasets
==============  ====================================================================
``"poisson"``   each client takes part independently with ``q = m / n``
                (``PoissonSampledDpEvent``); add/remove one client
``"fixed"``     exactly ``m`` of the ``n`` clients, uniformly without replacement (what
                the simulator does; ``SampledWithoutReplacementDpEvent``, Wang, Balle
                & Kasiviswanathan 2019, Theorem 27); replace one client's data, ``n``
                public.  Replacing a clipped update moves the sum by up to ``2 C``, so
                the accountant is given ``z / 2``
``"all"``       every client in every round (``GaussianDpEvent``, no amplification);
                add/remove one client
==============  ====================================================================

Any other way of choosing the clients (with replacement, by data size, by
availability) is not modelled, and is refused by name rather than accounted wrongly.

Per round the RDP of one round is computed once; after ``T`` rounds it is ``T`` times
that (composition), converted to ``(epsilon, delta)`` by dp-accounting's
``compute_epsilon`` (Canonne, Kamath & Steinke 2020's conversion), so a round costs a
conversion, not a new RDP computation.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ...extras import require

__all__ = ["SAMPLINGS", "PrivacyAccountant", "check_sampling"]

SAMPLINGS = ("poisson", "fixed", "all")


def check_sampling(sampling: str, num_clients: int, clients_per_round: float) -> None:
    """Refuse a client sampling the accountant does not model, naming the argument."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling {sampling!r} is not modelled by the privacy accountant (choose one of "
                         f"{', '.join(SAMPLINGS)}): an unmodelled sampling would be accounted wrongly")
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    if sampling == "fixed" and (isinstance(clients_per_round, bool) or not float(clients_per_round).is_integer()):
        raise ValueError(f"clients_per_round must be a whole number of clients for fixed-size sampling, got "
                         f"{clients_per_round!r}")
    if not (0 < clients_per_round <= num_clients):
        raise ValueError(f"clients_per_round must be in (0, num_clients={num_clients}], got {clients_per_round!r}")
    if sampling == "all" and clients_per_round != num_clients:
        raise ValueError(f"sampling 'all' takes every client: clients_per_round must be {num_clients}, got "
                         f"{clients_per_round!r}")


class PrivacyAccountant:
    """``(epsilon, delta)`` of ``rounds`` DP-FedAvg rounds (see the module docstring).

    Args:
        noise_multiplier: ``z > 0``, the noise std over the clip (the combined ``z`` of
            adaptive clipping, not its ``z_Delta``).
        sampling: ``"poisson"``, ``"fixed"`` or ``"all"``.
        num_clients: ``n``, the population.
        clients_per_round: ``m`` (expected, for Poisson).
        delta: the ``delta`` epsilon is reported at, in ``(0, 1)``.
        orders: RDP orders (default: dp-accounting's).
    """

    def __init__(self, noise_multiplier: float, *, sampling: str, num_clients: int, clients_per_round: float,
                 delta: float, orders: Optional[Sequence[float]] = None):
        if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float)) \
                or not math.isfinite(noise_multiplier) or noise_multiplier <= 0:
            raise ValueError(f"noise_multiplier must be a finite number > 0 to account privacy, got "
                             f"{noise_multiplier!r} (without noise epsilon is infinite)")
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not (0 < delta < 1):
            raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
        check_sampling(sampling, num_clients, clients_per_round)
        require("privacy", "privacy accounting (fedopt_kernels.server.differential_privacy.privacy_accountant)")
        import dp_accounting
        from dp_accounting import dp_event, rdp

        self.noise_multiplier = float(noise_multiplier)
        self.sampling = sampling
        self.num_clients = int(num_clients)
        self.clients_per_round = float(clients_per_round)
        self.delta = float(delta)
        self.rounds = 0
        relation = dp_accounting.NeighboringRelation
        gaussian = dp_event.GaussianDpEvent
        if sampling == "poisson":
            event = dp_event.PoissonSampledDpEvent(self.clients_per_round / self.num_clients,
                                                   gaussian(self.noise_multiplier))
            neighbours = relation.ADD_OR_REMOVE_ONE
        elif sampling == "fixed":
            # replace-one: the sum moves by up to 2C, so noise z C is z / 2 times the sensitivity
            event = dp_event.SampledWithoutReplacementDpEvent(self.num_clients, int(self.clients_per_round),
                                                              gaussian(self.noise_multiplier / 2))
            neighbours = relation.REPLACE_ONE
        else:
            event = gaussian(self.noise_multiplier)
            neighbours = relation.ADD_OR_REMOVE_ONE
        self.event = event
        self.neighbouring_relation = neighbours.name
        one = rdp.RdpAccountant(orders=orders, neighboring_relation=neighbours)
        one.compose(event, 1)
        self._orders = one.orders
        self._round_rdp = one.rdp  # the RDP of one round at every order
        self._compute_epsilon = rdp.rdp_privacy_accountant.compute_epsilon

    def step(self, rounds: int = 1) -> None:
        """Count ``rounds`` more rounds."""
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
        self.rounds += rounds

    def epsilon(self, rounds: Optional[int] = None) -> float:
        """Epsilon at :attr:`delta` after ``rounds`` rounds (default: those counted)."""
        t = self.rounds if rounds is None else rounds
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
        if t == 0:
            return 0.0
        eps, _ = self._compute_epsilon(self._orders, t * self._round_rdp, self.delta)
        return float(eps)

    def to_dict(self) -> dict:
        """What is accounted, for ``results.json``."""
        return {"accountant": "rdp (dp-accounting)", "sampling": self.sampling,
                "neighbouring_relation": self.neighbouring_relation, "noise_multiplier": self.noise_multiplier,
                "num_clients": self.num_clients, "clients_per_round": self.clients_per_round, "delta": self.delta}

    def state_dict(self) -> dict:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        rounds = state.get("rounds") if isinstance(state, dict) else None
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"the accountant's state must hold rounds, an integer >= 0, got {rounds!r}")
        self.rounds = rounds
