"""Every backend of ``ops.nar_step_``, the reference one included, against the fp64
oracle of tests/_fp64_oracle.py (the one test matrix; python_ref is the reference
backend, so it is checked here, never used as its own oracle)."""

from __future__ import annotations

import math

import pytest
import torch

from types import SimpleNamespace

import _fp64_oracle as fp64
from _asserts import bits
from fedopt_kernels import backends, ops
from fedopt_kernels.benchmarks.shapes import resnet18_shapes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["co", "grad", "none"]


def make_case(shapes, dtype, device, *, seed=0, grad_scale=1.0, param_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=g) * param_scale).to(dtype).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=g) * grad_scale).to(dtype).to(device) for s in shapes]
    bufs = [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]
    return params, grads, bufs


def clone(ts):
    return [t.clone() for t in ts]


def oracle(params, grads, bufs, **kw):
    """The fp64 oracle's step, shaped like the op's result: ``(params, bufs, stats)``."""
    kw = dict(kw)
    kw.pop("backend", None)
    new_x, new_b, n, s, skipped = fp64.nar_step(params, grads, bufs if kw.get("momentum") else None, **kw)
    stats = SimpleNamespace(norm=torch.tensor(n, dtype=torch.float64), scale=torch.tensor(s, dtype=torch.float64),
                            skipped=torch.tensor(skipped))
    return new_x, new_b if kw.get("momentum") else clone(bufs), stats


def run_both(name, params, grads, bufs, **kw):
    """Run the backend on copies, and the fp64 oracle; return both results."""
    momentum = kw.get("momentum", 0.0)
    p_fused, b_fused = clone(params), clone(bufs)
    st_fused = ops.nar_step_(p_fused, grads, momentum_buffers=b_fused if momentum else None, backend=name, **kw)
    return (p_fused, b_fused, st_fused), oracle(params, grads, bufs, **kw)


def assert_matches(fused, reference, dtype):
    (p_f, b_f, st_f), (p_r, b_r, st_r) = fused, reference
    torch.testing.assert_close(st_f.norm.cpu().double(), st_r.norm, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(st_f.scale.cpu().double(), st_r.scale, rtol=2e-5, atol=1e-7)
    assert bool(st_f.skipped) == bool(st_r.skipped)
    assert st_f.norm.dim() == 0 and st_f.skipped.dtype == torch.bool
    for a, b in zip(p_f, p_r):
        assert a.dtype == dtype
        torch.testing.assert_close(a.cpu(), b.cpu())
    for a, b in zip(b_f, b_r):
        torch.testing.assert_close(a.cpu(), b.cpu())


ODD = [(1,), (5,), (1025,), (278011,)]


def interpreted(name) -> bool:
    """Triton on CPU tensors in its interpreter: correct but ~1000x slower."""
    return name == "triton" and backends.triton_interpret_mode()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_odd_sizes_and_empty_tensors(backend, dtype, mode, momentum):
    name, device = backend
    # 278011: many blocks and chunks with a ragged tail; under the (slow) Triton
    # interpreter 70001, still many blocks with a tail.
    big = 70001 if interpreted(name) else 278011
    shapes = [(1,), (0,), (5,), (1025,), (3, 0, 2), (big,)]
    params, grads, bufs = make_case(shapes, dtype, device, seed=1)
    kw = dict(lr=0.05, weight_decay=0.01, max_norm=10.0, mode=mode, momentum=momentum)
    fused, reference = run_both(name, params, grads, bufs, **kw)
    assert_matches(fused, reference, dtype)
    # ||g|| >= sqrt(70001) ~ 265 > 10: the co and grad modes really clip here.
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


def differs(reference, other) -> bool:
    """Whether two oracle results differ beyond the matrix's tolerance (so a backend that
    dropped the term in which they differ would fail ``assert_matches``)."""
    try:
        for a, b in zip(reference[0] + reference[1], other[0] + other[1]):
            torch.testing.assert_close(a, b)
    except AssertionError:
        return True
    return False


def resnet18_case_shapes(name):
    """ResNet-18's 62 tensors; where Triton runs in its (slow) interpreter, and on the
    reference backend (python_ref: no chunks, blocks or threads whose count the size
    would reach), the same 62 tensors with the channel dimensions divided by 8 (still
    every kind of shape, odd sizes, several blocks per tensor)."""
    shapes = resnet18_shapes()
    if interpreted(name) or name == "reference":
        shapes = [tuple(max(1, d // 8) if i < 2 else d for i, d in enumerate(s)) for s in shapes]
    return shapes


@pytest.mark.parametrize("mode", MODES)
def test_resnet18_list(backend, mode):
    """The 62 tensors of ResNet-18, clipped: ||g|| ~ 3.3 and ||wd x|| ~ 8 against
    max_norm 0.1 (~1.1 and ~0.4 on the smaller shapes of the interpreter and the
    reference backend), and a weight decay large enough that dropping it, or applying it
    on the wrong side of the clip, moves the result outside the tolerance (checked below)."""
    name, device = backend
    shapes = resnet18_case_shapes(name)
    assert len(shapes) == 62
    params, grads, bufs = make_case(shapes, torch.float32, device, seed=3, grad_scale=1e-3, param_scale=0.05)
    kw = dict(lr=0.1, weight_decay=0.05, max_norm=0.1, mode=mode, momentum=0.9 if mode == "co" else 0.0)
    fused, reference = run_both(name, params, grads, bufs, **kw)
    assert_matches(fused, reference, torch.float32)
    if mode != "none":
        assert float(fused[2].scale) < 0.5  # really clipped
    # The case sees each term: without weight decay, or with the other mode's placement
    # of it, the oracle's result is outside the tolerance of assert_matches.  (A property
    # of the case's values, the same for every backend given the same shapes: checked
    # at the first backend that runs them.)
    key = (tuple(shapes), mode)
    if key not in _SEES_EACH_TERM:
        assert differs(reference, oracle(params, grads, bufs, **{**kw, "weight_decay": 0.0}))
        if mode != "none":
            other = "grad" if mode == "co" else "co"
            assert differs(reference, oracle(params, grads, bufs, **{**kw, "mode": other}))
        _SEES_EACH_TERM.add(key)


_SEES_EACH_TERM: set = set()


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
        x, b, n, _, skipped = fp64.nar_step([X[i]], [G[i]], [B[i]], lr=float(lr[i]), weight_decay=0.01,
                                            max_norm=1.0, momentum=0.9)
        torch.testing.assert_close(Xb[i].cpu(), x[0])
        torch.testing.assert_close(Bb[i].cpu(), b[0])
        assert bool(st.skipped[i]) == skipped
        if i < 2:
            torch.testing.assert_close(float(st.norm[i]), n, rtol=2e-5, atol=0)
    assert torch.equal(Xb[2], X[2]) and torch.equal(Bb[2], B[2])  # the NaN row did not move


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["co", "grad"])
def test_low_precision_sees_every_term(backend, dtype, mode):
    """fp16/bf16 with magnitudes at which each term of the step -- weight decay, its
    side of the clip, momentum, lr, the clip itself -- moves the result by more than the
    dtype's tolerance: a backend that dropped any of them fails (the self-checks below
    show that each variant's result is outside the tolerance)."""
    name, device = backend
    params, grads, bufs = make_case([(5,), (1025,), (3, 7)], dtype, device, seed=11)
    kw = dict(lr=0.5, weight_decay=0.5, max_norm=10.0, mode=mode, momentum=0.9)
    fused, reference = run_both(name, params, grads, bufs, **kw)
    assert_matches(fused, reference, dtype)
    assert float(fused[2].scale) < 0.5
    for change in (dict(weight_decay=0.0), dict(momentum=0.0), dict(lr=0.55), dict(max_norm=1e9),
                   dict(mode="grad" if mode == "co" else "co")):
        assert differs(reference, oracle(params, grads, bufs, **{**kw, **change})), change


@pytest.mark.parametrize("mode", ["co", "grad"])
@pytest.mark.parametrize("side", [-1, 1], ids=["just_below", "just_above"])
def test_norm_within_a_thousandth_of_max_norm(backend, mode, side):
    """n = A (1 +- 1e-3): below, s is exactly 1; above, s = A / (n + eps) ~ 0.999, and
    the 0.1% shrink of the step is far outside the tolerance."""
    name, device = backend
    N, A = 1000, 10.0
    n = A * (1 + side * 1e-3)
    x = torch.linspace(-1, 1, N, dtype=torch.float64)
    g = torch.full((N,), n / math.sqrt(N), dtype=torch.float64)
    wd = 0.0 if mode == "co" else 0.1  # co clips g + wd x: keep n exact with wd 0
    params, grads = [x.float().to(device)], [g.float().to(device)]
    fused, reference = run_both(name, params, grads, [], lr=1.0, weight_decay=wd, max_norm=A, mode=mode)
    assert_matches(fused, reference, torch.float32)
    s = float(fused[2].scale)
    if side < 0:
        assert s == 1.0
    else:
        assert s == pytest.approx(A / (n + 1e-6), rel=1e-6) and s < 0.9995
        assert differs(reference, oracle(params, grads, [], lr=1.0, weight_decay=wd, max_norm=1e9, mode=mode))


@pytest.mark.parametrize("mode", ["co", "grad"])
def test_clip_epsilon_is_observable(backend, mode):
    """n = A = 1e-6: s = A / (n + eps) = 1/2 exactly as torch's clip_grad_norm_ defines the clip
    (without eps it would be 1; with eps outside the division, ~1). Compared with a
    relative tolerance only, so the tiny values still count."""
    name, device = backend
    N, A = 64, 1e-6
    g = torch.full((N,), A / math.sqrt(N), dtype=torch.float64)
    params, grads = [torch.zeros(N, device=device)], [g.float().to(device)]
    st = ops.nar_step_(params, grads, lr=1.0, weight_decay=0.0, max_norm=A, mode=mode, backend=name)
    assert float(st.norm) == pytest.approx(A, rel=1e-5)
    assert float(st.scale) == pytest.approx(0.5, rel=1e-5)
    torch.testing.assert_close(params[0].cpu().double(), -0.5 * g, rtol=1e-5, atol=0)
