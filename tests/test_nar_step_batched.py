"""``ops.nar_step_batched_`` against the single op applied row by row, on every backend.

Row ``i`` of ``[C, N]`` is client ``i``: the batched op must give each row exactly what
``ops.nar_step_`` (same backend) gives that row alone, and what the fp64 oracle
(tests/_fp64_oracle.py, not python_ref: that is the reference backend) gives -- its own norm,
clip and skip, its own lr and weight decay -- for odd ``N``, ``C`` in {1, 3, 64}, a NaN
row among finite ones, every mode, with and without momentum.
"""

from __future__ import annotations

import pytest
import torch

import _fp64_oracle as fp64
from _asserts import bits
from fedopt_kernels import backends, ops

MODES = ["co", "grad", "none"]


def make_rows(C, N, device, *, seed=0, dtype=torch.float32):
    """Rows whose gradient norms span 1e-3 .. 1e2 (some clip at max_norm 1, some not)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(C, N, generator=g)
    scales = torch.logspace(-3, 2, C).view(C, 1) / max(N, 1) ** 0.5
    G = torch.randn(C, N, generator=g) * scales
    B = torch.randn(C, N, generator=g)
    return X.to(dtype).to(device), G.to(dtype).to(device), B.to(dtype).to(device)


def per_row(values, C, device, *, tensor: bool):
    vals = [values * (1 + 0.5 * (i % 5)) for i in range(C)]
    return torch.tensor(vals, device=device) if tensor else vals


def row_by_row(fn, X, G, B, lrs, wds, **kw):
    """``fn`` (ops.nar_step_ or python_ref) on every row alone; returns X, B, stats."""
    X, B = X.clone(), B.clone()
    norms, scales, skipped = [], [], []
    for i in range(X.shape[0]):
        x, b = [X[i]], [B[i]]
        st = fn(x, [G[i]], lr=float(lrs[i]), weight_decay=float(wds[i]),
                momentum_buffers=b if kw.get("momentum") else None, **kw)
        norms.append(float(st.norm))
        scales.append(float(st.scale))
        skipped.append(bool(st.skipped))
    return X, B, (norms, scales, skipped)


def oracle_rows(X, G, B, lrs, wds, **kw):
    """The fp64 oracle on every row alone; returns X, B (CPU) and the norms, skips."""
    X, B = X.cpu().clone(), B.cpu().clone()
    norms, skipped = [], []
    for i in range(X.shape[0]):
        x, b, n, _, sk = fp64.nar_step([X[i]], [G[i]], [B[i]], lr=float(lrs[i]), weight_decay=float(wds[i]), **kw)
        X[i] = x[0]
        if kw.get("momentum"):
            B[i] = b[0]
        norms.append(n)
        skipped.append(sk)
    return X, B, (norms, skipped)


@pytest.mark.parametrize("C", [1, 3, 64])
@pytest.mark.parametrize("N", [1, 5, 1027])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rows_match_single_op(backend, C, N, mode, momentum):
    name, device = backend
    if C == 64 and name == "triton" and backends.triton_interpret_mode():
        N = min(N, 257)  # 64 long rows are slow to interpret; C = 3 keeps N = 1027
    X, G, B = make_rows(C, N, device, seed=C * 1000 + N)
    if C > 1:
        G[C // 2, N // 2] = float("nan")  # one NaN row among finite ones
    lr = per_row(0.05, C, device, tensor=True)
    wd = per_row(0.01, C, device, tensor=True)
    kw = dict(max_norm=1.0, mode=mode, momentum=momentum)
    Xb, Bb = X.clone(), B.clone()
    st = ops.nar_step_batched_(Xb, G, lr=lr, weight_decay=wd, momentum_buffers=Bb if momentum else None,
                               backend=name, **kw)
    assert st.norm.shape == st.scale.shape == st.skipped.shape == (C,)
    # The same backend's single op row by row: every row where it is cheap; under the
    # Triton interpreter a sample of rows (the fp64 oracle below still checks all).
    rows = range(C) if C <= 3 or not (name == "triton" and backends.triton_interpret_mode()) else [0, C // 2, C - 1]
    rows = list(rows)
    Xs, Bs, (norms, scales, skipped) = row_by_row(
        lambda *a, **k: ops.nar_step_(*a, backend=name, **k), X[rows], G[rows], B[rows],
        [lr[i].item() for i in rows], [wd[i].item() for i in rows], **kw)
    Xr, Br, (rnorms, rskipped) = oracle_rows(X, G, B, lr.tolist(), wd.tolist(), **kw)
    assert st.skipped.tolist() == rskipped == [C > 1 and i == C // 2 for i in range(C)]
    assert [st.skipped.tolist()[i] for i in rows] == skipped
    torch.testing.assert_close(Xb[rows], Xs)
    torch.testing.assert_close(Bb[rows], Bs)
    torch.testing.assert_close(Xb.cpu(), Xr)
    torch.testing.assert_close(Bb.cpu(), Br)
    finite = [i for i in range(C) if not rskipped[i]]
    torch.testing.assert_close(st.norm[finite].cpu().double(), torch.tensor(rnorms, dtype=torch.float64)[finite],
                               rtol=2e-5, atol=1e-6)
    keep = [j for j, i in enumerate(rows) if not rskipped[i]]
    torch.testing.assert_close(st.scale[rows].cpu()[keep], torch.tensor(scales)[keep], rtol=2e-5, atol=1e-7)
    for i in range(C):
        if rskipped[i]:  # the NaN row keeps its exact bits, params and momentum buffer alike
            assert torch.equal(bits(Xb[i]), bits(X[i])) and torch.equal(bits(Bb[i]), bits(B[i]))
    scales = st.scale.cpu().tolist()
    if mode != "none" and C == 64:  # the rows really straddle the clip threshold
        clipped = sum(1 for i in finite if scales[i] < 1)
        assert 0 < clipped < len(finite)


@pytest.mark.parametrize("C", [1, 3, 64])
def test_scalar_and_row_hyperparameters_agree(backend, C):
    """A float lr, a 0-d tensor and a [C] tensor of equal values give the same bits."""
    name, device = backend
    X, G, _ = make_rows(C, 257, device, seed=11)
    out = []
    for lr, wd in [(0.05, 0.01), (torch.tensor(0.05, device=device), torch.tensor(0.01, device=device)),
                   (torch.full((C,), 0.05, device=device), torch.full((C,), 0.01, device=device))]:
        Xb = X.clone()
        st = ops.nar_step_batched_(Xb, G, lr=lr, weight_decay=wd, max_norm=1.0, backend=name)
        out.append((Xb, st.norm))
    for Xb, norm in out[1:]:
        assert torch.equal(Xb, out[0][0]) and torch.equal(norm, out[0][1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_low_and_double_precision_rows(backend, dtype):
    name, device = backend
    C, N = 3, 1027
    X, G, B = make_rows(C, N, device, seed=12, dtype=dtype)
    lr = [0.1, 0.01, 0.5]
    Xb, Bb = X.clone(), B.clone()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ops.nar_step_batched_(Xb, G, lr=torch.tensor(lr, device=device, dtype=acc), weight_decay=0.01, max_norm=1.0,
                          momentum=0.9, momentum_buffers=Bb, backend=name)
    Xs, Bs, _ = row_by_row(lambda *a, **k: ops.nar_step_(*a, backend=name, **k), X, G, B, lr, [0.01] * C,
                           max_norm=1.0, momentum=0.9)
    assert Xb.dtype == dtype
    torch.testing.assert_close(Xb, Xs)
    torch.testing.assert_close(Bb, Bs)


def test_found_inf_skips_every_row_and_grad_scale_unscales(backend):
    name, device = backend
    C, N = 3, 515
    X, G, _ = make_rows(C, N, device, seed=13)
    scale = torch.tensor(512.0, device=device)
    Xs, Xu = X.clone(), X.clone()
    st_s = ops.nar_step_batched_(Xs, G * 512.0, lr=0.1, weight_decay=0.01, max_norm=1.0, grad_scale=scale,
                                 found_inf=torch.tensor(0.0, device=device), backend=name)
    st_u = ops.nar_step_batched_(Xu, G, lr=0.1, weight_decay=0.01, max_norm=1.0, backend=name)
    torch.testing.assert_close(st_s.norm, st_u.norm)
    torch.testing.assert_close(Xs, Xu)
    Xi = X.clone()
    st_i = ops.nar_step_batched_(Xi, G, lr=0.1, weight_decay=0.01, max_norm=1.0,
                                 found_inf=torch.tensor(1.0, device=device), backend=name)
    assert st_i.skipped.tolist() == [True] * C and torch.equal(Xi, X)


def test_rows_are_independent_of_the_other_rows(backend):
    """A row's result does not depend on which rows share the call (what lets the
    simulator cut a round into groups of clients)."""
    name, device = backend
    X, G, _ = make_rows(7, 1027, device, seed=14)
    whole = X.clone()
    st = ops.nar_step_batched_(whole, G, lr=0.05, weight_decay=0.01, max_norm=1.0, backend=name)
    for start, stop in [(0, 2), (2, 5), (5, 7)]:
        part = X[start:stop].clone()
        st_p = ops.nar_step_batched_(part, G[start:stop].contiguous(), lr=0.05, weight_decay=0.01, max_norm=1.0,
                                     backend=name)
        assert torch.equal(part, whole[start:stop])
        assert torch.equal(st_p.norm, st.norm[start:stop])


def test_bad_arguments_are_refused_before_anything_is_written():
    X, G = torch.randn(3, 10), torch.randn(3, 10)
    before = X.clone()
    with pytest.raises(ValueError, match="lr as a tensor must have shape"):
        ops.nar_step_batched_(X, G, lr=torch.ones(4))
    with pytest.raises(ValueError, match="G has shape"):
        ops.nar_step_batched_(X, G[:2], lr=0.1)
    with pytest.raises(ValueError, match="2-D"):
        ops.nar_step_batched_(X[0], G[0], lr=0.1)
    with pytest.raises(ValueError, match="momentum_buffers is required"):
        ops.nar_step_batched_(X, G, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="contiguous"):
        ops.nar_step_batched_(X.t().contiguous().t(), G, lr=0.1)
    assert torch.equal(X, before)
