"""Every backend of ``ops.nar_step_`` against python_ref (the one test matrix)."""

from __future__ import annotations

import math

import pytest
import torch

import python_ref.fednar as ref
from fedopt_kernels import ops
from fedopt_kernels.benchmarks.shapes import resnet18_shapes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["co", "grad", "none"]


def make_case(shapes, dtype, device, *, seed=0, grad_scale=1.0, param_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=g) * param_scale).to(dtype).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=g) * grad_scale).to(dtype).to(device) for s in shapes]
    bufs = [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]
    return params, grads, bufs


def bits(t):
    """The raw bits of a tensor (so -0.0 != 0.0 and NaN payloads count)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def clone(ts):
    return [t.clone() for t in ts]


def run_both(name, params, grads, bufs, **kw):
    """Run the backend and python_ref on copies; return both results."""
    momentum = kw.get("momentum", 0.0)
    p_fused, b_fused = clone(params), clone(bufs)
    p_ref, b_ref = clone(params), clone(bufs)
    st_fused = ops.nar_step_(p_fused, grads, momentum_buffers=b_fused if momentum else None, backend=name, **kw)
    st_ref = ref.nar_step_(p_ref, grads, momentum_buffers=b_ref if momentum else None, **kw)
    return (p_fused, b_fused, st_fused), (p_ref, b_ref, st_ref)


def assert_matches(fused, reference, dtype):
    (p_f, b_f, st_f), (p_r, b_r, st_r) = fused, reference
    torch.testing.assert_close(st_f.norm.cpu(), st_r.norm.cpu(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(st_f.scale.cpu(), st_r.scale.cpu(), rtol=2e-5, atol=1e-7)
    assert bool(st_f.skipped) == bool(st_r.skipped)
    assert st_f.norm.dim() == 0 and st_f.skipped.dtype == torch.bool
    for a, b in zip(p_f, p_r):
        assert a.dtype == dtype
        torch.testing.assert_close(a.cpu(), b.cpu())
    for a, b in zip(b_f, b_r):
        torch.testing.assert_close(a.cpu(), b.cpu())


ODD = [(1,), (5,), (1025,), (278011,)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_odd_sizes_and_empty_tensors(backend, dtype, mode, momentum):
    name, device = backend
    shapes = [(1,), (0,), (5,), (1025,), (3, 0, 2), (278011,)]
    params, grads, bufs = make_case(shapes, dtype, device, seed=1)
    kw = dict(lr=0.05, weight_decay=0.01, max_norm=10.0, mode=mode, momentum=momentum)
    fused, reference = run_both(name, params, grads, bufs, **kw)
    assert_matches(fused, reference, dtype)
    # ||g|| ~ sqrt(279042) ~ 528 > 10: the co and grad modes really clip here.
    if mode != "none":
        assert float(fused[2].scale) < 0.05


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clipped", [False, True], ids=["below_max_norm", "above_max_norm"])
def test_single_tensor_below_and_above_max_norm(backend, mode, clipped):
    name, device = backend
    params, grads, bufs = make_case([(1000,)], torch.float32, device, seed=2, grad_scale=0.01)
    max_norm = 0.01 if clipped else 100.0
    fused, reference = run_both(name, params, grads, bufs, lr=0.1, weight_decay=0.1, max_norm=max_norm, mode=mode)
    assert_matches(fused, reference, torch.float32)
    if mode != "none":
        assert (float(fused[2].scale) < 1.0) == clipped
    # Hand-check of the formula on this one tensor.
    x, g = params[0].cpu().double(), grads[0].cpu().double()
    v = g + 0.1 * x if mode == "co" else g
    s = 1.0 if mode == "none" else min(1.0, max_norm / (v.norm().item() + 1e-6))
    d = s * v if mode == "co" else s * g + 0.1 * x
    torch.testing.assert_close(fused[0][0].cpu().double(), x - 0.1 * d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_resnet18_list(backend, mode):
    name, device = backend
    shapes = resnet18_shapes()
    assert len(shapes) == 62
    params, grads, bufs = make_case(shapes, torch.float32, device, seed=3, grad_scale=1e-3, param_scale=0.05)
    kw = dict(lr=0.01, weight_decay=5e-4, max_norm=10.0, mode=mode, momentum=0.9 if mode == "co" else 0.0)
    fused, reference = run_both(name, params, grads, bufs, **kw)
    assert_matches(fused, reference, torch.float32)


@pytest.mark.parametrize("mode", MODES)
def test_zero_grads_and_zero_params(backend, mode):
    name, device = backend
    shapes = [(7,), (33, 3)]
    params = [torch.zeros(s, device=device) for s in shapes]
    grads = [torch.zeros(s, device=device) for s in shapes]
    fused, reference = run_both(name, params, grads, [], lr=0.1, weight_decay=0.1, max_norm=1.0, mode=mode)
    assert_matches(fused, reference, torch.float32)
    assert float(fused[2].norm) == 0.0 and float(fused[2].scale) == 1.0
    assert all(bool((p == 0).all()) for p in fused[0])
    # zero grads, non-zero params: only the weight decay moves x (by exactly lr*wd*x when unclipped).
    params = [torch.full(s, 2.0, device=device) for s in shapes]
    fused, reference = run_both(name, params, grads, [], lr=0.1, weight_decay=0.1, max_norm=1e9, mode=mode)
    assert_matches(fused, reference, torch.float32)
    for p in fused[0]:
        torch.testing.assert_close(p.cpu(), torch.full(p.shape, 2.0 - 0.1 * 0.1 * 2.0))


def test_all_tensors_empty(backend):
    name, device = backend
    params = [torch.empty(0, device=device), torch.empty(2, 0, device=device)]
    grads = [torch.empty_like(p) for p in params]
    st = ops.nar_step_(params, grads, lr=0.1, weight_decay=0.1, max_norm=1.0, backend=name)
    assert float(st.norm) == 0.0 and float(st.scale) == 1.0 and not bool(st.skipped)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_grads_skip_bit_identical(backend, bad, mode, dtype):
    name, device = backend
    params, grads, bufs = make_case([(17,), (1030,)], dtype, device, seed=4)
    grads[1][5] = bad
    before_p, before_b = clone(params), clone(bufs)
    st = ops.nar_step_(params, grads, lr=0.1, weight_decay=0.01, max_norm=1.0, mode=mode, momentum=0.5,
                       momentum_buffers=bufs, backend=name)
    assert bool(st.skipped)
    assert not math.isfinite(float(st.norm))
    for a, b in zip(params + bufs, before_p + before_b):
        assert torch.equal(bits(a), bits(b))


def test_nonfinite_param_skips_in_co_mode(backend):
    """In mode co the norm includes wd * x, so an inf parameter is caught too."""
    name, device = backend
    params, grads, _ = make_case([(9,)], torch.float32, device)
    params[0][3] = float("inf")
    before = params[0].clone()
    st = ops.nar_step_(params, grads, lr=0.1, weight_decay=0.01, max_norm=1.0, mode="co", backend=name)
    assert bool(st.skipped)
    assert torch.equal(params[0], before)


def test_tensor_hyperparameters(backend):
    name, device = backend
    params, grads, bufs = make_case([(100,), (3, 7)], torch.float32, device, seed=5)
    lr_t = torch.tensor(0.05, device=device)
    wd_t = torch.tensor(0.02, device=device)
    p_t, b_t = clone(params), clone(bufs)
    st_t = ops.nar_step_(p_t, grads, lr=lr_t, weight_decay=wd_t, max_norm=1.0, momentum=0.9,
                         momentum_buffers=b_t, backend=name)
    p_f, b_f = clone(params), clone(bufs)
    st_f = ops.nar_step_(p_f, grads, lr=0.05, weight_decay=0.02, max_norm=1.0, momentum=0.9,
                         momentum_buffers=b_f, backend=name)
    torch.testing.assert_close(st_t.norm, st_f.norm)
    for a, b in zip(p_t + b_t, p_f + b_f):
        torch.testing.assert_close(a, b)


def test_grad_scale_and_found_inf(backend):
    name, device = backend
    params, grads, _ = make_case([(50,), (4, 4)], torch.float32, device, seed=6)
    scale = torch.tensor(1024.0, device=device)
    scaled = [g * 1024.0 for g in grads]
    p_s = clone(params)
    st_s = ops.nar_step_(p_s, scaled, lr=0.1, weight_decay=0.01, max_norm=1.0, grad_scale=scale,
                         found_inf=torch.tensor(0.0, device=device), backend=name)
    p_u = clone(params)
    st_u = ops.nar_step_(p_u, grads, lr=0.1, weight_decay=0.01, max_norm=1.0, backend=name)
    torch.testing.assert_close(st_s.norm, st_u.norm)  # the norm of the UNscaled gradient
    for a, b in zip(p_s, p_u):
        torch.testing.assert_close(a, b)
    p_i = clone(params)
    st_i = ops.nar_step_(p_i, scaled, lr=0.1, weight_decay=0.01, max_norm=1.0, grad_scale=scale,
                         found_inf=torch.tensor(1.0, device=device), backend=name)
    assert bool(st_i.skipped)
    assert all(torch.equal(a, b) for a, b in zip(p_i, params))


def test_channels_last_params(backend):
    name, device = backend
    x = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last).to(device)
    g = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last).to(device)
    fused, reference = run_both(name, [x], [g], [], lr=0.1, weight_decay=0.01, max_norm=1.0)
    assert_matches(fused, reference, torch.float32)
    assert fused[0][0].is_contiguous(memory_format=torch.channels_last)


def test_deterministic_bitwise(backend):
    name, device = backend
    params, grads, bufs = make_case([(278011,), (1025,), (64, 3, 3, 3)], torch.float32, device, seed=7)
    results = []
    for _ in range(2):
        p, b = clone(params), clone(bufs)
        st = ops.nar_step_(p, grads, lr=0.01, weight_decay=1e-3, max_norm=1.0, momentum=0.9, momentum_buffers=b,
                           backend=name)
        results.append((p, b, st))
    (p1, b1, s1), (p2, b2, s2) = results
    assert torch.equal(s1.norm, s2.norm) and torch.equal(s1.scale, s2.scale)
    assert all(torch.equal(a, b) for a, b in zip(p1 + b1, p2 + b2))


def test_batched_rows_match_single_op(backend):
    name, device = backend
    C, N = 3, 1027
    g = torch.Generator().manual_seed(8)
    X = torch.randn(C, N, generator=g).to(device)
    G = (torch.randn(C, N, generator=g) * torch.tensor([[0.001], [1.0], [100.0]])).to(device)
    G[2, 11] = float("nan")
    B = torch.randn(C, N, generator=g).to(device)
    lr = torch.tensor([0.1, 0.01, 0.5], device=device)
    Xb, Bb = X.clone(), B.clone()
    st = ops.nar_step_batched_(Xb, G, lr=lr, weight_decay=0.01, max_norm=1.0, momentum=0.9, momentum_buffers=Bb,
                               backend=name)
    assert st.norm.shape == (C,) and st.skipped.tolist() == [False, False, True]
    for i in range(C):
        x, b = [X[i].clone()], [B[i].clone()]
        s = ref.nar_step_(x, [G[i]], lr=float(lr[i]), weight_decay=0.01, max_norm=1.0, momentum=0.9,
                          momentum_buffers=b)
        torch.testing.assert_close(Xb[i], x[0])
        torch.testing.assert_close(Bb[i], b[0])
        if i < 2:
            torch.testing.assert_close(st.norm[i], s.norm, rtol=2e-5, atol=0)
    assert torch.equal(Xb[2], X[2]) and torch.equal(Bb[2], B[2])  # the NaN row did not move
