"""The one server round (fedopt_kernels.server.round, issue 29 items 1 and 2): every
algorithm, FedLAW included, through ServerRound; the weights checked once where they
enter and only normalised below."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from _asserts import assert_bitwise
from _server_cases import one_per_class, params_of
from fedopt_kernels import server as S
from fedopt_kernels.server.aggregation import CheckedWeights, check_round_weights, normalize_weights

SIZES = torch.tensor([3.0, 1.0, 7.0, 5.0], dtype=torch.float64)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _updates(N, C=4, seed=1):
    return torch.randn(C, N, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.1


@pytest.mark.parametrize("case", params_of(one_per_class()))
@pytest.mark.parametrize("weighting", ["size", "uniform"])
def test_the_round_is_the_optimizers_step_and_reports_its_statistics(case, weighting):
    a, b = _net(), _net()
    opt_a, opt_b = case.make(a.parameters()), case.make(b.parameters())
    round_ = S.ServerRound(opt_a, weighting)
    assert round_.takes == "updates" and not opt_a.keeps_buffers
    N = opt_a.numel
    for r in range(3):
        U = _updates(N, seed=r)
        got = round_(S.RoundReplies(U.clone(), sizes=SIZES)).stats
        want = opt_b.step(U.clone(), SIZES if weighting == "size" else None)
        assert_bitwise(list(a.parameters()), list(b.parameters()), f"round {r} params")
        assert_bitwise(got.stats.weights, want.weights, f"round {r} weights")
        # the weights of the mean: sizes / sum (size) or 1/C (uniform), formed here in float64
        p = SIZES / SIZES.sum() if weighting == "size" else torch.full((4,), 0.25, dtype=torch.float64)
        torch.testing.assert_close(got.stats.weights, p, rtol=1e-15, atol=0)
        m = got.read()
        lr = opt_a.param_groups[0]["lr"]
        assert m["server_lr"] == float(want.lr_scale) * lr
        assert m["update_norm"] == math.sqrt(float(want.update_sq_norm))
        assert m["excluded_clients"] == 0 and m["server_skipped"] is False
        assert ("gain_ratio" in m) == isinstance(opt_a, S.ASNES)


def test_a_nan_client_is_reported_excluded_by_the_round():
    model = _net()
    opt = S.FedAvg(model.parameters())
    U = _updates(opt.numel)
    U[2, 0] = float("nan")
    st = S.ServerRound(opt, "size")(S.RoundReplies(U, sizes=SIZES)).stats
    assert st.excluded.tolist() == [False, False, True, False]
    assert st.read()["excluded_clients"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fedlaw_takes_the_models_through_the_same_round():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    g = torch.Generator().manual_seed(2)
    proxy = [(torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g))]
    law = S.FedLAW(model, proxy, nn.functional.cross_entropy, server_epochs=2)
    round_ = S.ServerRound(law, "size")
    assert round_.takes == "models" and law.keeps_buffers
    x = torch.cat([p.detach().flatten() for p in model.parameters()])
    models = x + _updates(x.numel())  # client models near the global one
    st = round_(S.RoundReplies(models, sizes=SIZES)).stats
    m = st.read()
    assert set(m) == {"gamma", "lambda", "proxy_loss", "excluded_clients", "server_skipped"}
    assert len(m["lambda"]) == 4 and math.isclose(sum(m["lambda"]), 1.0, rel_tol=1e-12)
    assert m["gamma"] > 0 and m["excluded_clients"] == 0 and m["server_skipped"] is False
    # the buffers are FedLAW's own: the round does not average the clients'
    assert round_.buffers(torch.zeros(4, 2), SIZES, torch.ones(2), None) is None


def test_the_round_refuses_an_object_that_is_no_server():
    with pytest.raises(TypeError, match="server must be a fedopt_kernels.server algorithm"):
        S.ServerRound(torch.optim.SGD(_net().parameters(), lr=0.1), "size")


# --------------------------------------------------------------------------- weights checked once
@pytest.mark.parametrize("bad, match", [
    ([1.0, float("nan"), 2.0], "weights must be finite"),
    ([1.0, -1.0, 2.0], "weights must be >= 0"),
    ([0.0, 0.0, 0.0], "weights must not all be zero"),
])
def test_round_weights_are_checked_where_they_enter(bad, match):
    with pytest.raises(ValueError, match=match):
        S.round_weights("size", torch.tensor(bad, dtype=torch.float64))


def test_a_ranks_share_may_be_all_zero_and_uniform_is_none():
    w = S.round_weights("size", torch.zeros(3), share=True)
    assert isinstance(w, CheckedWeights) and w.values.tolist() == [0.0, 0.0, 0.0]
    assert S.round_weights("uniform", SIZES) is None


def test_capped_round_weights_are_the_hand_computed_shares():
    # sizes 1, 1, 8 with a cap of 0.5: the large client holds 0.5, the others share the rest 1:1
    w = S.round_weights("size", torch.tensor([1.0, 1.0, 8.0]), 0.5)
    assert w.values.tolist() == [0.25, 0.25, 0.5]


@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
def test_checked_weights_are_normalised_to_the_bits_of_the_unchecked_path(acc):
    w = torch.tensor([3.0, 1e-3, 7.5, 2.0**40], dtype=torch.float64)
    p_raw, valid_raw = normalize_weights(w, 4, torch.device("cpu"), acc)
    p_chk, valid_chk = normalize_weights(check_round_weights(w), 4, torch.device("cpu"), acc)
    assert valid_raw is None and valid_chk is None
    assert_bitwise(p_chk, p_raw, "p")
    with pytest.raises(ValueError, match="weights has 4 entries but there are 3 clients"):
        normalize_weights(check_round_weights(w), 3, torch.device("cpu"), acc)


# --------------------------------------------------------------------------- the registry
def test_the_registry_builds_what_the_config_sets_over_the_class_defaults():
    from fedopt_kernels.fl import SimulationConfig

    algo = S.algorithm("fedexp")
    assert algo.cls is S.FedExP and algo.weighting == "uniform" and "Jhunjhunwala" in algo.source
    cfg = SimulationConfig(algo="fedexp", fedexp_eps=0.02, server_lr=0.5)
    assert algo.hyperparameters(cfg) == dict(lr=0.5, eps=0.02, scale_eps_by_clients=False)
    law = S.algorithm("fedlaw").hyperparameters(SimulationConfig(algo="fedlaw", fedlaw_epochs=3, server_lr=9.0))
    assert law["server_epochs"] == 3 and law["lr"] == 0.01  # fedlaw's lr is fedlaw_lr, not server_lr
    with pytest.raises(ValueError, match="unknown algorithm 'fedsgd'"):
        S.algorithm("fedsgd")


def test_the_kernel_gets_the_boundarys_normalised_weights_and_the_bound_factors_once(monkeypatch):
    """Through the round (what the simulator and the Flower strategies call): the sizes
    are checked and capped once where they enter, normalised once, and the aggregation
    kernel's first pass gets that very tensor; the norm-bound factors are computed once
    (by the op, handed to the step's statistics)."""
    import importlib

    # by module (``fedopt_kernels.ops.aggregate`` is also the name of the function)
    A, G, R = (importlib.import_module(f"fedopt_kernels.{m}") for m in ("ops.aggregate", "server.aggregation",
                                                                       "server.round"))

    calls = {}

    def spy(module, name):
        orig = getattr(module, name)

        def wrapped(*args, **kwargs):
            out = orig(*args, **kwargs)
            calls.setdefault(f"{module.__name__}.{name}", []).append(out)
            return out

        monkeypatch.setattr(module, name, wrapped)

    for module, name in [(R, "cap_weight_shares"), (G, "check_weight_values"), (A, "check_weight_values"),
                         (G, "normalize_weights"), (G, "_normalize_host"), (A, "norm_bound_factors"),
                         (G, "norm_bound_factors")]:
        spy(module, name)
    passes = []
    runner = A.aggregate_runner

    def spy_runner(backend, device):
        run = runner(backend, device)

        def recorded(rows, w, gamma, out, skip):
            passes.append(w)
            return run(rows, w, gamma, out, skip)

        return recorded

    monkeypatch.setattr(A, "aggregate_runner", spy_runner)

    model = _net()
    M = 0.15
    round_ = S.ServerRound(S.FedAvg(model.parameters(), max_client_norm=M), "size", 0.4)
    U = _updates(sum(p.numel() for p in model.parameters()))
    st = round_(S.RoundReplies(U.clone(), sizes=SIZES)).stats

    count = {k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1]: len(v) for k, v in calls.items()}
    # the values are read once, at the boundary: the op's own guard is skipped (weights_checked)
    assert count == {"round.cap_weight_shares": 1, "aggregation.check_weight_values": 1,
                     "aggregation.normalize_weights": 1, "aggregation._normalize_host": 1,
                     "aggregate.norm_bound_factors": 1}, count
    p = calls["fedopt_kernels.server.aggregation.normalize_weights"][0][0]
    assert passes[0] is p  # the kernel's weights are the boundary's tensor, not a copy or a rescaled one
    # sizes 3:1:7:5 capped at 0.4 by hand: 7/16 > 0.4 -> 0.4, the rest 0.6 split 3:1:5
    shares = torch.tensor([0.6 * 3 / 9, 0.6 / 9, 0.4, 0.6 * 5 / 9], dtype=torch.float64)
    torch.testing.assert_close(p, shares, rtol=1e-15, atol=0)
    # the second pass: each share times min(1, M / (||D_i|| + 1e-6)), float64 by hand
    bound = torch.clamp(M / (U.norm(dim=1) + 1e-6), max=1.0)
    assert (bound < 1).sum() >= 2  # the bound acts
    torch.testing.assert_close(passes[1], shares * bound, rtol=1e-14, atol=0)
    torch.testing.assert_close(st.stats.weights, shares * bound, rtol=1e-14, atol=0)


# --------------------------------------------------------------------------- the whole round (issue 46 item 1)
def test_the_record_counts_exclusions_by_reason_in_the_rounds_order():
    """Screened replies (no row) and the step's NaN/Inf rows, counted per reason (zeros
    included) and listed in the round's order; one host read of the metrics."""
    model = _net()
    U = _updates(S.FedAvg(model.parameters()).numel)
    U[1, 2] = float("inf")
    round_ = S.ServerRound(S.FedAvg(model.parameters()), "size")
    out = round_(S.RoundReplies(U, sizes=SIZES, clients=[10, 11, 13, 14], left_out=[(12, "error", "boom")],
                                reasons=("no_data", "error", "nonfinite"), order=[10, 11, 12, 13, 14]))
    rec = out.record()
    assert rec["excluded_clients"] == 2 and rec["excluded_error"] == 1 and rec["excluded_nonfinite"] == 1
    assert rec["excluded_no_data"] == 0 and rec["server_skipped"] is False
    assert [(c, r) for c, r, _ in out.left_out] == [(11, "nonfinite"), (12, "error")]
    # no client left: nothing applied, the per-client state forgets the round
    x = torch.cat([p.detach().flatten() for p in model.parameters()])
    calls = []

    class State:
        def commit(self, replies, excluded):  # pragma: no cover - not reached
            calls.append("commit")

        def discard(self):
            calls.append("discard")

    empty = S.ServerRound(S.FedAvg(model.parameters()), "size", client_state=State())
    rec = empty(S.RoundReplies(None, left_out=[(3, "error", "x")], reasons=("error", "nonfinite"))).record()
    assert rec == {"server_skipped": True, "excluded_clients": 1, "excluded_error": 1, "excluded_nonfinite": 0}
    assert calls == ["discard"]
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), x)


def test_scaffold_control_through_the_round_is_option_ii_by_hand():
    """The client-state rule after the step, without the client the step excluded:
    ``c + (1/M) sum_{i kept} (D_i / lr_sum_i - c)`` in float64."""
    model = _net()
    opt = S.FedAvg(model.parameters())
    U = _updates(opt.numel)
    U[2, 0] = float("nan")
    control = S.ScaffoldControl(torch.zeros(opt.numel, dtype=torch.float64))
    control.c.copy_(torch.linspace(-0.1, 0.1, opt.numel, dtype=torch.float64))
    c0 = control.c.clone()
    lr_sums, M = [0.5, 1.0, 2.0, 0.25], 10
    round_ = S.ServerRound(opt, "uniform", client_state=control)
    round_(S.RoundReplies(U, client_state=S.ScaffoldReplies(U, lr_sums, M)))
    want = c0 + sum(U[i] / lr_sums[i] - c0 for i in (0, 1, 3)) / M
    torch.testing.assert_close(control.c, want, rtol=1e-13, atol=1e-15)


def test_the_decoding_slot_runs_before_the_aggregation():
    """A decoder (``results -> results``: where compressed replies become updates) is
    applied before the step: halved rows doubled give the plain round's bits."""
    a, b = _net(), _net()
    U = _updates(S.FedAvg(a.parameters()).numel)
    plain = S.ServerRound(S.FedAvg(a.parameters(), lr=0.7), "size")
    coded = S.ServerRound(S.FedAvg(b.parameters(), lr=0.7), "size", decoder=lambda r: r * 2)
    plain(S.RoundReplies(U.clone(), sizes=SIZES))
    coded(S.RoundReplies(U / 2, sizes=SIZES))
    assert_bitwise(list(a.parameters()), list(b.parameters()), "decoded round")
    with pytest.raises(TypeError, match="decoder must be callable"):
        S.ServerRound(S.FedAvg(a.parameters()), "size", decoder="zstd")


def test_components_are_refused_where_they_cannot_serve():
    model = _net()
    priv = S.RoundPrivacy(clip=1.0, clients=4, per_round=4)
    with pytest.raises(ValueError, match="do not compose"):
        S.ServerRound(S.FedAvg(model.parameters()), "uniform", aggregator=S.RobustAggregator("median"), privacy=priv)
    with pytest.raises(ValueError, match="step size"):
        S.ServerRound(S.FedExP(model.parameters()), "uniform", aggregator=S.RobustAggregator("median"))
    law = S.FedLAW(nn.Linear(4, 3).double(), [], nn.functional.cross_entropy)
    with pytest.raises(ValueError, match="privacy needs a server optimizer"):
        S.ServerRound(law, "size", privacy=priv)
    with pytest.raises(TypeError, match="a round takes RoundReplies"):
        S.ServerRound(S.FedAvg(model.parameters()), "size")(_updates(3))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_ops_weight_guard_stays_for_direct_users_and_weights_checked_skips_only_the_values(backend):
    """``ops.aggregate_bounded`` still refuses bad host weights by itself (a direct user
    of the op, nothing written); ``weights_checked=True`` (the server's promise) reads no
    value again but still checks the form, and changes no bit."""
    from fedopt_kernels.ops.aggregate import aggregate_bounded

    U = _updates(7, C=3).float()
    w = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float32)
    for bad, why in [([1.0, -1.0, 1.0], "negative"), ([1.0, float("nan"), 1.0], "finite"), ([0.0, 0.0, 0.0], "zero")]:
        out = torch.full((7,), 9.0)
        with pytest.raises(ValueError, match="weights"):
            aggregate_bounded(U, torch.tensor(bad), out=out, backend=backend)
        assert (out == 9.0).all(), why  # nothing written
    with pytest.raises(ValueError, match="weights"):  # the form is still checked
        aggregate_bounded(U, w[:2], weights_checked=True, backend=backend)
    a, sa, _ = aggregate_bounded(U, w, max_client_norm=0.1, backend=backend)
    b, sb, _ = aggregate_bounded(U, w, max_client_norm=0.1, backend=backend, weights_checked=True)
    assert_bitwise([a, sa.weights, sa.sq_norm], [b, sb.weights, sb.sq_norm], "weights_checked")
    bound = torch.clamp(0.1 / (U.double().norm(dim=1) + 1e-6), max=1.0)  # float64 by hand
    assert (bound < 1).all()
    torch.testing.assert_close(a.double(), ((w.double() * bound)[:, None] * U.double()).sum(0), rtol=1e-5, atol=1e-7)
