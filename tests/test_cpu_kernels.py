"""CPU-specific tests of the C++ CPU backend (csrc/cpu) against python_ref.

The backend-independent matrix lives in test_nar_step.py / test_aggregate.py; this file
covers what is specific to the CPU kernels: their tails and chunk boundaries, the
no-FMA arithmetic (an unclipped step is bitwise python_ref's), thread-count and
instruction-set independence of every result, and the per-ISA build itself.
"""

from __future__ import annotations

import math
import platform
import re
import shutil
import subprocess

import pytest
import torch

import python_ref.aggregation as ref_agg
import python_ref.fednar as ref_nar
from python_ref.fednar import compute_dtype as acc_of  # the oracle's accumulation dtype
from _cpu_isa import results_per_isa, x86_only
from fedopt_kernels import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
MODES = ["co", "grad", "none"]
ODD = [(1,), (5,), (1025,), (278011,)]  # 278011 > 4 chunks of 64Ki: several threads

pytestmark = pytest.mark.usefixtures("cpu_extension")


# --------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    if t.dtype == torch.bool:
        return t
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(a, b):
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(bits(x), bits(y)), f"not bitwise equal: max diff {(x.double() - y.double()).abs().max()}"


_MANTISSA = {torch.float16: (10, -14), torch.bfloat16: (7, -126), torch.float32: (23, -126), torch.float64: (52, -1022)}


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at each value of t (as float64)."""
    mant, emin = _MANTISSA[dtype]
    a = t.double().abs()
    e = torch.floor(torch.log2(torch.clamp(a, min=2.0 ** emin)))
    return torch.pow(2.0, e - mant)


def assert_close_to_ref(ours: torch.Tensor, ref: torch.Tensor, *, ulps: int = 2, rtol: float = 1e-5):
    """fp16/bf16: within `ulps` units in the last place of the dtype; fp32: rtol; fp64:
    1e-12; each plus an absolute floor of the same relative size of the largest value."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    o, r = ours.double(), ref.double()
    assert torch.equal(torch.isnan(o), torch.isnan(r))
    fin = torch.isfinite(r)
    assert torch.equal(o[~fin & ~torch.isnan(r)], r[~fin & ~torch.isnan(r)])
    o, r = o[fin], r[fin]
    # The absolute floor covers cancellation (x - lr * d ~ 0): an fp32 intermediate that
    # differs by ~1e-6 of its operands (the clip scale comes from a differently ordered
    # norm) is large next to the tiny result.
    r_tol = 1e-12 if ours.dtype == torch.float64 else rtol
    floor = r_tol * (r.abs().max() if r.numel() else 0.0)
    if ours.dtype in (torch.float16, torch.bfloat16):
        tol = ulps * ulp(r, ours.dtype) + floor
    else:
        tol = r_tol * r.abs() + floor
    bad = (o - r).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements off, e.g. {o[bad][:3].tolist()} vs {r[bad][:3].tolist()}"


def make(shapes, dtype, *, seed=0, gscale=1.0, pscale=1.0, memory_format=None):
    g = torch.Generator().manual_seed(seed)

    def one(s, k):
        t = (torch.randn(s, generator=g, dtype=torch.float64) * k).to(dtype)
        if memory_format is not None and len(s) == 4:
            t = t.contiguous(memory_format=memory_format)
        return t

    return [one(s, pscale) for s in shapes], [one(s, gscale) for s in shapes], [one(s, 1.0) for s in shapes]


def clone(ts):
    return [t.clone() for t in ts]


def step_both(params, grads, bufs, **kw):
    """ops.nar_step_ on the CPU backend and python_ref on copies of the same data."""
    momentum = kw.get("momentum", 0.0)
    p1, b1, p2, b2 = clone(params), clone(bufs), clone(params), clone(bufs)
    st1 = ops.nar_step_(p1, grads, momentum_buffers=b1 if momentum else None, backend="cpu", **kw)
    st2 = ref_nar.nar_step_(p2, grads, momentum_buffers=b2 if momentum else None, **kw)
    return (p1, b1, st1), (p2, b2, st2)


def assert_stats_close(st, st_ref, dtype, rtol=1e-5):
    acc = acc_of(dtype)
    assert st.norm.dtype == acc and st.scale.dtype == acc and st.skipped.dtype == torch.bool
    assert st.norm.shape == st_ref.norm.shape
    r = 1e-12 if dtype == torch.float64 else rtol
    torch.testing.assert_close(st.norm, st_ref.norm.to(acc), rtol=r, atol=1e-30, equal_nan=True)
    torch.testing.assert_close(st.scale, st_ref.scale.to(acc), rtol=r, atol=1e-30, equal_nan=True)
    assert torch.equal(st.skipped, st_ref.skipped)


# --------------------------------------------------------------------------------------
# nar_step_


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_odd_sizes_vs_python_ref(dtype, mode, momentum):
    shapes = [(1,), (0,), (5,), (1025,), (3, 0, 2), (278011,)]
    params, grads, bufs = make(shapes, dtype, seed=1)
    (p, b, st), (p_r, b_r, st_r) = step_both(params, grads, bufs, lr=0.05, weight_decay=0.01, max_norm=10.0,
                                             mode=mode, momentum=momentum)
    assert_stats_close(st, st_r, dtype)
    if mode != "none":
        assert float(st.scale) < 0.05  # ||.|| ~ 528 > 10: really clipped
    for x, y in zip(p + b, p_r + b_r):
        assert_close_to_ref(x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_unclipped_is_bitwise_python_ref(dtype, mode, momentum):
    """No FMA, same operation order as python_ref: with scale exactly 1 (below max_norm,
    or mode none) the new params and buffers are python_ref's to the bit."""
    params, grads, bufs = make(ODD, dtype, seed=2, gscale=1e-3, pscale=0.5)
    (p, b, st), (p_r, b_r, st_r) = step_both(params, grads, bufs, lr=0.1, weight_decay=0.05, max_norm=1e6,
                                             mode=mode, momentum=momentum)
    assert float(st.scale) == 1.0 and float(st_r.scale) == 1.0
    assert_stats_close(st, st_r, dtype)
    assert_bitwise(p, p_r)
    if momentum:
        assert_bitwise(b, b_r)


@pytest.mark.parametrize("mode", ["co", "grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_nar_step_below_and_above_max_norm(mode, dtype):
    params, grads, bufs = make([(1000,), (7, 3)], dtype, seed=3, gscale=0.01, pscale=0.1)
    n = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    for max_norm, clipped in ((10 * n, False), (0.1 * n, True)):
        (p, _, st), (p_r, _, st_r) = step_both(params, grads, bufs, lr=0.5, weight_decay=1e-3, max_norm=max_norm,
                                               mode=mode)
        assert_stats_close(st, st_r, dtype)
        if clipped:
            assert abs(float(st.scale) - max_norm / (float(st.norm) + 1e-6)) < 1e-6
        else:
            assert float(st.scale) == 1.0
        for x, y in zip(p, p_r):
            assert_close_to_ref(x, y)


@pytest.mark.parametrize("mode", MODES)
def test_nar_step_zero_grads_and_params(mode):
    params = [torch.zeros(5), torch.zeros(1025)]
    grads = [torch.zeros(5), torch.zeros(1025)]
    st = ops.nar_step_(params, grads, lr=0.1, weight_decay=0.1, max_norm=1.0, mode=mode, backend="cpu")
    assert float(st.norm) == 0.0 and float(st.scale) == 1.0 and not bool(st.skipped)
    assert all(torch.equal(bits(p), bits(torch.zeros_like(p))) for p in params)
    # Zero grads, non-zero params: only the decay moves them.
    params, _, _ = make([(1025,)], torch.float32, seed=4)
    (p, _, st), (p_r, _, st_r) = step_both(params, [torch.zeros(1025)], [], lr=0.1, weight_decay=0.1, max_norm=1e6,
                                           mode=mode)
    assert_stats_close(st, st_r, torch.float32)
    assert_bitwise(p, p_r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nar_step_all_empty_tensors(dtype):
    params = [torch.empty(0, dtype=dtype), torch.empty(3, 0, dtype=dtype)]
    grads = [torch.empty(0, dtype=dtype), torch.empty(3, 0, dtype=dtype)]
    for momentum in (0.0, 0.9):
        bufs = clone(grads) if momentum else None
        st = ops.nar_step_(params, grads, lr=0.1, max_norm=1.0, momentum=momentum, momentum_buffers=bufs,
                           backend="cpu")
        assert st.norm.dtype == acc_of(dtype) and st.norm.shape == ()
        assert float(st.norm) == 0.0 and float(st.scale) == 1.0 and not bool(st.skipped)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nar_step_nonfinite_grad_skips_bit_identically(dtype, mode, bad):
    params, grads, bufs = make(ODD, dtype, seed=5)
    grads[3][123456] = bad
    p, b = clone(params), clone(bufs)
    st = ops.nar_step_(p, grads, lr=0.1, weight_decay=0.01, max_norm=1.0, mode=mode, momentum=0.9,
                       momentum_buffers=b, backend="cpu")
    assert bool(st.skipped) and not math.isfinite(float(st.norm))
    assert_bitwise(p, params)
    assert_bitwise(b, bufs)
    st_r = ref_nar.nar_step_(clone(params), grads, lr=0.1, weight_decay=0.01, max_norm=1.0, mode=mode,
                             momentum=0.9, momentum_buffers=clone(bufs))
    assert bool(st_r.skipped) and math.isnan(float(st.norm)) == math.isnan(float(st_r.norm))


def test_nar_step_nonfinite_param_only_matters_in_mode_co():
    """co clips on g + wd x, so an inf param skips; grad/none clip on g alone and step
    (writing the inf/nan through, like python_ref)."""
    for mode in MODES:
        params, grads, _ = make([(1025,), (5,)], torch.float32, seed=6)
        params[0][7] = float("inf")
        (p, _, st), (p_r, _, st_r) = step_both(params, grads, [], lr=0.1, weight_decay=0.01, max_norm=1.0,
                                               mode=mode)
        assert bool(st.skipped) == (mode == "co") == bool(st_r.skipped)
        if mode == "co":
            assert_bitwise(p, params)
        for x, y in zip(p, p_r):
            assert_close_to_ref(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_nar_step_lr_and_weight_decay_as_tensors(dtype):
    params, grads, bufs = make(ODD, dtype, seed=7)
    acc = acc_of(dtype)
    kw = dict(max_norm=5.0, mode="co", momentum=0.9)
    p1, b1, p2, b2 = clone(params), clone(bufs), clone(params), clone(bufs)
    st1 = ops.nar_step_(p1, grads, lr=0.03, weight_decay=0.02, momentum_buffers=b1, backend="cpu", **kw)
    st2 = ops.nar_step_(p2, grads, lr=torch.tensor(0.03, dtype=acc), weight_decay=torch.tensor(0.02, dtype=acc),
                        momentum_buffers=b2, backend="cpu", **kw)
    assert_bitwise(p1 + b1 + list(st1), p2 + b2 + list(st2))
    (p, b, st), (p_r, b_r, st_r) = step_both(params, grads, bufs, lr=torch.tensor(0.03, dtype=acc),
                                             weight_decay=torch.tensor(0.02, dtype=acc), **kw)
    assert_stats_close(st, st_r, dtype)
    for x, y in zip(p + b, p_r + b_r):
        assert_close_to_ref(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_nar_step_grad_scale_and_found_inf(dtype):
    params, grads, bufs = make(ODD, dtype, seed=8)
    scaled = [(g.double() * 1024).to(dtype) for g in grads]  # exact: a power of two
    kw = dict(lr=0.1, weight_decay=0.01, max_norm=10.0, mode="co")
    p1, p2 = clone(params), clone(params)
    st1 = ops.nar_step_(p1, grads, backend="cpu", **kw)
    st2 = ops.nar_step_(p2, scaled, grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0), backend="cpu", **kw)
    assert_bitwise(p1 + list(st1), p2 + list(st2))
    (p, _, st), (p_r, _, st_r) = step_both(params, scaled, bufs, grad_scale=torch.tensor(1024.0), **kw)
    assert_stats_close(st, st_r, dtype)
    for x, y in zip(p, p_r):
        assert_close_to_ref(x, y)
    # found_inf set: skipped, nothing written, the norm still reported.
    p3, b3 = clone(params), clone(bufs)
    st3 = ops.nar_step_(p3, grads, found_inf=torch.tensor(1.0), momentum=0.5, momentum_buffers=b3, backend="cpu",
                        **kw)
    assert bool(st3.skipped)
    assert float(st3.norm) == float(st1.norm)
    assert_bitwise(p3 + b3, params + bufs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_channels_last(dtype, momentum):
    shapes = [(8, 3, 5, 5), (64, 16, 3, 3), (16,), (1, 7, 1, 9)]
    params, grads, bufs = make(shapes, dtype, seed=9, memory_format=torch.channels_last)
    assert not params[1].is_contiguous() and params[1].is_contiguous(memory_format=torch.channels_last)
    (p, b, st), (p_r, b_r, st_r) = step_both(params, grads, bufs, lr=0.1, weight_decay=0.01, max_norm=3.0,
                                             mode="co", momentum=momentum)
    assert_stats_close(st, st_r, dtype)
    for x, y in zip(p + b, p_r + b_r):
        assert x.stride() == y.stride() or x.numel() <= 1
        assert_close_to_ref(x, y)


# --------------------------------------------------------------------------------------
# nar_step_batched_


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_batched_per_row_lr_and_a_nan_row(dtype, mode, momentum):
    C, N = 5, 70001  # two chunks per row
    gen = torch.Generator().manual_seed(10)
    X = torch.randn(C, N, generator=gen, dtype=torch.float64).to(dtype)
    G = (torch.randn(C, N, generator=gen, dtype=torch.float64) * 0.01).to(dtype)
    B = torch.randn(C, N, generator=gen, dtype=torch.float64).to(dtype)
    G[3, N - 1] = float("nan")
    acc = acc_of(dtype)
    lr = torch.tensor([0.1, 0.2, 0.05, 0.3, 0.01], dtype=acc)
    wd = torch.tensor([0.0, 0.01, 0.02, 0.03, 0.5], dtype=acc)
    kw = dict(lr=lr, weight_decay=wd, max_norm=2.0, mode=mode, momentum=momentum)
    X1, B1, X2, B2 = X.clone(), B.clone(), X.clone(), B.clone()
    st = ops.nar_step_batched_(X1, G, momentum_buffers=B1 if momentum else None, backend="cpu", **kw)
    st_r = ref_nar.nar_step_batched_(X2, G, momentum_buffers=B2 if momentum else None, **kw)
    assert st.norm.shape == (C,) and st.skipped.tolist() == [False, False, False, True, False]
    assert_stats_close(st, st_r, dtype)
    assert_bitwise([X1[3], B1[3]], [X[3], B[3]])  # the NaN row is untouched
    for x, y in ((X1, X2), (B1, B2)):
        assert_close_to_ref(x, y)


def test_batched_matches_one_call_per_row():
    C, N = 4, 1025
    gen = torch.Generator().manual_seed(11)
    X = torch.randn(C, N, generator=gen)
    G = torch.randn(C, N, generator=gen)
    X1 = X.clone()
    st = ops.nar_step_batched_(X1, G, lr=torch.tensor(0.1), weight_decay=0.01, max_norm=5.0, backend="cpu")
    for i in range(C):
        row = [X[i].clone()]
        st_i = ops.nar_step_(row, [G[i]], lr=0.1, weight_decay=0.01, max_norm=5.0, backend="cpu")
        assert_bitwise(row + [st_i.norm, st_i.scale], [X1[i], st.norm[i], st.scale[i]])


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_batched_empty(shape):
    X, G = torch.zeros(shape), torch.zeros(shape)
    st = ops.nar_step_batched_(X, G, lr=0.1, max_norm=1.0, backend="cpu")
    assert st.norm.shape == (shape[0],)
    assert st.norm.eq(0).all() and st.scale.eq(1).all() and not st.skipped.any()


# --------------------------------------------------------------------------------------
# aggregate / client_dots


def agg_ours(clients, w, gamma=1.0, out=None):
    return ops.aggregate(clients, w, gamma=gamma, out=out, nonfinite="propagate", backend="cpu")


# A stripe (kernels.h) is 16 chunks of 4096 columns: one exactly, one and a column, and
# 278011 = 4 stripes and a ragged chunk.
AGG_SIZES = [1, 5, 1025, 65536, 65537, 278011]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", AGG_SIZES)
def test_aggregate_list_and_2d_vs_python_ref(dtype, N):
    C = 7
    gen = torch.Generator().manual_seed(12)
    X = torch.randn(C, N, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.rand(C, generator=gen, dtype=torch.float64).to(acc_of(dtype)) + 0.1
    out2d, st2d = agg_ours(X, w, gamma=0.9)
    outl, stl = agg_ours([r.clone() for r in X], w, gamma=0.9)
    assert_bitwise([out2d, st2d.client_sq_norms, st2d.sq_norm], [outl, stl.client_sq_norms, stl.sq_norm])
    out_r, q_r, Q_r = ref_agg.aggregate(X, w, 0.9)
    assert out2d.dtype == dtype
    # Same client order and no FMA: out is python_ref's to the bit.
    assert_bitwise([out2d], [out_r.to(dtype)])
    r = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(st2d.client_sq_norms, q_r, rtol=r, atol=0)
    torch.testing.assert_close(st2d.sq_norm, Q_r, rtol=r, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_aggregate_out_in_acc_dtype_and_gamma_tensor(dtype):
    C, N = 3, 40000  # 3 chunks
    gen = torch.Generator().manual_seed(13)
    X = torch.randn(C, N, generator=gen, dtype=torch.float64).to(dtype)
    acc = acc_of(dtype)
    w = torch.tensor([0.2, 0.5, 0.3], dtype=acc)
    out = torch.full((N,), 7.0, dtype=acc)
    out_ret, st = agg_ours(X, w, gamma=torch.tensor(1.5, dtype=acc), out=out)
    assert out_ret is out
    out_r, q_r, Q_r = ref_agg.aggregate(X, w, 1.5)
    assert_bitwise([out], [out_r])
    out2, _ = agg_ours(X, w, gamma=1.5)
    assert_bitwise([out2], [out_r.to(dtype)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N", [3000, 140001])
def test_aggregate_weight_zero_client_with_nan(dtype, N):
    # Clients 0-3 include a zero weight, so they run one at a time; 4-7 run as four; 8 alone.
    C = 9
    gen = torch.Generator().manual_seed(14)
    X = torch.randn(C, N, generator=gen).to(dtype)
    X[2, ::7] = float("nan")
    X[2, 5] = float("inf")
    w = torch.tensor([0.3, 0.3, 0.0, 0.4, 0.1, 0.2, 0.3, 0.4, 0.5])
    out, st = agg_ours(X, w)
    assert torch.isfinite(out).all()
    q = st.client_sq_norms
    assert math.isnan(float(q[2])) and torch.isfinite(q[[0, 1] + list(range(3, C))]).all()
    out_r, q_r, Q_r = ref_agg.aggregate(X, w)
    assert_bitwise([out], [out_r.to(dtype)])
    torch.testing.assert_close(q, q_r, rtol=1e-5, atol=0, equal_nan=True)
    torch.testing.assert_close(st.sq_norm, Q_r, rtol=1e-5, atol=0)


@pytest.mark.parametrize("as_list", [False, True])
def test_aggregate_skip_flag(as_list):
    C, N = 3, 1025
    X = torch.randn(C, N)
    clients = list(X.unbind(0)) if as_list else [X]
    w = torch.tensor([0.2, 0.3, 0.5])
    out = torch.full((N,), 3.0)
    q, Q = torch.ops.fedopt_C.aggregate(clients, w, 1.0, None, out, torch.tensor(True))
    assert torch.equal(out, torch.full((N,), 3.0))
    assert q.shape == (C,) and q.eq(0).all() and Q.shape == () and float(Q) == 0
    q, Q = torch.ops.fedopt_C.aggregate(clients, w, 1.0, None, out, torch.tensor(False))
    out_r, q_r, Q_r = ref_agg.aggregate(X, w)
    assert_bitwise([out], [out_r])
    torch.testing.assert_close(q, q_r, rtol=1e-5, atol=0)


def test_aggregate_n_zero():
    X = torch.empty(3, 0)
    out, st = agg_ours(X, torch.tensor([0.2, 0.3, 0.5]))
    assert out.shape == (0,) and st.client_sq_norms.eq(0).all() and float(st.sq_norm) == 0
    q, Q = torch.ops.fedopt_C.aggregate([torch.empty(0), torch.empty(0)], torch.tensor([1.0, 1.0]), 1.0, None,
                                        torch.empty(0), None)
    assert q.tolist() == [0.0, 0.0] and float(Q) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g_acc", [False, True], ids=["g_data_dtype", "g_acc_dtype"])
@pytest.mark.parametrize("N", [5, 1025, 65536, 70001])  # 65536: one stripe of whole blocks (g read in place)
def test_client_dots_vs_python_ref(dtype, g_acc, N):
    C = 6
    gen = torch.Generator().manual_seed(15)
    X = torch.randn(C, N, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(N, generator=gen, dtype=torch.float64).to(acc_of(dtype) if g_acc else dtype)
    d = ops.client_dots(X, g, backend="cpu")
    d_list = ops.client_dots([r.clone() for r in X], g, backend="cpu")
    assert d.dtype == acc_of(dtype) and d.shape == (C,)
    assert_bitwise([d], [d_list])
    d_r = ref_agg.client_dots(X, g)
    # Relative to the terms' magnitude (the dots themselves may cancel).
    scale = (X.double().abs() * g.double().abs()).sum(dim=1)
    tol = (1e-12 if dtype == torch.float64 else 1e-6) * scale
    assert ((d.double() - d_r.double()).abs() <= tol).all()


# --------------------------------------------------------------------------------------
# determinism


def _exact_rand(shape, gen, dtype):
    """Random values in [-2, 2) with 21 fractional bits: exact in fp32, so every
    instruction set draws the same data (torch.randn's own kernels differ in the last
    bits between its AVX2 and DEFAULT builds)."""
    return (torch.randint(-(2 ** 22), 2 ** 22, shape, generator=gen, dtype=torch.int64).double() / 2 ** 21).to(dtype)


def _all_results(dtype):
    """Every op on data spanning several chunks, returned as one list of tensors."""
    gen = torch.Generator().manual_seed(16)
    shapes = [(300000,), (5,), (64, 32, 3, 3), (1025,), (200000,)]
    params = [_exact_rand(s, gen, dtype) for s in shapes]
    grads = [_exact_rand(s, gen, dtype) for s in shapes]
    bufs = [_exact_rand(s, gen, dtype) for s in shapes]
    out = []
    for mode in MODES:
        p, b = clone(params), clone(bufs)
        st = ops.nar_step_(p, grads, lr=0.1, weight_decay=0.01, max_norm=3.0, mode=mode, momentum=0.9,
                           momentum_buffers=b, backend="cpu")
        out += p + b + list(st)
    X = _exact_rand((4, 150001), gen, dtype)
    G = _exact_rand((4, 150001), gen, dtype)
    Xb = X.clone()
    out += [Xb] + list(ops.nar_step_batched_(Xb, G, lr=torch.tensor([0.1, 0.2, 0.3, 0.4]), max_norm=2.0,
                                             backend="cpu"))
    agg, st = ops.aggregate(X, torch.tensor([0.1, 0.2, 0.3, 0.4]), nonfinite="propagate", backend="cpu")
    out += [agg, st.client_sq_norms, st.sq_norm]
    out.append(ops.client_dots(X, G[0], backend="cpu"))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_results_independent_of_thread_count(dtype, threads):
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(_all_results(dtype))
    for other in results[1:]:
        assert_bitwise(results[0], other)


@x86_only
def test_results_independent_of_instruction_set():
    """The DEFAULT (SSE2), AVX2 and AVX-512 builds of the kernels give the same bits:
    the same 32-lane reduction layout and no FMA in any of them."""
    outputs = results_per_isa("test_cpu_kernels", "_all_results")
    levels = list(outputs)
    for level in levels[1:]:
        assert outputs[level] == outputs[levels[0]], f"{level} differs from {levels[0]}"


# --------------------------------------------------------------------------------------
# the build


def test_cpu_isa_follows_torch():
    """The kernels run the instruction set torch's own CPU kernels use."""
    isa = torch.ops.fedopt_C.cpu_isa()
    expected = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in ("x86_64", "amd64") and expected in ("DEFAULT", "AVX2", "AVX512"):
        assert isa == expected
    else:
        assert isa == "DEFAULT"


def _extension_path():
    import fedopt_kernels._C as ext

    return ext.__file__


_ISA_NAMESPACE = re.compile(r"\bAVX(2|512)\b")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 instruction sets")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_avx_code_only_in_per_isa_namespaces():
    """Only the per-ISA kernels may contain VEX/EVEX (AVX) instructions; anything else
    compiled for AVX (e.g. a shared inline function whose AVX2 copy the linker kept)
    would crash on a CPU without AVX2."""
    dump = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", _extension_path()], capture_output=True,
                          text=True, check=True).stdout
    func, offenders, n_avx, default_avx = None, set(), 0, False
    for line in dump.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            func = m.group(1)
            continue
        parts = line.split("\t")
        if len(parts) < 2 or func is None:
            continue
        mnemonic = parts[1].split()[0] if parts[1].split() else ""
        if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
            if _ISA_NAMESPACE.search(func):
                n_avx += 1
            else:
                offenders.add(func)
                default_avx = default_avx or "::DEFAULT::" in func
    if default_avx:
        pytest.skip("the whole library was compiled for an AVX target (e.g. CFLAGS=-march=native): "
                    "it needs such a CPU anyway")
    assert n_avx > 0, "no AVX code at all: were the AVX2/AVX-512 kernels compiled?"
    assert not offenders, f"AVX instructions outside the per-ISA kernels: {sorted(offenders)[:10]}"


def test_raw_ops_check_what_would_be_memory_unsafe():
    p, g = [torch.zeros(5)], [torch.zeros(4)]
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.nar_step_(p, g, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    with pytest.raises(RuntimeError, match="grads"):
        torch.ops.fedopt_C.nar_step_(p, [], [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    with pytest.raises(RuntimeError, match="momentum_buffers"):
        torch.ops.fedopt_C.nar_step_(p, [torch.zeros(5)], [], 0.1, None, 0.0, None, 1.0, 0, 0.9, None, None)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.fedopt_C.nar_step_(p, [torch.zeros(5, dtype=torch.float64)], [], 0.1, None, 0.0, None, 1.0, 0,
                                     0.0, None, None)
    with pytest.raises(RuntimeError, match="dense"):
        torch.ops.fedopt_C.nar_step_([torch.zeros(10)[::2]], [torch.zeros(5)], [], 0.1, None, 0.0, None, 1.0, 0,
                                     0.0, None, None)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.nar_step_batched_(torch.zeros(2, 3), torch.zeros(2, 3), None, 0.1, torch.zeros(3), 0.0,
                                             None, 1.0, 0, 0.0, None, None)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.aggregate([torch.zeros(2, 3)], torch.ones(3), 1.0, None, torch.zeros(3), None)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.aggregate([torch.zeros(2, 3)], torch.ones(2), 1.0, None, torch.zeros(4), None)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.client_dots([torch.zeros(3), torch.zeros(4)], torch.zeros(3))
