"""SecureSumAggregator: a server step on a mean that was summed securely elsewhere.

Oracle: the same step with the clients' updates in hand (LocalAggregator).  Given the
mean that aggregation computes and sum_i p_i ||D_i||^2, the secure step must move the
model to the same place (||D||^2 is recomputed from the mean, so FedExP/ASNES may differ
by the rounding of that one reduction)."""

import pytest
import torch

from fedopt_kernels import server as srv
from fedopt_kernels.ops import aggregate


def _params(seed=0, n=37):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)), torch.nn.Parameter(torch.randn(3, 5, generator=g))]


@pytest.mark.parametrize("algo", ["FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedExP", "ASNES"])
def test_the_step_on_a_secure_mean_is_the_step_on_the_updates(algo):
    g = torch.Generator().manual_seed(1)
    U = torch.randn(4, 52, generator=g) * 0.1
    w = [3.0, 1.0, 2.0, 5.0]
    p = torch.tensor(w, dtype=torch.float64) / sum(w)
    mean, stats = aggregate(U, p.float())
    msq = (p * U.double().square().sum(1)).sum()
    a, b = _params(), _params()
    oa, ob = getattr(srv, algo)(a), getattr(srv, algo)(b)
    for _ in range(2):  # a second round: the state (momenta) carries over alike
        oa.step(U, w)
        ob.step(None, w, aggregator=srv.SecureSumAggregator(mean, mean_client_sq_norm=msq))
    for x, y in zip(a, b):
        if algo in ("FedExP", "ASNES"):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(x, y)


def test_fedexp_without_the_secure_norm_sum_is_refused_and_nothing_moves():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = srv.FedExP(params)
    with pytest.raises(ValueError, match="mean_client_sq_norm"):
        opt.step(None, [1.0, 1.0], aggregator=srv.SecureSumAggregator(torch.zeros(52)))
    assert all(torch.equal(x, y) for x, y in zip(params, before))


def test_a_nonfinite_secure_mean_skips_the_round_and_keeps_the_bits():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = srv.FedAdam(params)
    mean = torch.zeros(52)
    mean[7] = float("nan")
    st = opt.step(None, [1.0, 1.0, 1.0], aggregator=srv.SecureSumAggregator(mean))
    assert bool(st.skipped)
    assert all(torch.equal(x, y) for x, y in zip(params, before))
    assert torch.isnan(st.client_sq_norms).all() and not st.excluded.any()  # unknown per client, never guessed


@pytest.mark.parametrize("mean, updates, msg", [
    (torch.zeros(51), None, "51 elements but the model has 52"),
    (torch.zeros(52), torch.zeros(2, 52), "holds no client's update"),
    (torch.zeros(52, dtype=torch.int64), None, "floating point"),
])
def test_bad_inputs_name_what_was_expected(mean, updates, msg):
    params = _params()
    with pytest.raises((ValueError, TypeError), match=msg):
        srv.FedAvg(params).step(updates, [1.0, 1.0], aggregator=srv.SecureSumAggregator(mean))
