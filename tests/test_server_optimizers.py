"""Server optimizers (fedopt_kernels.server) against the plain-PyTorch oracles."""

import copy
import io

import pytest
import torch
from torch import nn

import python_ref.asnes as R_asnes
import python_ref.fedexp as R_fedexp
import python_ref.server_optimizers as R
from _server_cases import CASES  # the one table of server-optimizer cases
from fedopt_kernels.server import ASNES, FedAdagrad, FedAdam, FedAvg, FedAvgM, FedExP, FedYogi
from fedopt_kernels.utils import module_to_vector, vector_to_module


def on(device, updates):
    """A round's updates on ``device`` (a [C, N] tensor or a list of vectors)."""
    if isinstance(updates, torch.Tensor):
        return updates.to(device)
    return [u.to(device) for u in updates]


class Oracle:
    """The python_ref formula of a case on one flat vector, with its own state."""

    def __init__(self, name, kw, x):
        self.name, self.kw, self.x = name.split("-")[0], dict(kw), x.clone()
        self.state = {}
        if self.name == "ASNES":
            self.asnes = R_asnes.ASNESReference(x, **kw)

    def step(self, updates, p):
        n, kw, x = self.name, self.kw, self.x
        if n == "ASNES":
            self.asnes.step(updates, p)
            self.x = self.asnes.x
            return self.x
        D = R.mean_update(updates, p)
        if n == "FedAvg":
            self.x = R.fedavg(x, D, **kw)
        elif n == "FedAvgM":
            b = self.state.get("b", torch.zeros_like(x))
            self.x, self.state["b"] = R.fedavgm(x, D, b, **kw)
        elif n in ("FedAdam", "FedYogi", "FedAdagrad"):
            m, v = self.state.get("mv", R.init_adaptive_state(x, kw["tau"]))
            fn = {"FedAdam": R.fedadam, "FedYogi": R.fedyogi, "FedAdagrad": R.fedadagrad}[n]
            self.x, m, v = fn(x, D, m, v, **kw)
            self.state["mv"] = (m, v)
        elif n == "FedExP":
            self.x, _ = R_fedexp.fedexp(x, updates, p, **kw)
        return self.x


def make_model(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)


N_PARAMS = 5 * 4 + 4 + 4 * 3 + 3  # make_model()'s parameter count


def make_rounds(N, dtype=torch.float64, rounds=6, seed=1):
    """Random updates with a varying number of clients and data-size weights.  Even
    rounds pass a [C, N] tensor and a list of ints, odd rounds a list of vectors and a
    float tensor."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rounds):
        C = 3 + r % 4
        common = torch.randn(N, generator=g, dtype=dtype) * 0.3
        U = common + torch.randn(C, N, generator=g, dtype=dtype) * (0.1 + 0.2 * r)
        sizes = torch.randint(10, 200, (C,), generator=g)
        if r % 2 == 0:
            out.append((U.contiguous(), sizes.tolist()))
        else:
            out.append(([u.clone() for u in U.unbind(0)], sizes.to(dtype)))
    return out


def rows_of(updates):
    return list(updates.unbind(0)) if isinstance(updates, torch.Tensor) else list(updates)


def norm_p(weights, C, dtype):
    return R.normalized_weights(None if weights is None else torch.as_tensor(weights, dtype=torch.float64), C,
                                dtype=dtype)


def snapshot(model, opt):
    return module_to_vector(model).clone(), copy.deepcopy(opt.state_dict()["state"])


def assert_same(a, b):
    va, sa = a
    vb, sb = b
    assert torch.equal(va, vb)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for kk in sa[k]:
            assert torch.equal(sa[k][kk], sb[k][kk]), (k, kk)


# --------------------------------------------------------------------------- oracle
@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle_over_rounds_float64(name, backend):
    backend, device = backend
    cls, kw = CASES[name].cls, CASES[name].hyper
    model = make_model()
    oracle = Oracle(name, kw, module_to_vector(model))
    model.to(device)
    opt = cls(model.parameters(), backend=backend, **kw)
    for updates, weights in make_rounds(opt.numel):
        rows = rows_of(updates)
        stats = opt.step(on(device, updates), weights)
        expected = oracle.step(rows, norm_p(weights, len(rows), torch.float64))
        torch.testing.assert_close(module_to_vector(model).cpu(), expected, rtol=1e-10, atol=1e-12)
        assert not stats.skipped
        assert stats.num_clients.item() == len(rows)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle_float32(name, backend):
    """fp32, the dtype a GPU server runs in: every backend (CUDA and compiled Triton on a
    GPU machine) against the oracle in fp32.  Tensor weights go to the model's device
    (read there without a sync), list weights stay on the host."""
    backend, device = backend
    cls, kw = CASES[name].cls, CASES[name].hyper
    model = make_model(torch.float32)
    oracle = Oracle(name, kw, module_to_vector(model))
    model.to(device)
    opt = cls(model.parameters(), backend=backend, **kw)
    for updates, weights in make_rounds(opt.numel, dtype=torch.float32):
        rows = rows_of(updates)
        w = weights.to(device) if isinstance(weights, torch.Tensor) else weights
        opt.step(on(device, updates), w)
        expected = oracle.step(rows, norm_p(weights, len(rows), torch.float32))
        torch.testing.assert_close(module_to_vector(model).cpu(), expected, rtol=2e-5, atol=2e-6)


def test_param_groups_have_their_own_hyperparameters():
    model = make_model()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt = FedAdam([{"params": first, "lr": 0.1}, {"params": second, "tau": 0.05}], lr=0.02, betas=(0.8, 0.9))
    n1 = sum(p.numel() for p in first)
    x = module_to_vector(model)
    o1 = Oracle("FedAdam", dict(lr=0.1, betas=(0.8, 0.9), tau=1e-3), x[:n1])
    o2 = Oracle("FedAdam", dict(lr=0.02, betas=(0.8, 0.9), tau=0.05), x[n1:])
    for updates, weights in make_rounds(opt.numel, rounds=4):
        rows = rows_of(updates)
        p = norm_p(weights, len(rows), torch.float64)
        opt.step(updates, weights)
        e1 = o1.step([r[:n1] for r in rows], p)
        e2 = o2.step([r[n1:] for r in rows], p)
        torch.testing.assert_close(module_to_vector(model), torch.cat([e1, e2]), rtol=1e-10, atol=1e-12)


def test_lr_scheduler_drives_the_server_lr():
    model = make_model()
    opt = FedAvg(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = module_to_vector(model)
    U = torch.ones(2, opt.numel, dtype=torch.float64)
    opt.step(U)
    sched.step()
    opt.step(U)
    torch.testing.assert_close(module_to_vector(model), x - 1.5)


def test_stats_are_the_round_statistics():
    model = make_model()
    opt = FedAvg(model.parameters())
    updates, _ = make_rounds(opt.numel, rounds=1)[0]
    w = torch.tensor([1.0, 3.0, 4.0], dtype=torch.float64)
    stats = opt.step(updates, w)
    p = w / w.sum()
    D = (p[:, None] * updates).sum(0)
    torch.testing.assert_close(stats.client_sq_norms, (updates * updates).sum(1))
    torch.testing.assert_close(stats.update_sq_norm, torch.dot(D, D))
    torch.testing.assert_close(stats.weights, p)
    torch.testing.assert_close(stats.mean_client_sq_norm, (p * (updates * updates).sum(1)).sum())
    assert stats.lr_scale.item() == 1.0 and stats.num_clients.item() == 3
    assert stats.excluded.tolist() == [False] * 3 and not stats.skipped


@pytest.mark.parametrize("name", ["FedAvgM", "FedAdam", "FedExP", "ASNES"])
def test_channels_last_params_step_like_contiguous_ones(name):
    """The fused step pairs elements by memory position and ``D`` is in logical order:
    a channels_last conv weight (stepped on contiguous copies) must end exactly where
    the same weight stored contiguously does, and keep its memory format."""
    cls, kw = CASES[name].cls, CASES[name].hyper
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).double()
    last = copy.deepcopy(conv).to(memory_format=torch.channels_last)
    assert not last.weight.is_contiguous()
    N = sum(p.numel() for p in conv.parameters())
    opt_c, opt_l = cls(conv.parameters(), **kw), cls(last.parameters(), **kw)
    for updates, weights in make_rounds(N, rounds=3):
        opt_c.step(updates, weights)
        opt_l.step(updates, weights)
    assert last.weight.is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(conv.parameters(), last.parameters()):
        assert torch.equal(a, b)
    for p_c, p_l in zip(conv.parameters(), last.parameters()):
        for key, value in opt_c.state[p_c].items():
            assert torch.equal(value, opt_l.state[p_l][key]), key


# --------------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_restore_continues_bitwise(name):
    cls, kw = CASES[name].cls, CASES[name].hyper
    rounds = make_rounds(N_PARAMS, rounds=6)
    model = make_model()
    opt = cls(model.parameters(), **kw)
    for updates, weights in rounds[:3]:
        opt.step(updates, weights)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "x": module_to_vector(model)}, buf)
    buf.seek(0)
    saved = torch.load(buf)

    restored_model = make_model(seed=123)  # other initial values: all must come from the checkpoint
    vector_to_module(saved["x"], restored_model)
    restored = cls(restored_model.parameters(), lr=0.123)  # other hyperparameters too
    restored.load_state_dict(saved["opt"])
    assert restored.param_groups[0]["lr"] == kw.get("lr", restored.param_groups[0]["lr"])
    for updates, weights in rounds[3:]:
        s1 = opt.step(updates, weights)
        s2 = restored.step(updates, weights)
        assert torch.equal(s1.lr_scale, s2.lr_scale)
    assert_same(snapshot(model, opt), snapshot(restored_model, restored))


# --------------------------------------------------------------------------- robustness
@pytest.mark.parametrize("name", list(CASES))
def test_nonfinite_client_is_excluded(name, backend):
    backend, device = backend
    cls, kw = CASES[name].cls, CASES[name].hyper
    kw = dict(kw, backend=backend)
    model, ref_model = make_model().to(device), make_model().to(device)
    opt = cls(model.parameters(), **kw)
    ref_opt = cls(ref_model.parameters(), **kw)
    for r, (updates, weights) in enumerate(make_rounds(opt.numel, rounds=4)):
        rows = [u.clone().to(device) for u in rows_of(updates)]
        w = torch.as_tensor(weights, dtype=torch.float64)
        bad = [1] if r % 2 else [0, len(rows) - 1]
        for i in bad:
            rows[i][r] = float("nan") if i % 2 else float("inf")
        stats = opt.step(rows, w)
        good = [i for i in range(len(rows)) if i not in bad]
        ref_opt.step([rows[i] for i in good], w[good])  # the finite clients, renormalised
        assert stats.excluded.tolist() == [i in bad for i in range(len(rows))]
        assert not stats.skipped and stats.num_clients.item() == len(good)
        assert stats.weights[bad].eq(0).all()
        torch.testing.assert_close(stats.weights.sum().cpu(), torch.tensor(1.0, dtype=torch.float64))
        x = module_to_vector(model)
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, module_to_vector(ref_model), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(CASES))
def test_all_clients_nonfinite_skips_the_round(name, backend):
    backend, device = backend
    cls, kw = CASES[name].cls, CASES[name].hyper
    kw = dict(kw, backend=backend)
    rounds = [(on(device, u), w) for u, w in make_rounds(N_PARAMS, rounds=4)]
    model, ref_model = make_model().to(device), make_model().to(device)
    opt = cls(model.parameters(), **kw)
    ref_opt = cls(ref_model.parameters(), **kw)
    for updates, weights in rounds[:2]:
        opt.step(updates, weights)
        ref_opt.step(updates, weights)
    before = snapshot(model, opt)
    bad = torch.randn(3, opt.numel, dtype=torch.float64).to(device)
    bad[0, 0], bad[1, 5], bad[2, 7] = float("nan"), float("inf"), float("-inf")
    stats = opt.step(bad)
    assert bool(stats.skipped) and stats.excluded.all()
    assert stats.lr_scale.isfinite()
    assert_same(snapshot(model, opt), before)  # params AND state: exact bits
    # The skipped round leaves no trace: continuing equals never having seen it.
    for updates, weights in rounds[2:]:
        opt.step(updates, weights)
        ref_opt.step(updates, weights)
    assert_same(snapshot(model, opt), snapshot(ref_model, ref_opt))


def test_propagate_lets_nan_through():
    model = make_model()
    opt = FedAvg(model.parameters(), nonfinite="propagate")
    U = torch.zeros(2, opt.numel, dtype=torch.float64)
    U[1, 3] = float("nan")
    stats = opt.step(U)
    assert not stats.excluded.any() and not stats.skipped
    assert torch.isnan(module_to_vector(model)[3])


def test_norm_bounding_hand_computed():
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0]]))
    opt = FedAvg(model.parameters(), max_client_norm=2.5)
    U = torch.tensor([[3.0, 4.0], [0.0, 1.0]], dtype=torch.float64)  # norms 5 and 1
    stats = opt.step(U)
    s = 2.5 / (5.0 + 1e-6)  # client 0 scaled down to norm 2.5; client 1 is within the bound
    D = 0.5 * (s * U[0] + U[1])
    torch.testing.assert_close(model.weight.detach()[0], torch.tensor([1.0, 1.0], dtype=torch.float64) - D)
    torch.testing.assert_close(stats.weights, torch.tensor([0.5 * s, 0.5], dtype=torch.float64))
    torch.testing.assert_close(stats.update_sq_norm, torch.dot(D, D))
    torch.testing.assert_close(stats.client_sq_norms, torch.tensor([25.0, 1.0], dtype=torch.float64))
    # The bounded norms feed FedExP's step size: sum_i p_i ||s_i D_i||^2.
    torch.testing.assert_close(stats.mean_client_sq_norm, torch.tensor(0.5 * (s * s * 25 + 1), dtype=torch.float64))


def test_fedexp_step_size_hand_computed():
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.zero_()
    U = torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    # D = (2/3, 2/3), ||D||^2 = 8/9, mean ||D_i||^2 = 8/3: eta_g = (8/3) / (2 * 8/9) = 1.5.
    opt = FedExP(model.parameters(), eps=0.0)
    stats = opt.step(U)
    assert stats.lr_scale.item() == pytest.approx(1.5, rel=1e-14)
    torch.testing.assert_close(model.weight.detach()[0], torch.tensor([-1.0, -1.0], dtype=torch.float64))
    # eps in the paper's form, then the released code's M * eps.
    opt = FedExP(model.parameters(), eps=0.1)
    assert opt.step(U).lr_scale.item() == pytest.approx((8 / 3) / (2 * (8 / 9 + 0.1)), rel=1e-14)
    opt = FedExP(model.parameters(), eps=0.1, scale_eps_by_clients=True)
    assert opt.step(U).lr_scale.item() == pytest.approx((8 / 3) / (2 * (8 / 9 + 3 * 0.1)), rel=1e-14)
    # Identical updates: ratio 1/2 < 1, so eta_g = 1 (FedAvg).
    assert opt.step(torch.ones(4, 2, dtype=torch.float64)).lr_scale.item() == 1.0
    # eps = 0 and D = 0: the 0/0 ratio gives eta_g = 1, and the model does not move.
    opt = FedExP(model.parameters(), eps=0.0)
    before = model.weight.detach().clone()
    stats = opt.step(torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64))
    assert stats.lr_scale.item() == 1.0 and torch.equal(model.weight.detach(), before)


# --------------------------------------------------------------------------- bad input
def _bad_steps(N):
    good = torch.randn(3, N, dtype=torch.float64)
    return [
        (dict(updates=good, weights=[1.0, 2.0]), ValueError, r"weights has 2 entries but there are 3 clients"),
        (dict(updates=good, weights=torch.ones(4, dtype=torch.float64)), ValueError, r"weights has shape \(4,\)"),
        (dict(updates=good, weights=[1.0, -1.0, 2.0]), ValueError, r"weights must be >= 0"),
        (dict(updates=good, weights=[1.0, float("nan"), 2.0]), ValueError, r"weights must be finite"),
        (dict(updates=good, weights=[1.0, float("inf"), 2.0]), ValueError, r"weights must be finite"),
        (dict(updates=good, weights=torch.zeros(3)), ValueError, r"weights must not all be zero"),
        (dict(updates=good, weights=["a", "b", "c"]), TypeError, r"weights must be"),
        (dict(updates=good, weights=torch.ones(3, dtype=torch.bool)), TypeError, r"weights must be real"),
        (dict(updates=good[:, :-1].contiguous()), ValueError,
         rf"updates has length {N - 1} per client but the model has {N}"),
        (dict(updates=[good[0], good[1][:-2]]), ValueError, r"updates\[1\] has length"),
        (dict(updates=good.float()), ValueError, r"updates has dtype torch.float32 but the parameters"),
        (dict(updates=[good[0], good[1].float()]), ValueError, r"updates\[1\] has dtype"),
        (dict(updates=torch.empty(3, N, dtype=torch.float64, device="meta")), ValueError, r"updates is on meta"),
        (dict(updates=good[0]), ValueError, r"updates as a tensor must be 2-D"),
        (dict(updates=good.t().contiguous().t()), ValueError, r"updates must be contiguous"),
        (dict(updates=torch.empty(0, N, dtype=torch.float64)), ValueError, r"at least one client"),
        (dict(updates=[]), ValueError, r"at least one client"),
        (dict(updates=[good[0], "x"]), TypeError, r"updates\[1\] must be a torch.Tensor"),
        (dict(updates={"a": good}), TypeError, r"updates must be a \[C, N\] tensor or a list"),
    ]


@pytest.mark.parametrize("name", ["FedAvg", "FedAdam", "ASNES-smoothed", "FedExP"])
def test_bad_step_input_is_rejected_and_changes_nothing(name):
    cls, kw = CASES[name].cls, CASES[name].hyper
    model = make_model()
    opt = cls(model.parameters(), **kw)
    opt.step(*make_rounds(opt.numel, rounds=1)[0])  # some state to protect
    before = snapshot(model, opt)
    for args, exc, match in _bad_steps(opt.numel):
        with pytest.raises(exc, match=match):
            opt.step(**args)
        assert_same(snapshot(model, opt), before)


@pytest.mark.parametrize("ctor, exc, match", [
    (lambda p: FedAvg(p, gamma=0.0), ValueError, "gamma must satisfy gamma > 0"),
    (lambda p: FedAvg(p, gamma=-0.5), ValueError, "gamma"),
    (lambda p: FedAvg(p, lr=-1.0), ValueError, "lr must satisfy lr >= 0"),
    (lambda p: FedAvg(p, lr=float("nan")), ValueError, "lr"),
    (lambda p: FedAvgM(p, momentum=1.0), ValueError, "momentum"),
    (lambda p: FedAdam(p, betas=(0.9, 1.0)), ValueError, r"betas\[1\]"),
    (lambda p: FedYogi(p, betas=(-0.1, 0.9)), ValueError, r"betas\[0\]"),
    (lambda p: FedAdagrad(p, tau=0.0), ValueError, "tau must satisfy tau > 0"),
    (lambda p: FedExP(p, eps=-1e-3), ValueError, "eps"),
    (lambda p: ASNES(p, smoothing=1.0), ValueError, "smoothing"),
    (lambda p: FedAvg(p, nonfinite="drop"), ValueError, "nonfinite must be one of"),
    (lambda p: FedAvg(p, max_client_norm=0.0), ValueError, "max_client_norm"),
    (lambda p: FedAvg(p, backend="tpu"), ValueError, "backend must be one of"),
    (lambda p: FedAvg(p, lr="1"), TypeError, "lr must be a real number"),
])
def test_bad_hyperparameters(ctor, exc, match):
    with pytest.raises(exc, match=match):
        ctor(make_model().parameters())


def test_parameters_must_share_dtype_and_be_floating():
    model = make_model()
    model[2].float()
    with pytest.raises(ValueError, match="one dtype"):
        FedAvg(model.parameters())
    opt = FedAvg(make_model().parameters())
    with pytest.raises(ValueError, match="one dtype"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert len(opt.param_groups) == 1  # the rejected group is not kept


def test_weight_forms_are_equivalent():
    import numpy as np

    U = torch.randn(3, N_PARAMS, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    results = []
    for w in ([2, 1, 1], np.array([2.0, 1.0, 1.0]), torch.tensor([2, 1, 1]), torch.tensor([0.5, 0.25, 0.25]),
              [1e308, 5e307, 5e307]):
        model = make_model()
        FedAvg(model.parameters()).step(U, w)
        results.append(module_to_vector(model))
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], rtol=1e-15, atol=0)
    model = make_model()
    FedAvg(model.parameters()).step(U)  # None: uniform
    torch.testing.assert_close(module_to_vector(model), module_to_vector(make_model()) - U.mean(0))
