"""Triton-specific checks of the ``triton`` backend against python_ref.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py
sets TRITON_INTERPRET=1 before any kernel is defined); with one they run compiled on
CUDA tensors.  Everything goes through the public ops with ``backend="triton"``.

Interpreter notes: it converts fp32 -> bf16 by truncation (the GPU rounds to nearest),
so bf16 results may differ from python_ref by one bf16 ulp here, inside the default
bf16 tolerance of ``torch.testing.assert_close``.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import python_ref.aggregation as ref_agg
import python_ref.fednar as ref_nar
from conftest import import_triton_module
from fedopt_kernels import ops

TB = import_triton_module("fedopt_kernels.backends.triton")
_tables = importlib.import_module("fedopt_kernels.backends.triton._tables")
_chunks = importlib.import_module("fedopt_kernels.backends._chunks")
_nar_kernels = importlib.import_module("fedopt_kernels.backends.triton.nar_step")
_agg_kernels = importlib.import_module("fedopt_kernels.backends.triton.aggregate")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["co", "grad", "none"]
ODD_SHAPES = [(1,), (5,), (0,), (1025,), (7, 13), (278011,)]


@pytest.fixture(scope="module")
def dev(triton_device):
    return triton_device


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # every test sees the same data whatever the order


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def make(shapes, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(dtype).to(device) for s in shapes]


def clone(ts):
    return [t.clone() for t in ts]


def stats_close(st, st_ref, rtol=2e-5):
    torch.testing.assert_close(st.norm.cpu(), st_ref.norm.cpu(), rtol=rtol, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(st.scale.cpu(), st_ref.scale.cpu(), rtol=rtol, atol=1e-7, equal_nan=True)
    assert st.skipped.dtype == torch.bool
    assert st.skipped.cpu().tolist() == torch.as_tensor(st_ref.skipped).cpu().tolist()


def run_nar(params, grads, bufs, **kw):
    """The triton backend and python_ref on copies; returns ((p, b, stats), (p, b, stats))."""
    mom = kw.get("momentum", 0.0) != 0.0
    p_t, b_t, p_r, b_r = clone(params), clone(bufs), clone(params), clone(bufs)
    st_t = ops.nar_step_(p_t, grads, momentum_buffers=b_t if mom else None, backend="triton", **kw)
    st_r = ref_nar.nar_step_(p_r, grads, momentum_buffers=b_r if mom else None, **kw)
    return (p_t, b_t, st_t), (p_r, b_r, st_r)


def check_nar(res, ref, dtype):
    (p_t, b_t, st_t), (p_r, b_r, st_r) = res, ref
    stats_close(st_t, st_r)
    assert st_t.norm.dim() == 0 and st_t.norm.dtype == ref_nar.compute_dtype(dtype)
    for a, b in zip(p_t + b_t, p_r + b_r):
        assert a.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a.cpu(), b.cpu())


# ----------------------------------------------------------------------------- nar_step_

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_odd_sizes(dev, dtype, mode, momentum):
    shapes = ODD_SHAPES if dtype == torch.float32 else ODD_SHAPES[:-1] + [(30011,)]
    params, grads, bufs = make(shapes, dtype, dev, 1), make(shapes, dtype, dev, 2), make(shapes, dtype, dev, 3)
    res, ref = run_nar(params, grads, bufs, lr=0.05, weight_decay=0.01, max_norm=10.0, mode=mode,
                       momentum=momentum)
    check_nar(res, ref, dtype)
    if mode != "none":
        assert float(res[2].scale) < 1.0  # really clipped


@pytest.mark.parametrize("mode", MODES)
def test_nar_step_float64(dev, mode):
    shapes = [(3,), (2049,), (5, 7)]
    params, grads, bufs = (make(shapes, torch.float64, dev, s) for s in (4, 5, 6))
    res, ref = run_nar(params, grads, bufs, lr=0.1, weight_decay=0.3, max_norm=2.0, mode=mode, momentum=0.5)
    (p_t, b_t, st_t), (p_r, b_r, st_r) = res, ref
    torch.testing.assert_close(st_t.norm, st_r.norm, rtol=1e-13, atol=0)
    for a, b in zip(p_t + b_t, p_r + b_r):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("clipped", [False, True])
def test_nar_step_below_and_above_max_norm(dev, clipped):
    params, grads = make([(3000,)], torch.float32, dev, 7), make([(3000,)], torch.float32, dev, 8, 0.01)
    res, ref = run_nar(params, grads, [], lr=0.1, weight_decay=0.1, max_norm=0.01 if clipped else 100.0)
    check_nar(res, ref, torch.float32)
    assert (float(res[2].scale) < 1.0) == clipped


def test_nar_step_tensor_lr_and_weight_decay(dev):
    shapes = [(100,), (3, 7), (2500,)]
    params, grads, bufs = make(shapes, torch.float32, dev, 9), make(shapes, torch.float32, dev, 10), \
        make(shapes, torch.float32, dev, 11)
    lr, wd = torch.tensor(0.05, device=dev), torch.tensor(0.02, device=dev)
    res, ref = run_nar(params, grads, bufs, lr=lr, weight_decay=wd, max_norm=1.0, momentum=0.9)
    check_nar(res, ref, torch.float32)
    # same bits as the float form: a tensor lr is loaded in-kernel, a float one is an argument
    p_f, b_f = clone(params), clone(bufs)
    st_f = ops.nar_step_(p_f, grads, lr=0.05, weight_decay=0.02, max_norm=1.0, momentum=0.9,
                         momentum_buffers=b_f, backend="triton")
    assert torch.equal(st_f.norm, res[2].norm)
    assert all(torch.equal(a, b) for a, b in zip(p_f + b_f, res[0] + res[1]))


@pytest.mark.parametrize("scale", [1024.0, 3.0])
def test_nar_step_grad_scale(dev, scale):
    shapes = [(50,), (4, 4), (4099,)]
    params, grads = make(shapes, torch.float32, dev, 12), make(shapes, torch.float32, dev, 13)
    scaled = [g * scale for g in grads]
    gs, fi = torch.tensor(scale, device=dev), torch.tensor(0.0, device=dev)
    res, ref = run_nar(params, scaled, [], lr=0.1, weight_decay=0.01, max_norm=1.0, grad_scale=gs, found_inf=fi)
    check_nar(res, ref, torch.float32)


def test_nar_step_found_inf_skips_bit_identical(dev):
    shapes = [(50,), (4099,)]
    params, grads, bufs = (make(shapes, torch.float32, dev, s) for s in (14, 15, 16))
    p, b = clone(params), clone(bufs)
    st = ops.nar_step_(p, grads, lr=0.1, weight_decay=0.01, max_norm=1.0, momentum=0.9, momentum_buffers=b,
                       grad_scale=torch.tensor(2.0, device=dev), found_inf=torch.tensor(1.0, device=dev),
                       backend="triton")
    assert bool(st.skipped) and math.isfinite(float(st.norm))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(p + b, params + bufs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nar_step_nonfinite_skip_bit_identical(dev, dtype, mode, bad):
    shapes = [(17,), (9000,), (3, 3)]
    params, grads, bufs = (make(shapes, dtype, dev, s) for s in (17, 18, 19))
    grads[1][8191] = bad  # in the middle of the second chunk's block: only one partial sees it
    p, b = clone(params), clone(bufs)
    res, ref = run_nar(params, grads, bufs, lr=0.1, weight_decay=0.01, max_norm=1.0, mode=mode, momentum=0.5)
    st = res[2]
    assert bool(st.skipped) and not math.isfinite(float(st.norm))
    stats_close(st, ref[2])  # the scale statistic too (NaN for a NaN norm, as python_ref)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(res[0] + res[1], p + b))


def test_nar_step_all_empty_and_empty_mixed(dev):
    params = [torch.empty(0, device=dev), torch.empty(2, 0, device=dev)]
    grads = clone(params)
    st = ops.nar_step_(params, grads, lr=0.1, weight_decay=0.1, max_norm=1.0, backend="triton")
    assert float(st.norm) == 0.0 and float(st.scale) == 1.0 and not bool(st.skipped)
    assert st.norm.dim() == 0
    st = ops.nar_step_(params, grads, lr=0.1, weight_decay=0.1, max_norm=1e-7, backend="triton",
                       found_inf=torch.tensor(1.0, device=dev))
    st_r = ref_nar.nar_step_(params, grads, lr=0.1, weight_decay=0.1, max_norm=1e-7,
                             found_inf=torch.tensor(1.0, device=dev))
    stats_close(st, st_r)


def test_nar_step_channels_last(dev):
    x = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last).to(dev)
    g = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last).to(dev)
    res, ref = run_nar([x], [g], [], lr=0.1, weight_decay=0.01, max_norm=1.0)
    check_nar(res, ref, torch.float32)


def test_nar_step_deterministic_bitwise(dev):
    shapes = [(278011,), (1025,), (64, 3, 3, 3)]
    params, grads, bufs = (make(shapes, torch.float32, dev, s) for s in (20, 21, 22))
    out = []
    for _ in range(2):
        p, b = clone(params), clone(bufs)
        st = ops.nar_step_(p, grads, lr=0.01, weight_decay=1e-3, max_norm=1.0, momentum=0.9, momentum_buffers=b,
                           backend="triton")
        out.append((p, b, st))
    (p1, b1, s1), (p2, b2, s2) = out
    assert torch.equal(bits(s1.norm), bits(s2.norm)) and torch.equal(bits(s1.scale), bits(s2.scale))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(p1 + b1, p2 + b2))


def test_nar_step_finalize_path_same_bits(dev, monkeypatch):
    """More partials than MAX_REDUNDANT_PARTIALS: a finalize kernel sums them once, in the
    same order as the redundant combine, so the bits do not change."""
    shapes = [(40000,), (5,), (20000,)]
    params, grads, bufs = (make(shapes, torch.float32, dev, s) for s in (23, 24, 25))
    runs = []
    for limit in (_chunks.MAX_REDUNDANT_PARTIALS, 0):
        monkeypatch.setattr(_chunks, "MAX_REDUNDANT_PARTIALS", limit)
        p, b = clone(params), clone(bufs)
        st = ops.nar_step_(p, grads, lr=0.01, weight_decay=1e-3, max_norm=1.0, momentum=0.9, momentum_buffers=b,
                           backend="triton")
        runs.append((p, b, st))
    assert torch.equal(bits(runs[0][2].norm), bits(runs[1][2].norm))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]))


def test_nar_step_batched_finalize_path_same_bits(dev, monkeypatch):
    """The table-free [C, N] form through the finalize pass (each row's partials are
    [r * row_chunks, (r + 1) * row_chunks): no group table exists) gives the bits of the
    redundant combine, per-row lr included."""
    X = make([(3, 9001)], torch.float32, dev, 28)[0]
    G = make([(3, 9001)], torch.float32, dev, 29)[0]
    lr = torch.tensor([0.01, 0.02, 0.03], device=dev)
    runs = []
    for limit in ("1000000", "0"):
        monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", limit)
        Xs, B = X.clone(), torch.zeros_like(X)
        st = ops.nar_step_batched_(Xs, G, lr=lr, weight_decay=1e-3, max_norm=1.0, momentum=0.9,
                                   momentum_buffers=B, backend="triton")
        runs.append((Xs, B, st))
    (x1, b1, s1), (x2, b2, s2) = runs
    assert torch.equal(bits(s1.norm), bits(s2.norm)) and torch.equal(bits(s1.scale), bits(s2.scale))
    assert torch.equal(bits(x1), bits(x2)) and torch.equal(bits(b1), bits(b2))
    assert not torch.equal(x1, X) and (s1.scale < 1).all()  # stepped and clipped


def test_nar_step_misaligned_view_only_costs_its_own_chunks(dev):
    """Vector width is decided per chunk: a view 4 bytes past a 16-byte boundary gets
    the scalar body on its chunks only; an aligned tensor of the same call keeps the
    vector body (flag bit 0 of its rows)."""
    base_x, base_g = torch.randn(10001, device=dev), torch.randn(10001, device=dev)
    x, g = base_x[1:], base_g[1:]  # 4 bytes past a 16-byte boundary
    assert x.data_ptr() % 16 == 4
    y, gy = torch.randn(5000, device=dev), torch.randn(5000, device=dev)
    table = _tables.nar_table([x, y], [g, gy], [])
    flags = table.chunks[:, _chunks.COL_FLAGS].tolist()
    assert flags == [0] * 5 + [_chunks.FLAG_ALIGNED16] * 3, flags  # 10000 -> 5 chunks, 5000 -> 3
    assert _tables.nar_table([x], [g.clone()], []).chunks[:, _chunks.COL_FLAGS].eq(0).all()
    res, ref = run_nar([x, y], [g, gy], [], lr=0.1, weight_decay=0.01, max_norm=1.0)
    check_nar(res, ref, torch.float32)
    # the view was updated in place; the element before it is untouched
    before = float(base_x[0])
    ops.nar_step_([x, y], [g, gy], lr=0.1, weight_decay=0.01, max_norm=1.0, backend="triton")
    assert torch.equal(base_x[1:], res[0][0]) and float(base_x[0]) == before


def test_table_cache_hit_and_layout(dev):
    _tables.clear_cache()
    shapes = [(2048 * 3 + 1,), (0,), (7,)]
    params, grads = make(shapes, torch.float32, dev, 26), make(shapes, torch.float32, dev, 27)
    t1 = _tables.nar_table(params, grads, [])
    t2 = _tables.nar_table(params, grads, [])
    assert t1 is t2 and _tables.stats["hits"] == 1 and _tables.stats["misses"] == 1
    ch = t1.chunks.cpu()
    assert t1.chunk_size == 2048 and t1.n_chunks == 5 and ch.shape == (5, _chunks.ROW_COLS)
    assert ch[:, _chunks.COL_LEN].tolist() == [2048, 2048, 2048, 1, 7]
    assert ch[3, 0] == params[0].data_ptr() + 3 * 2048 * 4 and ch[4, 1] == grads[2].data_ptr()
    assert (ch[:, 2] == 0).all() and (ch[:, 3] == 0).all()  # no momentum buffer, no 4th array
    assert (ch[:, _chunks.COL_GROUP] == 0).all() and t1.groups.tolist() == [[0, 5]]


def test_float_hyperparameters_are_runtime_fp64_args():
    """Float hyperparameters are declared fp64 (never value-specialized, never constexpr):
    a new lr reuses the compiled kernel."""
    for kernel, names in [(_nar_kernels.nar_update_kernel, ["lr_value", "wd_value", "max_norm", "momentum"]),
                          (_nar_kernels.nar_norm_kernel, ["wd_value"]),
                          (_agg_kernels.aggregate_kernel, ["gamma_value"])]:
        fn = getattr(kernel, "fn", kernel)
        ann = {k: str(v) for k, v in fn.__annotations__.items()}
        for n in names:
            assert "fp64" in ann[n] or "float64" in ann[n], (kernel, n, ann[n])
            assert "constexpr" not in ann[n]


# ----------------------------------------------------------------------------- batched

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_nar_step_batched_per_row_lr_and_nan_row(dev, dtype, mode):
    C, N = 4, 10007
    g = torch.Generator().manual_seed(28)
    X = torch.randn(C, N, generator=g).to(dtype).to(dev)
    G = (torch.randn(C, N, generator=g) * torch.tensor([[0.001], [1.0], [100.0], [3.0]])).to(dtype).to(dev)
    G[2, 9000] = float("nan")
    B = torch.randn(C, N, generator=g).to(dtype).to(dev)
    lr = torch.tensor([0.1, 0.01, 0.5, 0.2], device=dev)
    wd = torch.tensor(0.01, device=dev)
    Xt, Bt, Xr, Br = X.clone(), B.clone(), X.clone(), B.clone()
    st = ops.nar_step_batched_(Xt, G, lr=lr, weight_decay=wd, max_norm=1.0, mode=mode, momentum=0.9,
                               momentum_buffers=Bt, backend="triton")
    st_r = ref_nar.nar_step_batched_(Xr, G, lr=lr, weight_decay=wd, max_norm=1.0, mode=mode, momentum=0.9,
                                     momentum_buffers=Br)
    assert st.norm.shape == (C,) and st.skipped.tolist() == [False, False, True, False]
    stats_close(st, st_r)
    torch.testing.assert_close(Xt.cpu(), Xr.cpu())
    torch.testing.assert_close(Bt.cpu(), Br.cpu())
    assert torch.equal(bits(Xt[2]), bits(X[2])) and torch.equal(bits(Bt[2]), bits(B[2]))


def test_nar_step_batched_per_row_weight_decay_no_momentum(dev):
    C, N = 3, 20000  # several chunks per row
    X, G = torch.randn(C, N, device=dev), torch.randn(C, N, device=dev)
    wd = torch.tensor([0.0, 0.1, 1.0], device=dev)
    Xt, Xr = X.clone(), X.clone()
    st = ops.nar_step_batched_(Xt, G, lr=0.1, weight_decay=wd, max_norm=50.0, backend="triton")
    st_r = ref_nar.nar_step_batched_(Xr, G, lr=0.1, weight_decay=wd, max_norm=50.0)
    stats_close(st, st_r)
    torch.testing.assert_close(Xt, Xr)
    # table-free: nothing was built or looked up (capturable on any stream)
    _tables.clear_cache()
    ops.nar_step_batched_(X.clone(), G, lr=0.1, weight_decay=wd, max_norm=50.0, backend="triton")
    assert _tables.stats["hits"] == 0 and _tables.stats["misses"] == 0


def test_nar_step_batched_empty(dev):
    for shape in [(3, 0), (0, 5)]:
        X = torch.empty(shape, device=dev)
        st = ops.nar_step_batched_(X, X.clone(), lr=0.1, max_norm=1.0, backend="triton")
        st_r = ref_nar.nar_step_batched_(X.clone(), X.clone(), lr=0.1, weight_decay=0.0, max_norm=1.0)
        assert st.norm.shape == (shape[0],)
        stats_close(st, st_r)


# ----------------------------------------------------------------------------- aggregate

def run_agg(clients, w, gamma=1.0, out=None, **kw):
    out_t = None if out is None else out.clone()
    o_t, st_t = ops.aggregate(clients, w, gamma=gamma, out=out_t, nonfinite="propagate", backend="triton", **kw)
    o_r, q_r, Q_r = ref_agg.aggregate(clients, w, gamma)
    return o_t, st_t, o_r, q_r, Q_r


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("as_list", [False, True], ids=["2d", "list"])
@pytest.mark.parametrize("N", [1, 5, 1025, 278011])
def test_aggregate_matches_reference(dev, dtype, as_list, N):
    if N == 278011 and dtype != torch.float32:
        N = 30011
    C = 3
    X = torch.randn(C, N, generator=torch.Generator().manual_seed(N)).to(dtype).to(dev)
    clients = list(X.clone().unbind(0)) if as_list else X
    w = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=dev)
    o_t, st, o_r, q_r, Q_r = run_agg(clients, w, gamma=0.9)
    assert o_t.dtype == dtype and o_t.shape == (N,)
    torch.testing.assert_close(o_t.cpu(), o_r.to(dtype).cpu())
    torch.testing.assert_close(st.client_sq_norms.cpu(), q_r.cpu(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(st.sq_norm.cpu(), Q_r.cpu(), rtol=2e-5, atol=1e-6)
    assert st.client_sq_norms.dtype == ref_nar.compute_dtype(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_aggregate_out_in_acc_dtype_and_tensor_gamma(dev, dtype):
    X = torch.randn(4, 5003, device=dev).to(dtype)
    w = torch.tensor([0.1, 0.2, 0.3, 0.4], device=dev)
    out = torch.full((5003,), 7.0, device=dev)
    gamma = torch.tensor(1.25, device=dev)
    o_t, st, o_r, q_r, Q_r = run_agg(X, w, gamma=gamma, out=out)
    assert o_t.dtype == torch.float32
    torch.testing.assert_close(o_t, o_r, rtol=1e-6, atol=1e-6)


def test_aggregate_weight_zero_nan_client(dev):
    X = torch.randn(3, 4099, device=dev)
    X[1, 17] = float("nan")
    X[1, 4098] = float("inf")
    w = torch.tensor([0.6, 0.0, 0.4], device=dev)
    for clients in (X, list(X.unbind(0))):
        o_t, st, o_r, q_r, Q_r = run_agg(clients, w)
        assert bool(torch.isfinite(o_t).all())
        torch.testing.assert_close(o_t, o_r)
        q = st.client_sq_norms
        assert math.isnan(float(q[1])) and math.isfinite(float(q[0])) and math.isfinite(float(st.sq_norm))
        torch.testing.assert_close(q, q_r, equal_nan=True, rtol=2e-5, atol=0)
    # the default nonfinite="exclude" re-runs with skip=(no weight changed), read in-kernel
    o_e, st_e = ops.aggregate(X, torch.tensor([0.6, 0.2, 0.2], device=dev), backend="triton")
    o_x, st_x = ops.aggregate(X, torch.tensor([0.6, 0.2, 0.2], device=dev), backend="reference")
    assert st_e.excluded.tolist() == [False, True, False]
    torch.testing.assert_close(o_e, o_x)
    torch.testing.assert_close(st_e.sq_norm, st_x.sq_norm, rtol=2e-5, atol=0)


def test_aggregate_skip_flag(dev):
    X = torch.randn(2, 3001, device=dev)
    w = torch.tensor([0.5, 0.5], device=dev)
    for flag in (False, True):
        out = torch.full((3001,), 3.0, device=dev)
        before = out.clone()
        q, Q = TB.aggregate(X, w, 2.0, out, torch.tensor(flag, device=dev))
        if not flag:
            ref_out, q_r, Q_r = ref_agg.aggregate(X, w, 2.0)
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(q, q_r, rtol=2e-5, atol=0)
            torch.testing.assert_close(Q, Q_r, rtol=2e-5, atol=0)
        else:
            assert torch.equal(bits(out), bits(before))
            assert q.tolist() == [0.0, 0.0] and float(Q) == 0.0
        assert q.shape == (2,) and Q.dim() == 0


def test_aggregate_empty_clients(dev):
    X = torch.empty(3, 0, device=dev)
    o_t, st = ops.aggregate(X, torch.tensor([1.0, 2.0, 3.0], device=dev), nonfinite="propagate", backend="triton")
    assert o_t.shape == (0,)
    assert st.client_sq_norms.tolist() == [0.0, 0.0, 0.0] and float(st.sq_norm) == 0.0


def test_aggregate_misaligned_client_view(dev):
    base = torch.randn(3, 5000, device=dev)
    clients = [base[0, 1:], base[1, 1:], base[2, :4999]]  # two start 4 bytes past 16
    flags = _tables.client_table(clients).addrs[:, 1].tolist()
    assert flags == [0, 0, _chunks.FLAG_ALIGNED16]  # decided per client
    w = torch.tensor([0.2, 0.3, 0.5], device=dev)
    o_t, st, o_r, q_r, Q_r = run_agg(clients, w)
    torch.testing.assert_close(o_t, o_r)
    torch.testing.assert_close(st.client_sq_norms, q_r, rtol=2e-5, atol=0)


def test_aggregate_deterministic_bitwise(dev):
    X = torch.randn(5, 100003, device=dev)
    w = torch.rand(5, device=dev) + 0.1
    r1 = ops.aggregate(X, w, gamma=0.7, backend="triton")
    r2 = ops.aggregate(X, w, gamma=0.7, backend="triton")
    assert torch.equal(bits(r1[0]), bits(r2[0]))
    assert torch.equal(bits(r1[1].client_sq_norms), bits(r2[1].client_sq_norms))
    assert torch.equal(bits(r1[1].sq_norm), bits(r2[1].sq_norm))


# ----------------------------------------------------------------------------- client_dots

@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("as_list", [False, True], ids=["2d", "list"])
def test_client_dots(dev, dtype, as_list):
    C, N = 4, 10007
    X = torch.randn(C, N, generator=torch.Generator().manual_seed(29)).to(dtype).to(dev)
    g = torch.randn(N, dtype=ref_nar.compute_dtype(dtype), device=dev)
    clients = list(X.unbind(0)) if as_list else X
    for gg in (g, g.to(dtype)):
        d = ops.client_dots(clients, gg, backend="triton")
        assert d.shape == (C,) and d.dtype == ref_nar.compute_dtype(dtype)
        # against the exact dot of the same inputs, within a summation-error bound (the
        # fp32 oracle itself is off by ~1e-6 * sum|x g| on 10^4 terms)
        prod = X.cpu().double() * gg.cpu().double()
        bound = (1e-6 if d.dtype == torch.float32 else 1e-14) * prod.abs().sum(1)
        assert bool(((d.cpu().double() - prod.sum(1)).abs() <= bound).all()), (d, prod.sum(1))
        torch.testing.assert_close(d, ref_agg.client_dots(clients, gg), rtol=1e-4, atol=1e-3)


def test_client_dots_empty_and_deterministic(dev):
    X = torch.empty(2, 0, device=dev)
    assert ops.client_dots(X, torch.empty(0, device=dev), backend="triton").tolist() == [0.0, 0.0]
    X = torch.randn(3, 50001, device=dev)
    g = torch.randn(50001, device=dev)
    d1 = ops.client_dots(X, g, backend="triton")
    d2 = ops.client_dots(list(X.unbind(0)), g, backend="triton")
    assert torch.equal(bits(d1), bits(d2))


def test_weighted_sum_gradients(dev):
    X = torch.randn(3, 2049, device=dev)
    w = torch.tensor([0.2, 0.3, 0.5], device=dev, requires_grad=True)
    gamma = torch.tensor(0.9, device=dev, requires_grad=True)
    G = torch.randn(2049, device=dev)
    out = ops.weighted_sum(X, w, gamma, backend="triton")
    (out * G).sum().backward()
    gw, gg = ref_agg.weighted_sum_backward(X, w.detach(), gamma.detach(), G)
    torch.testing.assert_close(w.grad, gw, rtol=1e-4, atol=1e-3)  # dots of ~2000 terms in fp32
    torch.testing.assert_close(gamma.grad, gg, rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------- CUDA only

@pytest.mark.cuda
def test_no_host_sync_on_cuda(dev):
    if dev.type != "cuda":
        pytest.skip("needs the compiled kernels on a CUDA device")
    params = [torch.randn(1000, device=dev), torch.randn(3, 3, device=dev)]
    grads = [torch.randn_like(p) for p in params]
    X = torch.randn(3, 1000, device=dev)
    w = torch.tensor([0.2, 0.3, 0.5], device=dev)
    lr, flag, g = torch.tensor(0.2, device=dev), torch.tensor(False, device=dev), torch.randn(1000, device=dev)
    # warm up (compiles the kernels and builds the tables), then no call may synchronise
    TB.nar_step_(params, grads, [], 0.1, 0.01, 1.0, 0, 0.0, None, None)
    TB.nar_step_(params, grads, [], lr, 0.01, 1.0, 0, 0.0, None, None)
    TB.aggregate(X, w, 1.0, torch.empty(1000, device=dev), flag)
    TB.client_dots(X, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TB.nar_step_(params, grads, [], lr, 0.01, 1.0, 0, 0.0, None, None)
        TB.nar_step_(params, grads, [], 0.3, 0.01, 1.0, 0, 0.0, None, None)
        TB.aggregate(X, w, 1.0, torch.empty(1000, device=dev), flag)
        TB.client_dots(X, g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
