"""RobustAggregator: a robust rule as the aggregation seam of the server optimizers,
against the float64 oracles of python_ref/robust.py (written from the papers).

The server steps are checked against an independent composition: an optimizer with
the robust aggregator must do exactly what the same optimizer does when handed the
robust aggregate (computed by the oracle, or separately by the op) as its one update.
"""

from __future__ import annotations

import pytest
import torch

import python_ref.robust as O
from fedopt_kernels.server import ASNES, FedAdagrad, FedAdam, FedAvg, FedAvgM, FedExP, FedYogi
from fedopt_kernels.server.robust_aggregation.robust import robust_aggregate
from fedopt_kernels.server.robust_aggregation.robust_aggregator import RobustAggregator

BACKENDS = ["reference", "cpu"]


def clients(C, N, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(C, N, generator=g, dtype=torch.float64)
    X = X * torch.logspace(-0.5, 0.5, C, dtype=torch.float64)[:, None]
    return X.to(dtype)


def params(N, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedavg_lr1_with_median_moves_params_by_exactly_minus_the_median(backend):
    """An odd number of kept clients: the median of each coordinate is one of the
    values, so the fp32 step ``x - 1 * med`` rounds once, as the float64 oracle does."""
    X = clients(6, 37)
    X[2, 5] = float("nan")  # left out: five clients remain
    x0 = params(37)
    x = x0.clone().requires_grad_(False)
    opt = FedAvg([x], lr=1.0, backend=backend, aggregator=RobustAggregator("median"))
    st = opt.step(X, weights=[1, 2, 3, 4, 5, 6])  # the median is unweighted: weights checked, not used
    med = O.coordinate_median(X)
    assert torch.equal(x, (x0.double() - med).float())
    assert st.excluded.tolist() == [False, False, True, False, False, False]
    assert st.num_clients.item() == 5 and not st.skipped
    torch.testing.assert_close(st.weights, torch.tensor([0.2, 0.2, 0, 0.2, 0.2, 0.2]))
    torch.testing.assert_close(st.update_sq_norm.double(), (med.float().double() ** 2).sum(), rtol=1e-6, atol=0)
    want_q = (X.double() ** 2).sum(1)
    torch.testing.assert_close(st.client_sq_norms[[0, 1, 3, 4, 5]].double(), want_q[[0, 1, 3, 4, 5]], rtol=1e-5,
                               atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedadam_with_krum_is_fedadam_applied_to_the_krum_aggregate(backend):
    X = clients(7, 53, seed=3)
    X[4] *= 40  # an outlier Krum must not pick
    x_a, x_b = params(53), params(53)
    a = FedAdam([x_a], lr=0.1, backend=backend, aggregator=RobustAggregator("krum", f=2))
    b = FedAdam([x_b], lr=0.1, backend=backend)
    for r in range(3):
        Xr = X + r * 0.01
        krum = robust_aggregate(Xr, "krum", f=2, backend=backend)
        want, chosen = O.multi_krum(Xr, 2, 1)
        assert krum.selected.nonzero().flatten().tolist() == list(chosen) and 4 not in chosen
        torch.testing.assert_close(krum.aggregate.double(), want, rtol=0, atol=0)  # one client: its values
        a.step(Xr)
        b.step(krum.aggregate[None])  # one client, weight 1: D is the Krum aggregate
        assert torch.equal(x_a, x_b)
    sa, sb = a.state_dict()["state"][0], b.state_dict()["state"][0]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("opt_cls", [FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad])
@pytest.mark.parametrize("rule, kw, oracle", [
    ("median", {}, lambda X, w: O.coordinate_median(X)),
    ("trimmed-mean", {"beta": 0.2}, lambda X, w: O.trimmed_mean(X, 0.2)),
    ("multi-krum", {"f": 1, "m": 3}, lambda X, w: O.multi_krum(X, 1, 3, weights=w)[0]),
    ("bulyan", {"f": 1}, lambda X, w: O.bulyan(X, 1)[0]),
    ("geomed", {"max_iter": 6}, lambda X, w: O.geometric_median(X, w, max_iter=6)[0]),
    ("centered-clip", {"tau": 1.0, "iterations": 2}, lambda X, w: O.centered_clip(X, 1.0, 2)),
    ("norm-bound", {"median_factor": 1.0}, lambda X, w: O.norm_bounded_mean(X, [v / sum(w) for v in w],
                                                                           median_factor=1.0)[0]),
])
def test_every_rule_in_every_server_optimizer_steps_on_the_oracle_aggregate(opt_cls, rule, kw, oracle):
    X = clients(7, 29, seed=5)
    w = [1.0, 2.0, 1.0, 3.0, 1.0, 2.0, 1.0]
    want = oracle(X, w).float()
    x_a, x_b = params(29), params(29)
    a = opt_cls([x_a], aggregator=RobustAggregator(rule, **kw), backend="cpu")
    b = opt_cls([x_b], backend="cpu")
    st = a.step(X, w)
    b.step(want[None])
    torch.testing.assert_close(x_a, x_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st.update_sq_norm.double(), (want.double() ** 2).sum(), rtol=1e-5, atol=1e-9)
    p = st.weights / st.weights.sum()
    assert abs(float(p.sum()) - 1) < 1e-6 and not st.skipped


def test_weighted_rules_use_the_weights_and_unweighted_ones_do_not():
    X = clients(5, 16, seed=7)
    w = [5.0, 1.0, 1.0, 1.0, 1.0]
    for rule, kw, uses in [("geomed", {}, True), ("median", {}, False), ("krum", {"f": 1}, False)]:
        outs = []
        for weights in (None, w):
            x = params(16)
            FedAvg([x], aggregator=RobustAggregator(rule, **kw)).step(X, weights)
            outs.append(x)
        assert (not torch.equal(*outs)) == uses, rule
    assert RobustAggregator("geomed").weighted and not RobustAggregator("median").weighted


def test_centered_clip_starts_from_the_previous_aggregate_and_its_state_round_trips():
    rounds = [clients(5, 23, seed=s) for s in range(4)]
    x, agg = params(23), RobustAggregator("centered-clip", tau=0.5, iterations=2)
    opt = FedAvg([x], aggregator=agg)
    ref = None
    for r in range(2):
        x_before = x.clone()
        opt.step(rounds[r])
        ref = O.centered_clip(rounds[r], 0.5, 2, reference=ref)
        torch.testing.assert_close((x_before - x).double(), ref, rtol=1e-5, atol=1e-6)
    state = agg.state_dict()
    torch.testing.assert_close(state["reference"].double(), ref, rtol=1e-5, atol=1e-6)
    x2 = x.clone()
    agg2 = RobustAggregator("centered-clip", tau=0.5, iterations=2)
    agg2.load_state_dict(state)
    opt2 = FedAvg([x2], aggregator=agg2)
    opt2.load_state_dict(opt.state_dict())
    for r in range(2, 4):
        opt.step(rounds[r])
        opt2.step(rounds[r])
        assert torch.equal(x, x2)
    assert agg2.rounds == agg.rounds == 4
    with pytest.raises(ValueError, match="saved by the rule 'centered-clip'"):
        RobustAggregator("median").load_state_dict(state)


def test_every_client_nonfinite_skips_the_round_and_keeps_the_bits():
    X = torch.full((4, 9), float("nan"))
    x0 = params(9)
    for rule, kw in [("median", {}), ("krum", {"f": 0}), ("geomed", {}), ("centered-clip", {"tau": 1.0})]:
        x = x0.clone()
        opt = FedAdam([x], aggregator=RobustAggregator(rule, **kw))
        st = opt.step(X)
        assert bool(st.skipped) and torch.equal(x, x0), rule


def test_krum_record_names_the_selected_clients():
    X = clients(6, 12, seed=9)
    X[1] *= 100
    agg = RobustAggregator("multi-krum", f=1, m=3)
    FedAvg([params(12)], aggregator=agg).step(X)
    _, chosen = O.multi_krum(X, 1, 3)
    ids = [10, 11, 12, 13, 14, 15]
    assert agg.record(ids) == {"robust_selected": [ids[i] for i in chosen], "robust_bound_met": True}
    assert RobustAggregator("median").record() == {}


@pytest.mark.parametrize("opt", [lambda x, a: FedExP([x], aggregator=a), lambda x, a: ASNES([x], aggregator=a),
                                 lambda x, a: FedAvg([x], max_client_norm=1.0, aggregator=a),
                                 lambda x, a: FedAvg([x], nonfinite="propagate", aggregator=a)])
def test_refused_settings_change_nothing(opt):
    x0 = params(8)
    x = x0.clone()
    o = opt(x, RobustAggregator("median"))
    with pytest.raises(ValueError, match="robust rule 'median'"):
        o.step(clients(3, 8))
    assert torch.equal(x, x0)


def test_mean_is_the_optimizers_own_weighted_mean_bit_for_bit():
    X, w = clients(5, 31), [1.0, 2.0, 3.0, 4.0, 5.0]
    for cls in (FedAvg, FedExP):  # the mean keeps every optimizer, FedExP's statistics included
        x_a, x_b = params(31), params(31)
        cls([x_a], aggregator=RobustAggregator("mean")).step(X, w)
        cls([x_b]).step(X, w)
        assert torch.equal(x_a, x_b)


@pytest.mark.parametrize("rule, kw, match", [
    ("nope", {}, "rule must be one of"),
    ("median", {"beta": 0.1}, "does not take beta"),
    ("krum", {}, "needs f"),
    ("krum", {"f": -1}, "f must be >= 0"),
    ("krum", {"f": 1.5}, "f must be an int"),
    ("trimmed-mean", {"beta": 0.5}, "beta"),
    ("centered-clip", {}, "needs tau"),
    ("norm-bound", {}, "exactly one of radius"),
    ("geomed", {"weights": [1.0]}, "weights come from each step"),
    ("centered-clip", {"tau": 1.0, "reference": torch.zeros(3)}, "does not take reference"),
])
def test_bad_parameters_are_refused_by_name(rule, kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        RobustAggregator(rule, **kw)


def test_krum_with_too_few_clients_is_refused_before_the_step():
    x0 = params(8)
    x = x0.clone()
    with pytest.raises(ValueError, match="Krum needs C >= 2 f \\+ 3"):
        FedAvg([x], aggregator=RobustAggregator("krum", f=2)).step(clients(6, 8))
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_half_and_double_parameters_step_by_the_median_exactly(dtype):
    """Five clients: each coordinate's median is a stored value, so from zero parameters
    FedAvg(lr=1) lands on minus it exactly, whatever the dtype (fp32 accumulation)."""
    X = clients(5, 41, seed=11, dtype=dtype)
    x = torch.zeros(41, dtype=dtype)
    FedAvg([x], aggregator=RobustAggregator("median")).step(X)
    assert torch.equal(x, (-O.coordinate_median(X)).to(dtype))


def test_a_list_of_rows_and_named_updates_aggregate_as_the_tensor():
    model = torch.nn.Linear(4, 3)
    names = [n for n, _ in model.named_parameters()]
    X = clients(5, 15, seed=12)
    outs = []
    for form in ("tensor", "list", "named"):
        m = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        opt = FedAvg(list(m.named_parameters()), aggregator=RobustAggregator("geomed"))
        if form == "tensor":
            opt.step(X)
        elif form == "list":
            opt.step(list(X))
        else:
            opt.step([{"weight": r[:12].view(3, 4), "bias": r[12:]} for r in X])
        outs.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert names == ["weight", "bias"]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(-outs[0].double(), O.geometric_median(X)[0], rtol=1e-5, atol=1e-6)
