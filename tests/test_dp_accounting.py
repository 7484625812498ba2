"""The privacy accountant (fedopt_kernels.server.differential_privacy.privacy_accountant) against
dp-accounting called directly, against Abadi et al.'s published moments-accountant
example, and against the closed forms of the Gaussian mechanism; the samplings it
refuses; what it says without the privacy extra is in test_dp.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

# the privacy extra is part of the test extra (make setup installs it)
dp_accounting = pytest.importorskip("dp_accounting", reason="needs the privacy extra: pip install fedopt_kernels[privacy]")

from fedopt_kernels.server.differential_privacy.privacy_accountant import PrivacyAccountant  # noqa: E402


def test_epsilon_equals_dp_accounting_called_directly():
    from dp_accounting import NeighboringRelation, dp_event, rdp

    acc = PrivacyAccountant(1.1, sampling="poisson", num_clients=1000, clients_per_round=50, delta=1e-5)
    direct = rdp.RdpAccountant()
    direct.compose(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.1)), 200)
    assert acc.epsilon(200) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    fixed = PrivacyAccountant(2.0, sampling="fixed", num_clients=20, clients_per_round=10, delta=1e-4)
    direct = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_event.SampledWithoutReplacementDpEvent(20, 10, dp_event.GaussianDpEvent(1.0)), 30)
    assert fixed.epsilon(30) == pytest.approx(direct.get_epsilon(1e-4), rel=1e-12)
    fixed.step(30)
    assert fixed.epsilon() == fixed.epsilon(30) and fixed.epsilon(0) == 0.0


def test_abadi_et_al_moments_accountant_example():
    """Abadi et al. 2016, section 3.1: q = 0.01, sigma = 4, T = 10000, delta = 1e-5 gives
    epsilon ~= 1.26 with the moments accountant (the RDP of the subsampled Gaussian at
    integer orders with the bound epsilon = min_a T rdp(a) + log(1/delta) / (a - 1));
    the accountant's own conversion (Canonne et al. 2020) is tighter."""
    acc = PrivacyAccountant(4.0, sampling="poisson", num_clients=60000, clients_per_round=600, delta=1e-5)
    orders, rdp1 = np.asarray(acc._orders), np.asarray(acc._round_rdp)
    ints = orders == np.round(orders)
    moments = float(np.min(10000 * rdp1[ints] + math.log(1e5) / (orders[ints] - 1)))
    assert round(moments, 2) == 1.26
    assert acc.epsilon(10000) < moments


def test_gaussian_rdp_and_epsilon_against_the_closed_forms():
    """Every client every round: the RDP of the Gaussian mechanism is alpha / (2 z^2)
    per round (Mironov 2017, Prop. 7); T rounds are one Gaussian of mu = sqrt(T) / z,
    whose exact epsilon at delta solves Balle & Wang 2018's (Thm 8)
    delta = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2).  The RDP epsilon
    lies between that exact value and Mironov's conversion."""
    z, T, delta = 2.0, 50, 1e-5
    acc = PrivacyAccountant(z, sampling="all", num_clients=10, clients_per_round=10, delta=delta)
    orders = np.asarray(acc._orders)
    np.testing.assert_allclose(acc._round_rdp, orders / (2 * z * z), rtol=1e-12)
    eps = acc.epsilon(T)
    mironov = float(np.min(T * orders / (2 * z * z) + math.log(1 / delta) / (orders - 1)))
    mu = math.sqrt(T) / z
    Phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    d = lambda e: Phi(-e / mu + mu / 2) - math.exp(e) * Phi(-e / mu - mu / 2)  # noqa: E731
    lo, hi = 0.0, 100.0
    for _ in range(200):  # d decreases in eps
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    exact = hi
    assert exact <= eps <= mironov
    assert eps <= 1.1 * exact  # RDP is close to exact for the Gaussian


@pytest.mark.parametrize("kw, match", [
    (dict(noise_multiplier=0.0), "noise_multiplier must be a finite number > 0"),
    (dict(delta=1.0), "delta"),
    (dict(sampling="with_replacement"), "not modelled"),
    (dict(sampling="fixed", clients_per_round=2.5), "whole number"),
    (dict(sampling="all", clients_per_round=5), "every client"),
    (dict(clients_per_round=11), "clients_per_round"),
])
def test_accountant_refuses_what_it_does_not_model(kw, match):
    args = dict(noise_multiplier=1.0, sampling="poisson", num_clients=10, clients_per_round=5, delta=1e-5)
    args.update(kw)
    z = args.pop("noise_multiplier")
    with pytest.raises(ValueError, match=match):
        PrivacyAccountant(z, **args)
