"""The robust aggregators (ops.robust_aggregate) on every backend against the float64
oracles of python_ref/robust.py, written from the papers' definitions: odd sizes,
empty N, ties, C = 1 and 2, NaN/Inf clients, f at its limit, fp32/fp16/bf16/fp64, and
bad parameters refused by name before anything is written.

Tolerances: the oracle runs in float64 on the values as stored; a backend sorts and
sums at most C values per coordinate in the acc dtype and rounds once to the output
dtype, so ``|got - want| <= C u_acc max_i |x_i| + 2 u_out |want|`` per coordinate
(the Gram-based rules: their weighted mean is ``aggregate``'s, the same bound with
``sum_i |c_i x_i|``).
"""

from __future__ import annotations

import pytest
import torch

import python_ref.robust as O
from fedopt_kernels import backends
from fedopt_kernels.ops import robust_aggregate as R
from fedopt_kernels.server.robust_aggregation.robust import RULES, robust_aggregate

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def small(name):
    """Triton runs in its (slow) interpreter on CPU tensors."""
    return name == "triton" and backends.triton_interpret_mode()


def clients(C, N, dtype, device, seed=0, scale_spread=True):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(C, N, generator=g, dtype=torch.float64)
    if scale_spread and C > 1:
        X = X * torch.logspace(-0.5, 0.5, C, dtype=torch.float64)[:, None]
    return X.to(dtype).to(device)


def assert_coordinate_close(got, want, X, kept, dtype):
    u_acc = torch.finfo(acc_of(dtype)).eps / 2
    u_out = torch.finfo(dtype).eps / 2
    Xk = X.double().cpu()[kept.cpu()] if kept.any() else torch.zeros(1, X.shape[1], dtype=torch.float64)
    mass = Xk.abs().max(dim=0).values if Xk.shape[1] else torch.zeros(0, dtype=torch.float64)
    bound = X.shape[0] * u_acc * mass + 2 * u_out * want.abs() + torch.finfo(dtype).tiny
    excess = (got.double().cpu() - want).abs() - bound
    assert excess.numel() == 0 or float(excess.max()) <= 0, (
        f"{int((excess > 0).sum())} of {excess.numel()} outside the bound; worst at {int(excess.argmax())}: "
        f"got {float(got.double().cpu()[excess.argmax()])}, want {float(want[excess.argmax()])}")


def assert_mean_close(got, want, X, coef, dtype):
    u_acc = torch.finfo(acc_of(dtype)).eps / 2
    u_out = torch.finfo(dtype).eps / 2
    C = X.shape[0]
    # coefficients come from float64 [C, C] math; 1e-9 relative covers their rounding
    mass = (coef.double().cpu().abs()[:, None] * torch.nan_to_num(X.double().cpu(), 0, 0, 0).abs()).sum(dim=0)
    bound = (C * u_acc + 1e-9) * mass + 2 * u_out * want.abs() + torch.finfo(dtype).tiny
    excess = (got.double().cpu() - want).abs() - bound
    assert excess.numel() == 0 or float(excess.max()) <= 0, (
        f"worst at {int(excess.argmax())}: got {float(got.double().cpu()[excess.argmax()])}, "
        f"want {float(want[excess.argmax()])}")


# ---------------------------------------------------------------- median, trimmed mean

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 2, 3, 20])
def test_median_and_trimmed_mean_match_the_oracle(backend, dtype, C):
    name, device = backend
    for N in ([0, 37, 301] if small(name) else [0, 1, 37, 4099, 9001]):
        X = clients(C, N, dtype, device, seed=C + N)
        kept = torch.ones(C, dtype=torch.bool)
        out, st = R.coordinate_median(X, backend=name)
        assert out.dtype == dtype and out.shape == (N,)
        assert_coordinate_close(out, O.coordinate_median(X.cpu()), X, kept, dtype)
        assert not st.excluded.any() and st.selected.all() and bool(st.bound_met)
        for beta in ((0.0, 0.25) if small(name) else (0.0, 0.1, 0.25, 0.45)):
            out, _ = R.trimmed_mean(X, beta, backend=name)
            assert_coordinate_close(out, O.trimmed_mean(X.cpu(), beta), X, kept, dtype)


def test_trimmed_mean_trims_floor_beta_m_from_each_end(backend):
    """A hand-computed column: 10 values, beta = 0.2 drops 2 from each end."""
    name, device = backend
    col = torch.tensor([9.0, -4.0, 1.0, 100.0, 3.0, 2.0, -50.0, 5.0, 4.0, 0.0])
    X = col[:, None].repeat(1, 3).contiguous().to(device)
    out, _ = R.trimmed_mean(X, 0.2, backend=name)
    # sorted: -50 -4 | 0 1 2 3 4 5 | 9 100  -> mean of 0..5 = 2.5
    assert out.cpu().tolist() == [2.5, 2.5, 2.5]
    out, _ = R.coordinate_median(X, backend=name)
    assert out.cpu().tolist() == [2.5, 2.5, 2.5]  # (2 + 3) / 2
    out, _ = R.coordinate_median(X[:9].contiguous(), backend=name)
    assert out.cpu().tolist() == [3.0, 3.0, 3.0]  # 9 values without 0.0: -50 -4 1 2 [3] 4 5 9 100


def test_ties_give_the_oracle_values(backend):
    """Integer values with many repeats: every sorted order of equal values gives the
    same result, exactly."""
    name, device = backend
    g = torch.Generator().manual_seed(3)
    X = torch.randint(-2, 3, (8, 257), generator=g).float().to(device)
    out, _ = R.coordinate_median(X, backend=name)
    assert torch.equal(out.cpu().double(), O.coordinate_median(X.cpu()))
    out, _ = R.trimmed_mean(X, 0.25, backend=name)  # 4 values of integers: exact sum, /4 exact
    assert torch.equal(out.cpu().double(), O.trimmed_mean(X.cpu(), 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_clients_are_left_out(backend, dtype):
    name, device = backend
    N = 301 if small(name) else 5003
    X = clients(7, N, dtype, device, seed=5)
    X[1, 17] = float("nan")
    X[4, N - 1] = float("inf")
    kept = torch.tensor([True, False, True, True, False, True, True])
    out, st = R.coordinate_median(X, backend=name)
    assert st.excluded.cpu().tolist() == (~kept).tolist()
    assert st.selected.cpu().tolist() == kept.tolist()
    assert torch.isfinite(out).all()
    assert_coordinate_close(out, O.coordinate_median(X.cpu()), X, kept, dtype)
    out, st = R.trimmed_mean(X, 0.2, backend=name)
    assert_coordinate_close(out, O.trimmed_mean(X.cpu(), 0.2), X, kept, dtype)
    # every client non-finite: zeros, said so
    X[:, 0] = float("nan")
    out, st = R.coordinate_median(X, backend=name)
    assert bool(st.all_excluded) and not bool(st.bound_met)
    assert torch.equal(out.cpu(), torch.zeros(N, dtype=dtype))


def select_oracle(X, keep, count: int, mode: int) -> torch.Tensor:
    """The backend op's value per column in float64, written from python_ref's order
    (``torch.sort`` of the kept values: NaN after every number, +inf included): mode 0
    the mean of ``v[k .. m-k)``, mode 1 the ``count`` values closest to the median,
    dropping the farther end (the upper one on a tie)."""
    v = torch.sort(X.double().cpu()[keep.cpu()], dim=0).values
    m = v.shape[0]
    out = torch.zeros(X.shape[1], dtype=torch.float64)
    for j in range(X.shape[1]):
        col = v[:, j].tolist()
        if mode == 0:
            k = min(count, (m - 1) // 2)
            out[j] = sum(col[k:m - k]) / (m - 2 * k)
        else:
            beta = max(1, min(count, m))
            med = col[(m - 1) // 2] if m % 2 else (col[m // 2 - 1] + col[m // 2]) / 2
            lo, hi = 0, m - 1
            while hi - lo + 1 > beta:
                if abs(col[lo] - med) > abs(col[hi] - med):
                    lo += 1
                else:
                    hi -= 1
            out[j] = sum(col[lo:hi + 1]) / beta
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("mode,count", [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 4)])
def test_a_kept_nan_sorts_after_every_number_in_the_backend_op(backend_impl, dtype, mode, count):
    """The backend op itself (its first pass, before the ops layer runs the rule again
    without the flagged clients): a KEPT client's NaN orders after every number, +inf
    included, as python_ref's sort orders it -- on every backend the column is the
    oracle's.  (The CUDA insertion sort and the CPU compare-exchanges left a NaN
    unordered, Triton's bitonic sort too, and the reference sorted a left-out client's
    +inf after it: issue 40, found on the PTX simulator.)"""
    C, N = 8, 37  # m = 7 kept: an odd count, so no closest-to-median window is a tie
    X = clients(C, N, dtype, backend_impl.device, seed=11)
    keep = torch.tensor([True, True, False, True, True, True, True, True], device=backend_impl.device)
    X[2, :] = float("inf")             # a left-out client's values never count
    X[3, 1] = float("nan")             # one kept NaN
    X[0, 2] = X[5, 2] = float("nan")   # two
    X[4, 3] = float("nan")             # a kept NaN above a kept +inf
    X[6, 3] = float("inf")
    X[1, 4] = float("-inf")            # and below a -inf
    X[3, 4] = float("nan")
    X[2, 5] = float("nan")             # a left-out NaN
    X[:, 6] = float("nan")             # every kept value NaN
    out_dtype = acc_of(dtype)
    out = torch.full((N,), 7.0, dtype=out_dtype, device=backend_impl.device)
    flags = backend_impl.coordinate_select(X, keep, torch.tensor([count], device=backend_impl.device), mode, out,
                                           None)
    assert flags.cpu().tolist() == [True, True, False, True, True, True, True, True]
    want = select_oracle(X, keep, count, mode)
    got = out.double().cpu()
    same_nonfinite = torch.isnan(got) == torch.isnan(want)
    assert same_nonfinite.all(), f"NaN where the oracle has none or the reverse: columns " \
                                 f"{(~same_nonfinite).nonzero().flatten().tolist()}, got {got}, want {want}"
    fin = torch.isfinite(want)
    assert torch.equal(got[~fin & ~torch.isnan(want)], want[~fin & ~torch.isnan(want)])  # the infinities
    u_acc = torch.finfo(out_dtype).eps / 2
    mass = torch.nan_to_num(X.double().cpu()[keep.cpu()], 0, 0, 0).abs().max(dim=0).values
    err = (got[fin] - want[fin]).abs()
    assert (err <= C * u_acc * mass[fin] + torch.finfo(out_dtype).tiny).all(), (got, want)


def test_acc_dtype_out_and_determinism(backend):
    name, device = backend
    X = clients(6, 333, torch.float16, device, seed=9)
    out = torch.empty(333, dtype=torch.float32, device=device)
    R.trimmed_mean(X, 0.2, out=out, backend=name)
    assert_coordinate_close(out, O.trimmed_mean(X.cpu(), 0.2), X, torch.ones(6, dtype=torch.bool), torch.float32)
    again, _ = R.trimmed_mean(X, 0.2, out=torch.empty_like(out), backend=name)
    assert torch.equal(out, again)


@pytest.mark.parametrize("beta", [0.5, -0.1, float("nan"), 0.7])
def test_bad_beta_is_refused_before_out_is_written(beta):
    X = clients(5, 10, torch.float32, "cpu")
    out = torch.full((10,), 7.0)
    with pytest.raises(ValueError, match="beta"):
        R.trimmed_mean(X, beta, out=out)
    assert torch.equal(out, torch.full((10,), 7.0))


# ---------------------------------------------------------------- Krum, Multi-Krum, Bulyan

def poisoned(C, f, N, dtype, device, seed=0):
    """C clients around a common mean, the last f far away (a scaled attack)."""
    X = clients(C, N, torch.float64, "cpu", seed=seed, scale_spread=False) * 0.1 + 1.0
    X[C - f:] = X[C - f:] * -20.0
    return X.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C, f", [(3, 0), (7, 2), (12, 1)])  # (7, 2): f at Krum's limit C = 2f + 3
def test_krum_and_multi_krum_match_the_oracle(backend, dtype, C, f):
    name, device = backend
    for N in ([0, 1, 97] if small(name) else [0, 1, 97, 20011]):
        X = poisoned(C, f, N, dtype, device, seed=C * 7 + N)
        for m in (1, 2, C - f):
            out, st = R.multi_krum(X, f, m, backend=name)
            want, chosen = O.multi_krum(X.cpu(), f, m)
            assert st.selected.cpu().nonzero().flatten().tolist() == chosen
            if N:
                assert max(chosen) < C - f, "an attacker was selected"
            assert_mean_close(out, want, X, st.weights, dtype)
        out, st = R.krum(X, f, backend=name)
        want, chosen = O.multi_krum(X.cpu(), f, 1)
        assert st.selected.cpu().nonzero().flatten().tolist() == chosen


def test_multi_krum_weights_and_nonfinite_clients(backend):
    name, device = backend
    X = poisoned(9, 2, 211, torch.float32, device, seed=1)
    X[0, 3] = float("nan")  # counts as one of the f faulty clients
    w = torch.rand(9, generator=torch.Generator().manual_seed(0)) + 0.1
    out, st = R.multi_krum(X, 2, 5, weights=w, backend=name)
    want, chosen = O.multi_krum(X.cpu(), 2, 5, weights=w)
    assert st.selected.cpu().nonzero().flatten().tolist() == chosen and 0 not in chosen
    assert st.excluded.cpu().tolist() == [True] + [False] * 8 and bool(st.bound_met)
    assert_mean_close(out, want, X, st.weights, torch.float32)
    # more non-finite clients than f: still a result, and the bound is reported broken
    X[1:4, 0] = float("inf")
    out, st = R.multi_krum(X, 2, backend=name)
    assert not bool(st.bound_met) and torch.isfinite(out).all()
    want, chosen = O.multi_krum(X.cpu(), 2, 7)
    assert st.selected.cpu().nonzero().flatten().tolist() == chosen


def test_krum_ties_go_to_the_lower_index(backend):
    """Duplicated integer clients: exact Gram entries, exactly equal scores."""
    name, device = backend
    base = torch.randint(-3, 4, (3, 41), generator=torch.Generator().manual_seed(2)).float()
    X = torch.cat([base, base]).to(device)  # clients i and i + 3 equal
    out, st = R.multi_krum(X, 1, 2, backend=name)
    want, chosen = O.multi_krum(X.cpu(), 1, 2)
    assert st.selected.cpu().nonzero().flatten().tolist() == chosen
    assert torch.equal(out.cpu().double(), want)


@pytest.mark.parametrize("C, f", [(3, 0), (7, 1), (11, 2)])  # 4f + 3: f at Bulyan's limit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_bulyan_matches_the_oracle(backend, C, f, dtype):
    name, device = backend
    for N in ([0, 1, 53] if small(name) else [0, 1, 53, 5003]):
        X = poisoned(C, f, N, dtype, device, seed=C + N)
        out, st = R.bulyan(X, f, backend=name)
        want, chosen = O.bulyan(X.cpu(), f)
        assert st.selected.cpu().nonzero().flatten().tolist() == chosen
        assert_coordinate_close(out, want, X, st.selected.cpu(), dtype)


def test_bulyan_closest_to_median_on_a_hand_column(backend):
    """f = 1, C = 7: theta = 5 selected, beta = 3 closest to the median averaged.
    Identical columns make every Krum distance a multiple of one column's, so the
    selection is the 5 clients nearest the bulk."""
    name, device = backend
    col = torch.tensor([0.0, 1.0, 2.0, 4.0, 10.0, 11.0, -30.0])
    X = col[:, None].repeat(1, 5).contiguous().to(device)
    out, st = R.bulyan(X, 1, backend=name)
    want, chosen = O.bulyan(X.cpu(), 1)
    assert st.selected.cpu().nonzero().flatten().tolist() == chosen
    assert torch.equal(out.cpu().double(), want)


@pytest.mark.parametrize("rule, C, f", [("krum", 4, 1), ("krum", 2, 0), ("krum", 1, 0), ("bulyan", 10, 2),
                                        ("bulyan", 6, 1)])
def test_f_beyond_the_limit_is_refused_before_out_is_written(rule, C, f):
    X = clients(C, 8, torch.float32, "cpu")
    out = torch.full((8,), 3.0)
    fn = R.krum if rule == "krum" else R.bulyan
    with pytest.raises(ValueError, match=r"f = .* too large.*C >= "):
        fn(X, f, out=out)
    assert torch.equal(out, torch.full((8,), 3.0))


def test_bad_krum_parameters_are_named():
    X = clients(7, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="m must be in"):
        R.multi_krum(X, 1, 0)
    with pytest.raises(ValueError, match="m must be in"):
        R.multi_krum(X, 1, 8)
    with pytest.raises(TypeError, match="f must be an int"):
        R.krum(X, 1.0)
    with pytest.raises(ValueError, match="f must be >= 0"):
        R.krum(X, -1)


# ---------------------------------------------------------------- geometric median, centered clipping

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 2, 9])
def test_geometric_median_matches_the_oracle(backend, dtype, C):
    name, device = backend
    for N in ([0, 1, 61] if small(name) else [0, 1, 61, 20011]):
        X = poisoned(C, C // 3, N, dtype, device, seed=C + N)
        w = torch.rand(C, generator=torch.Generator().manual_seed(C)) + 0.2
        for weights, max_iter in ((None, 4), (w, 50), (w, 0)):
            out, st = R.geometric_median(X, weights, max_iter=max_iter, backend=name)
            want, it = O.geometric_median(X.cpu(), weights, max_iter=max_iter)
            assert int(st.iterations) == it
            assert_mean_close(out, want, X, st.weights, dtype)


def test_geometric_median_resists_outliers_and_skips_nan_clients(backend):
    name, device = backend
    X = poisoned(10, 3, 101, torch.float32, device, seed=4)
    X[2, 0] = float("nan")
    out, st = R.geometric_median(X, max_iter=100, tol=1e-10, backend=name)
    want, it = O.geometric_median(X.cpu(), max_iter=100, tol=1e-10)
    assert int(st.iterations) == it and it < 100
    assert st.excluded.cpu().tolist() == [False, False, True] + [False] * 7
    assert_mean_close(out, want, X, st.weights, torch.float32)
    honest = X.cpu().double()[[0, 1, 3, 4, 5, 6]].mean(dim=0)
    assert (out.cpu().double() - honest).norm() < 0.25 * (X.cpu().double()[[0, 1, 3, 4, 5, 6, 7, 8, 9]].mean(0)
                                                         - honest).norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("C", [1, 2, 8])
def test_centered_clip_matches_the_oracle(backend, dtype, C):
    name, device = backend
    for N in ([0, 1, 61] if small(name) else [0, 1, 61, 20011]):
        X = poisoned(C, C // 4, N, dtype, device, seed=C + N)
        ref = torch.randn(N, generator=torch.Generator().manual_seed(N), dtype=torch.float64).to(dtype).to(device)
        for tau, iters, r in ((0.5, 1, None), (2.0, 3, ref), (1e6, 2, ref)):
            out, st = R.centered_clip(X, tau, iterations=iters, reference=r, backend=name)
            want = O.centered_clip(X.cpu(), tau, iters, None if r is None else r.cpu())
            coef = torch.cat([st.weights.cpu(), torch.ones(1, dtype=torch.float64)])
            Xr = torch.cat([X.cpu(), (ref if r is not None else torch.zeros_like(ref)).cpu()[None]])
            assert_mean_close(out, want, Xr, coef, dtype)


def test_centered_clip_with_every_client_nonfinite_returns_the_reference(backend):
    name, device = backend
    X = clients(3, 20, torch.float32, device)
    X[:, 5] = float("nan")
    ref = torch.arange(20, dtype=torch.float32, device=device)
    out, st = R.centered_clip(X, 1.0, iterations=2, reference=ref, backend=name)
    assert bool(st.all_excluded) and torch.equal(out.cpu(), ref.cpu())


# ---------------------------------------------------------------- norm bounding

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_norm_bounded_mean_matches_the_oracle(backend, dtype):
    name, device = backend
    for C, N in ((1, 17), (2, 0), (2, 33), (9, 301 if small(name) else 10007)):
        X = poisoned(C, C // 3, N, dtype, device, seed=C + N)
        w = torch.rand(C, generator=torch.Generator().manual_seed(C)) + 0.1
        for kw in (dict(radius=0.5), dict(radius=1e9), dict(median_factor=1.0), dict(median_factor=0.3)):
            out, st = R.norm_bounded_mean(X, w, backend=name, **kw)
            want, _ = O.norm_bounded_mean(X.cpu(), w, **kw)
            assert_mean_close(out, want, X, st.weights, dtype)


def test_norm_bounded_mean_nonfinite_and_parameters(backend):
    name, device = backend
    X = poisoned(6, 2, 50, torch.float32, device)
    X[5, 1] = float("-inf")
    out, st = R.norm_bounded_mean(X, median_factor=2.0, backend=name)
    want, _ = O.norm_bounded_mean(X.cpu(), median_factor=2.0)
    assert st.excluded.cpu().tolist() == [False] * 5 + [True]
    assert_mean_close(out, want, X, st.weights, torch.float32)
    with pytest.raises(ValueError, match="exactly one of radius"):
        R.norm_bounded_mean(X, radius=1.0, median_factor=1.0)
    with pytest.raises(ValueError, match="radius must satisfy"):
        R.norm_bounded_mean(X, radius=0.0)


def test_bad_iterative_parameters_are_named():
    X = clients(4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="tau must satisfy"):
        R.centered_clip(X, 0.0)
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        R.centered_clip(X, 1.0, iterations=0)
    with pytest.raises(ValueError, match="reference must be"):
        R.centered_clip(X, 1.0, reference=torch.zeros(7))
    with pytest.raises(ValueError, match="nu must satisfy"):
        R.geometric_median(X, nu=0.0)
    with pytest.raises(ValueError, match="max_iter must be >= 0"):
        R.geometric_median(X, max_iter=-1)
    with pytest.raises(ValueError, match="weights must be >= 0"):
        R.geometric_median(X, [1.0, -1.0, 1.0, 1.0])


# ---------------------------------------------------------------- Gram matrix, server entry

def test_reference_gram_matrix_is_the_float64_products():
    """The reference backend's Gram matrix (the other backends' and their bounds:
    tests/test_robust_gram.py)."""
    X = clients(5, 70001, torch.float32, "cpu", seed=8)
    G = R.client_gram(X, backend="reference")
    X64 = X.double()
    assert torch.equal(G, G.T)
    torch.testing.assert_close(G, X64 @ X64.T, rtol=1e-13, atol=0)
    Gx = R.client_gram(list(X.unbind(0)), extra=X[0], backend="reference")
    torch.testing.assert_close(Gx[5, :5], G[0], rtol=1e-13, atol=0)


def test_server_entry_runs_every_rule_and_reports_clients():
    X = poisoned(11, 2, 40, torch.float32, "cpu", seed=6)
    X[3, 0] = float("nan")
    params = {"mean": {}, "median": {}, "trimmed-mean": {"beta": 0.2}, "krum": {"f": 2}, "multi-krum": {"f": 2, "m": 6},
              "bulyan": {"f": 2}, "geomed": {}, "centered-clip": {"tau": 1.0},
              "norm-bound": {"median_factor": 1.0}}
    assert set(params) == set(RULES)
    honest = X[[0, 1, 2, 4, 5, 6, 7, 8]].double().mean(dim=0)
    for rule, p in params.items():
        res = robust_aggregate(X, rule, **p)
        assert res.rule == rule and res.aggregate.shape == (40,)
        assert res.excluded.tolist() == [False] * 3 + [True] + [False] * 7, rule
        assert not res.selected[3], rule
        assert torch.isfinite(res.aggregate).all(), rule
        if rule in ("krum", "multi-krum", "bulyan"):
            assert not res.selected[9:].any(), rule  # the attackers
            assert (res.aggregate.double() - honest).norm() < 0.3 * honest.norm(), rule
    with pytest.raises(ValueError, match="rule must be one of"):
        robust_aggregate(X, "fedmedian")
    with pytest.raises(TypeError, match="does not take beta"):
        robust_aggregate(X, "median", beta=0.1)


def test_clients_as_a_list_or_pieces_give_the_rows_result(backend):
    """A list of rows (read in place by the CPU kernel, stacked elsewhere) and
    ClientPieces give bit for bit the ``[C, N]`` result."""
    from fedopt_kernels.ops import ClientPieces

    name, device = backend
    X = clients(5, 203, torch.float32, device, seed=11)
    rows = [x.clone() for x in X.unbind(0)]
    pieces = ClientPieces([[x[:100].clone(), x[100:].clone()] for x in X.unbind(0)])
    for fn in (lambda c: R.coordinate_median(c, backend=name), lambda c: R.trimmed_mean(c, 0.2, backend=name),
               lambda c: R.bulyan(c, 0, backend=name), lambda c: R.multi_krum(c, 1, backend=name)):
        want, _ = fn(X)
        assert torch.equal(fn(rows)[0], want)
        assert torch.equal(fn(pieces)[0], want)


def test_cpu_kernel_results_do_not_depend_on_the_thread_count(cpu_extension, threads):
    X = clients(20, 3 * 4096 + 77, torch.float32, "cpu", seed=12)
    X[7, 9000] = float("nan")
    got = {}
    for t in (1, 2):
        threads(t)
        got[t] = [R.coordinate_median(X, backend="cpu")[0], R.trimmed_mean(X, 0.1, backend="cpu")[0],
                  R.bulyan(X, 4, backend="cpu")[0]]
    for a, b in zip(got[1], got[2]):
        assert torch.equal(a, b)
