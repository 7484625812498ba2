"""The backend contract of FedNAR -- ``nar_step_``, ``nar_sq_norm`` and
``nar_step_batched_`` -- run against every backend (reference, cpu, triton, cuda)
through the backend module itself (fedopt_kernels/backends/__init__.py), against
python_ref.

Paths reached on purpose: odd sizes and empty tensors (vector tails, chunk tails, the
stats-only call), several chunks per tensor and many tensors per call, views at odd
offsets among aligned tensors (the scalar bodies), channels-last tensors, non-finite
gradients and parameters, GradScaler's scale and flag in every dtype a flag comes in,
float and tensor hyperparameters, the finalize pass of groups with many partials, and
the ``[C, N]`` rows with per-row hyperparameters and a NaN row.  Sizes (full and
small) and the tolerances per backend: tests/_contract.py.  What only one backend has
(ISA dispatch and thread counts, Triton tables and AOT, the CUDA extension's build and
launch rules) stays in tests/test_cpu_kernels.py, test_triton_kernels.py and
test_cuda_extension.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import python_ref.fednar as ref_nar
from _contract import (DTYPES, LOW, MODES, acc_of, assert_bitwise, assert_norms_close, assert_stats_close,
                       assert_values_close, clone, guards_untouched, make_lists, randn, same_bits, stats,
                       views_at_offset)
from _server_update_oracle import sqrt_rn


@pytest.fixture
def be(backend_impl):
    return backend_impl


def run_nar(be, params, grads, bufs, *, lr, wd, max_norm, mode, momentum=0.0, grad_scale=None, found_inf=None):
    """The backend and python_ref on copies of the same data: ((p, b, stats), (p, b, stats))."""
    p, b, p_r, b_r = clone(params), clone(bufs), clone(params), clone(bufs)
    st = stats(be.nar_step_(p, grads, b if momentum else [], lr, wd, max_norm, MODES[mode], momentum, grad_scale,
                            found_inf))
    st_r = ref_nar.nar_step_(p_r, grads, lr=lr, weight_decay=wd, max_norm=max_norm, mode=mode, momentum=momentum,
                             momentum_buffers=b_r if momentum else None, grad_scale=grad_scale, found_inf=found_inf)
    return (p, b, st), (p_r, b_r, st_r)


def check_nar(be, res, ref, dtype, *, magnitude=None):
    (p, b, st), (p_r, b_r, st_r) = res, ref
    assert_stats_close(be, st, st_r, dtype)
    for x, y in zip(p + b, p_r + b_r):
        assert x.dtype == dtype and x.device.type == be.device.type and x.shape == y.shape
    if magnitude is not None:  # one floor for every tensor: the same elementwise checks, in one call
        assert_values_close(be, torch.cat([x.reshape(-1) for x in p + b]),
                            torch.cat([y.reshape(-1) for y in p_r + b_r]), magnitude=magnitude)
        return
    for x, y in zip(p + b, p_r + b_r):
        assert_values_close(be, x, y, magnitude=magnitude)


def step(be, params, grads, bufs, lr, wd, max_norm, mode, momentum, grad_scale=None, found_inf=None):
    """The backend alone on copies: (params, bufs, stats)."""
    p, b = clone(params), clone(bufs)
    st = stats(be.nar_step_(p, grads, b if momentum else [], lr, wd, max_norm, MODES[mode], momentum, grad_scale,
                            found_inf))
    return p, b, st


# ----------------------------------------------------------------------------- nar_step_

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_odd_sizes(be, dtype, mode, momentum):
    # Several chunks / threads, a ragged tail (Triton's fp32 interpreted at full size, as ever).
    big = be.size(278011, 278011 if dtype == torch.float32 and be.interpreted else 30011)
    shapes = [(1,), (0,), (5,), (1025,), (3, 0, 2), (7, 13), (big,)]
    params, grads, bufs = make_lists(shapes, dtype, be.device, seed=1)
    res, ref = run_nar(be, params, grads, bufs, lr=0.05, wd=0.01, max_norm=10.0, mode=mode, momentum=momentum)
    check_nar(be, res, ref, dtype)
    if mode != "none":  # really clipped: ||.|| ~ sqrt(elements) >> 10 (< 0.05 at 278011)
        assert float(res[2].scale) < 1.2 * 10.0 / math.sqrt(sum(p.numel() for p in params))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_unclipped(be, dtype, mode, momentum):
    """Below max_norm (or mode none) the scale is exactly 1; where the backend rounds as
    python_ref does (no FMA, same operation order) the step is python_ref's to the bit."""
    shapes = [(1,), (5,), (1025,), (be.size(278011, 10007),)]
    params, grads, bufs = make_lists(shapes, dtype, be.device, seed=2, gscale=1e-3, pscale=0.5)
    res, ref = run_nar(be, params, grads, bufs, lr=0.1, wd=0.05, max_norm=1e6, mode=mode, momentum=momentum)
    assert float(res[2].scale) == 1.0 and float(ref[2].scale) == 1.0
    check_nar(be, res, ref, dtype)
    if be.rounds_like_python_ref:
        assert_bitwise(res[0] + res[1], ref[0] + ref[1])


@pytest.mark.parametrize("mode", ["co", "grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_nar_step_below_and_above_max_norm(be, mode, dtype):
    params, grads, bufs = make_lists([(1000,), (7, 3), (3000,)], dtype, be.device, seed=3, gscale=0.01, pscale=0.1)
    n = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    for max_norm, clipped in ((10 * n, False), (0.1 * n, True)):
        res, ref = run_nar(be, params, grads, bufs, lr=0.5, wd=1e-3, max_norm=max_norm, mode=mode)
        check_nar(be, res, ref, dtype)
        st = res[2]
        if clipped:
            assert abs(float(st.scale) - max_norm / (float(st.norm) + 1e-6)) < 1e-6
        else:
            assert float(st.scale) == 1.0


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("max_norm", [1e-3, 1e4, float("inf")])
def test_nar_step_single_tensor_sizes_and_max_norms(be, mode, max_norm):
    for n in (1, 5, 1025, be.size(278011, 10007)):
        params, grads, bufs = make_lists([(n,)], torch.float32, be.device, seed=n, gscale=0.01)
        res, ref = run_nar(be, params, grads, bufs, lr=0.1, wd=0.1, max_norm=max_norm, mode=mode)
        check_nar(be, res, ref, torch.float32)


def test_nar_step_many_chunks_many_tensors(be):
    # > 1024 * 2048 elements in total: the chunk size grows past its minimum (where chunks
    # grow), one tensor spans many chunks while 40 small ones add one tail chunk each.
    shapes = [(be.size(2_500_001, 20_001),)] + [(k * 37 + 1,) for k in range(40)] + [(64, 3, 3, 3)]
    params, grads, bufs = make_lists(shapes, torch.float32, be.device, seed=2, gscale=1e-3)
    res, ref = run_nar(be, params, grads, bufs, lr=0.01, wd=5e-4, max_norm=1.0, mode="co", momentum=0.9)
    check_nar(be, res, ref, torch.float32)


@pytest.mark.parametrize("mode", list(MODES))
def test_nar_step_zero_grads_and_params(be, mode):
    params = [torch.zeros(5, device=be.device), torch.zeros(1025, device=be.device)]
    grads = [torch.zeros(5, device=be.device), torch.zeros(1025, device=be.device)]
    st = stats(be.nar_step_(params, grads, [], 0.1, 0.1, 1.0, MODES[mode], 0.0, None, None))
    assert float(st.norm) == 0.0 and float(st.scale) == 1.0 and not bool(st.skipped)
    assert_bitwise(params, [torch.zeros_like(p) for p in params])  # +0.0, not -0.0
    # Zero grads, non-zero params: only the decay moves them.
    params, _, _ = make_lists([(1025,)], torch.float32, be.device, seed=4)
    res, ref = run_nar(be, params, [torch.zeros(1025, device=be.device)], [], lr=0.1, wd=0.1, max_norm=1e6,
                       mode=mode)
    check_nar(be, res, ref, torch.float32)
    if be.rounds_like_python_ref:
        assert_bitwise(res[0], ref[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nar_step_all_empty_tensors(be, dtype):
    params = [torch.empty(0, dtype=dtype, device=be.device), torch.empty(3, 0, dtype=dtype, device=be.device)]
    grads = clone(params)
    for mode in MODES.values():
        for momentum in (0.0, 0.9):
            st = stats(be.nar_step_(params, grads, clone(grads) if momentum else [], 0.1, 0.1, 1.0, mode, momentum,
                                    None, None))
            assert st.norm.dtype == acc_of(dtype) and st.norm.shape == () and st.norm.device.type == be.device.type
            assert float(st.norm) == 0.0 and float(st.scale) == 1.0 and not bool(st.skipped)
    # GradScaler's flag still skips a call without elements; the stats are python_ref's.
    res, ref = run_nar(be, params, grads, [], lr=0.1, wd=0.1, max_norm=1e-7, mode="co",
                       found_inf=torch.tensor(1.0, device=be.device))
    assert bool(res[2].skipped)
    assert_stats_close(be, res[2], ref[2], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nar_step_nonfinite_grad_skips_bit_identically(be, dtype, mode, bad):
    # The bad value in the middle of a later chunk's block: only one partial sees it.
    big, at = be.size((278011, 123456), (9000, 8191))
    params, grads, bufs = make_lists([(17,), (3, 3), (1,), (1025,), (big,)], dtype, be.device, seed=5)
    grads[-1][at] = bad
    res, ref = run_nar(be, params, grads, bufs, lr=0.1, wd=0.01, max_norm=1.0, mode=mode, momentum=0.9)
    st = res[2]
    assert bool(st.skipped) and not math.isfinite(float(st.norm))
    assert_bitwise(res[0] + res[1], params + bufs)  # nothing written
    assert_stats_close(be, st, ref[2], dtype)  # the scale statistic too (NaN for a NaN norm)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Triton's interpreter: inf - inf
def test_nar_step_nonfinite_param_only_matters_in_mode_co(be):
    """co clips on g + wd x, so an inf param skips; grad/none clip on g alone and step
    (writing the inf/nan through, like python_ref)."""
    for mode in MODES:
        params, grads, _ = make_lists([(1025,), (5,)], torch.float32, be.device, seed=6)
        params[0][7] = float("inf")
        res, ref = run_nar(be, params, grads, [], lr=0.1, wd=0.01, max_norm=1.0, mode=mode)
        assert bool(res[2].skipped) == (mode == "co") == bool(ref[2].skipped)
        if mode == "co":
            assert_bitwise(res[0], params)
        for x, y in zip(res[0], ref[0]):
            assert_values_close(be, x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("mode", ["co", "grad"])
def test_nar_step_tensor_lr_and_weight_decay(be, dtype, mode):
    """0-d acc tensors (read in the kernel) give the bits of the floats they hold, and
    python_ref's step."""
    shapes = [(1,), (5,), (100,), (3, 7), (2049,), (be.size(278011, 2500),)]
    params, grads, bufs = make_lists(shapes, dtype, be.device, seed=7)
    acc = acc_of(dtype)
    lr, wd = torch.tensor(0.03, dtype=acc, device=be.device), torch.tensor(0.02, dtype=acc, device=be.device)
    p_f, b_f, st_f = step(be, params, grads, bufs, 0.03, 0.02, 1.0, mode, 0.9)
    p_t, b_t, st_t = step(be, params, grads, bufs, lr, wd, 1.0, mode, 0.9)
    assert_bitwise(p_f + b_f + [st_f.norm, st_f.scale, st_f.skipped], p_t + b_t + [st_t.norm, st_t.scale, st_t.skipped])
    res, ref = run_nar(be, params, grads, bufs, lr=lr, wd=wd, max_norm=1.0, mode=mode, momentum=0.9)
    check_nar(be, res, ref, dtype)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("scale", [1024.0, 3.0])
def test_nar_step_grad_scale(be, dtype, scale):
    """Gradients times GradScaler's scale, with the scale: python_ref's step on g / scale;
    a power of two is exact, so the step is the unscaled one (bitwise where the backend
    rounds as python_ref does, to the dtype's tolerance elsewhere); with the flag set,
    nothing is written."""
    shapes = [(1,), (5,), (50,), (4, 4), (1025,), (4099,)] + be.size([(278011,)], [])
    params, grads, bufs = make_lists(shapes, dtype, be.device, seed=8)
    scaled = [(g.double() * scale).to(dtype) for g in grads]
    gs, fi = torch.tensor(scale, device=be.device), torch.tensor(0.0, device=be.device)
    kw = dict(lr=0.1, wd=0.01, max_norm=1.0, mode="co", momentum=0.9)
    res, ref = run_nar(be, params, scaled, bufs, grad_scale=gs, found_inf=fi, **kw)
    check_nar(be, res, ref, dtype)
    if scale == 1024.0:
        p, b, st = res
        p_u, b_u, st_u = step(be, params, grads, bufs, 0.1, 0.01, 1.0, "co", 0.9)
        if be.rounds_like_python_ref:
            assert_bitwise(p + b + [st.norm, st.scale], p_u + b_u + [st_u.norm, st_u.scale])
        else:
            torch.testing.assert_close(st.norm, st_u.norm)  # the norm of the UNscaled gradient
            for x, y in zip(p + b, p_u + b_u):
                torch.testing.assert_close(x, y)
    # GradScaler's flag set: skipped, nothing written, the norm still reported.
    p, b, st = step(be, params, scaled, bufs, 0.1, 0.01, 1.0, "co", 0.9, gs, torch.tensor(1.0, device=be.device))
    assert bool(st.skipped) and same_bits(st.norm, res[2].norm)
    assert_bitwise(p + b, params + bufs)


FLAGS = {"one": (1.0, torch.float32), "nan": ([float("nan")], torch.float32), "fp64": (2.0, torch.float64),
         "int": (1, torch.int64), "bool": (True, torch.bool)}


@pytest.mark.parametrize("flag", list(FLAGS))
def test_nar_step_found_inf_skips_bit_identically(be, flag):
    """GradScaler's flag (any nonzero value of any dtype, 0-d or one element): skipped,
    nothing written, the norm and scale still those of the step."""
    params, grads, bufs = make_lists([(50,), (4, 4), (4099,)], torch.float32, be.device, seed=6)
    gs = torch.tensor(1024.0, device=be.device)
    scaled = [g * 1024.0 for g in grads]
    value, dtype = FLAGS[flag]
    found_inf = torch.tensor(value, dtype=dtype, device=be.device)
    _, _, plain = step(be, params, scaled, bufs, 0.1, 0.01, 1.0, "co", 0.9, gs)
    p, b, st = step(be, params, scaled, bufs, 0.1, 0.01, 1.0, "co", 0.9, gs, found_inf)
    assert bool(st.skipped)
    assert_bitwise(p + b, params + bufs)
    assert math.isfinite(float(st.norm))
    assert same_bits(st.norm, plain.norm) and same_bits(st.scale, plain.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_channels_last(be, dtype, momentum):
    shapes = [(8, 3, 5, 5), (64, 16, 3, 3), (16,), (1, 7, 1, 9), (4, 3, 5, 5)]
    params, grads, bufs = make_lists(shapes, dtype, be.device, seed=9, memory_format=torch.channels_last)
    assert not params[1].is_contiguous() and params[1].is_contiguous(memory_format=torch.channels_last)
    res, ref = run_nar(be, params, grads, bufs, lr=0.1, wd=0.01, max_norm=3.0, mode="co", momentum=momentum)
    check_nar(be, res, ref, dtype)
    for x, y in zip(res[0] + res[1], ref[0] + ref[1]):
        assert x.stride() == y.stride() or x.numel() <= 1
    assert res[0][-1].is_contiguous(memory_format=torch.channels_last)


def test_nar_step_deterministic_bitwise(be):
    shapes = [(278011,), (1025,), (64, 3, 3, 3)] + be.size([(2_300_000,)], [])
    params, grads, bufs = make_lists(shapes, torch.float32, be.device, seed=20)
    runs = [step(be, params, grads, bufs, 0.01, 1e-3, 1.0, "co", 0.9) for _ in range(2)]
    (p1, b1, s1), (p2, b2, s2) = runs
    assert_bitwise(p1 + b1 + [s1.norm, s1.scale], p2 + b2 + [s2.norm, s2.scale])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_nar_step_views_at_odd_offsets(be, dtype, mode, momentum):
    """Views at odd element offsets of flat buffers (not 16-byte aligned: the scalar
    bodies): python_ref's step, and the kernels give the bits of the same values in
    aligned tensors (the scalar body adds a chunk's terms in the vector body's order,
    and both bodies round the update's every operation alike: issue 47, where CUDA's
    grad and none modes fused s * g + wd * x differently in the two)."""
    sizes = [1025, 7, 4099]
    gen = torch.Generator().manual_seed(3)
    flat = {k: randn((1 + sum(sizes),), dtype, be.device, gen) for k in ("p", "g", "b")}

    def views(buf):
        out, off = [], 1
        for n in sizes:
            out.append(buf[off:off + n])
            off += n
        return out

    params, grads, bufs = views(flat["p"]), views(flat["g"]), views(flat["b"])
    run = {k: v.clone() for k, v in flat.items()}  # stepped in place, through views again
    p_v, g_v, b_v = views(run["p"]), views(run["g"]), views(run["b"])
    assert all(t.data_ptr() % 16 != 0 for t in (p_v[0], g_v[0], b_v[0]))
    bufs_v = b_v if momentum else []
    st_v = stats(be.nar_step_(p_v, g_v, bufs_v, 0.05, 0.01, 1.0, MODES[mode], momentum, None, None))
    p_r, b_r = clone(params), clone(bufs)
    st_r = ref_nar.nar_step_(p_r, grads, lr=0.05, weight_decay=0.01, max_norm=1.0, mode=mode, momentum=momentum,
                             momentum_buffers=b_r if momentum else None)
    check_nar(be, (p_v, bufs_v, st_v), (p_r, b_r if momentum else [], st_r), dtype)
    assert same_bits(run["p"][:1], flat["p"][:1]) and same_bits(run["b"][:1], flat["b"][:1])  # nothing before
    p_a, b_a, st_a = step(be, clone(params), clone(grads), clone(bufs), 0.05, 0.01, 1.0, mode, momentum)
    if be.layout_free_sums:
        assert_bitwise([st_a.norm, st_a.scale] + p_a + (b_a if momentum else []),
                       [st_v.norm, st_v.scale] + p_v + bufs_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_one_misaligned_view_among_aligned_tensors(be, dtype, mode, momentum):
    """Params, grads and buffers of one tensor are views at an offset of one element of
    guarded buffers, the other tensors aligned: python_ref's step, the bits of the same
    step on aligned copies, nothing written around the view, the view updated in place."""
    gen = torch.Generator().manual_seed(21)
    # Two CPU chunks (64Ki) in mode co; the CPU kernels have one body whatever the
    # alignment, so the other modes take the small size there (time: issue 47's modes).
    sizes = [be.size(70_001, 10_007, host=70_001 if mode == "co" else 10_007), 5000, 33, 4099]
    start = [[randn((n,), dtype, be.device, gen) for n in sizes] for _ in range(3)]  # params, grads, bufs

    def with_view(ts):
        out = clone(ts)
        out[1] = views_at_offset([ts[1]])[0]
        assert out[1].data_ptr() % 16 != 0
        return out

    p_v, g_v, b_v = (with_view(ts) for ts in start)
    assert all(t.data_ptr() % 16 == 0 for ts in (p_v, g_v, b_v) for i, t in enumerate(ts) if i != 1)
    bufs_v = b_v if momentum else []
    st_v = stats(be.nar_step_(p_v, g_v, bufs_v, 0.05, 0.01, 1.0, MODES[mode], momentum, None, None))
    p_r, b_r = clone(start[0]), clone(start[2])
    st_r = ref_nar.nar_step_(p_r, start[1], lr=0.05, weight_decay=0.01, max_norm=1.0, mode=mode, momentum=momentum,
                             momentum_buffers=b_r if momentum else None)
    check_nar(be, (p_v, bufs_v, st_v), (p_r, b_r if momentum else [], st_r), dtype)
    p_a, b_a, st_a = step(be, start[0], start[1], start[2], 0.05, 0.01, 1.0, mode, momentum)  # all aligned
    if be.layout_free_sums:
        assert_bitwise([st_a.norm, st_a.scale] + p_a + (b_a if momentum else []),
                       [st_v.norm, st_v.scale] + p_v + bufs_v)
    guards_untouched([p_v[1], b_v[1], g_v[1]])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
def test_nar_sq_norm_misaligned_view_among_aligned_tensors(be, dtype, mode):
    """The norm of a group with one misaligned grad view: python_ref's, and the bits of
    the same values aligned (in mode co the view's x is read as well)."""
    gen = torch.Generator().manual_seed(22)
    params = [randn((n,), dtype, be.device, gen) for n in (9000, 3000)]
    grads = [randn((n,), dtype, be.device, gen) for n in (9000, 3000)]
    view_params = [params[0], views_at_offset([params[1]])[0]]
    view_grads = [grads[0], views_at_offset([grads[1]])[0]]
    sq = be.nar_sq_norm(view_params, view_grads, 0.01, MODES[mode], None)
    assert sq.dtype == acc_of(dtype) and sq.shape == ()
    if be.layout_free_sums:
        assert same_bits(sq, be.nar_sq_norm(params, grads, 0.01, MODES[mode], None))
    assert_norms_close(be, sq, ref_nar.nar_sq_norm(params, grads, weight_decay=0.01, mode=mode), dtype)


def _many_small_tensors(count, dtype, device, seed):
    """``count`` small tensors (1..13 elements): one tail chunk (one partial) each."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [(i * 7) % 13 + 1 for i in range(count)]
    flat = {k: randn((sum(sizes),), dtype, device, gen, 0.1) for k in ("p", "g", "b")}
    out = {}
    for k, v in flat.items():
        out[k], at = [], 0
        for n in sizes:
            out[k].append(v[at:at + n].clone())
            at += n
    return out["p"], out["g"], out["b"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_nar_step_group_of_many_partials(be, dtype, monkeypatch):
    """5000 tensors -> 5000 partials in one group, more than the redundant combine takes
    (4096 by default): the finalize pass sums them once; the result is python_ref's, the
    redundant combine forced (FEDOPT_MAX_REDUNDANT_PARTIALS, read at every call) gives
    the same bits, and the root of nar_sq_norm (the same partials, the same loop) is
    the norm.  The small size: 60 tensors with the limit lowered to 20."""
    count, limit = be.size((5000, None), (60, "20"))
    params, grads, bufs = _many_small_tensors(count, dtype, be.device, seed=23)
    if limit is None:
        monkeypatch.delenv("FEDOPT_MAX_REDUNDANT_PARTIALS", raising=False)
    else:
        monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", limit)
    res, ref = run_nar(be, params, grads, bufs, lr=0.1, wd=0.01, max_norm=0.5, mode="co", momentum=0.9)
    largest = max(float(t.double().abs().max()) for t in ref[0] + ref[1])  # many tiny tensors: one floor
    check_nar(be, res, ref, dtype, magnitude=largest)
    assert float(res[2].scale) < 1.0  # really clipped
    monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", "1000000")
    p, b, st = step(be, params, grads, bufs, 0.1, 0.01, 0.5, "co", 0.9)
    assert_bitwise(p + b + [st.norm, st.scale], res[0] + res[1] + [res[2].norm, res[2].scale])
    sq = be.nar_sq_norm(params, grads, 0.01, 0, None)
    # python_ref takes torch.sqrt; the kernels an IEEE root (torch's CUDA sqrt is one, its
    # CPU sqrt not always: tests/_server_update_oracle.py).
    root = torch.sqrt(sq) if be.name in ("reference", "cuda") else sqrt_rn(sq.cpu().reshape(1)).reshape(())
    assert same_bits(root, res[2].norm)


def test_finalize_pass_forced_is_bitwise_the_redundant_combine(be, monkeypatch):
    """FEDOPT_MAX_REDUNDANT_PARTIALS=0 sends every group through the finalize pass (one
    sum of its partials, in the redundant combine's order): the same bits for
    nar_step_ and for the table-free [C, N] form of nar_step_batched_ (each row's
    partials taken from the row), per-row lr included."""
    small = make_lists([(40000,), (5,), (20000,)], torch.float32, be.device, seed=23)
    gen = torch.Generator().manual_seed(28)
    X, G = randn((3, 9001), torch.float32, be.device, gen), randn((3, 9001), torch.float32, be.device, gen)
    lr = torch.tensor([0.01, 0.02, 0.03], device=be.device)
    large = None
    if not be.small:
        large = make_lists([(278011,), (1025,), (7,), (64, 3, 3, 3)], torch.float32, be.device, seed=24)
        gen = torch.Generator().manual_seed(25)
        X2, G2 = randn((5, 70_001), torch.float32, be.device, gen), randn((5, 70_001), torch.float32, be.device, gen)
    runs = []
    for limit in ("1000000", "0"):  # redundant combine, then the finalize pass everywhere
        monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", limit)
        p, b, st = step(be, *small, 0.01, 1e-3, 1.0, "co", 0.9)
        Xs, B = X.clone(), torch.zeros_like(X)
        st_b = stats(be.nar_step_batched_(Xs, G, B, lr, 1e-3, 1.0, 0, 0.9, None, None))
        out = p + b + [st.norm, st.scale, Xs, B, st_b.norm, st_b.scale]
        if large is not None:
            p, b, st = step(be, *large, 0.01, 1e-3, 1.0, "co", 0.9)
            Xs2 = X2.clone()
            st_b2 = stats(be.nar_step_batched_(Xs2, G2, None, 0.01, 1e-3, 1.0, 0, 0.0, None, None))
            out += p + b + [st.norm, st.scale, Xs2, st_b2.norm, st_b2.scale]
        runs.append((out, st_b, Xs))
    assert_bitwise(runs[0][0], runs[1][0])
    st_b, Xs = runs[0][1], runs[0][2]
    assert not torch.equal(Xs, X) and bool((st_b.scale < 1).all())  # stepped and clipped


# ----------------------------------------------------------------------------- nar_step_batched_

def run_batched(be, X, G, B, *, lr, wd, max_norm, mode, momentum, grad_scale=None, found_inf=None):
    Xf, Bf = X.clone(), (B.clone() if momentum else None)
    Xr, Br = X.clone(), (B.clone() if momentum else None)
    st = stats(be.nar_step_batched_(Xf, G, Bf, lr, wd, max_norm, MODES[mode], momentum, grad_scale, found_inf))
    st_r = ref_nar.nar_step_batched_(Xr, G, lr=lr, weight_decay=wd, max_norm=max_norm, mode=mode, momentum=momentum,
                                     momentum_buffers=Br, grad_scale=grad_scale, found_inf=found_inf)
    return (Xf, Bf, st), (Xr, Br, st_r)


def check_batched(be, res, ref, dtype):
    (Xf, Bf, st), (Xr, Br, st_r) = res, ref
    assert_stats_close(be, st, st_r, dtype, shape=(Xf.shape[0],))
    assert_values_close(be, Xf, Xr)
    if Bf is not None:
        assert_values_close(be, Bf, Br)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("N", [1, 5, 1024, 1025, 278011])
def test_nar_step_batched_rows_with_row_lr_and_a_nan_row(be, dtype, mode, N):
    N = be.size(N, min(N, 10007))
    C = 4
    gen = torch.Generator().manual_seed(9)
    X, B = randn((C, N), dtype, be.device, gen), randn((C, N), dtype, be.device, gen)
    rows = torch.tensor([[0.001], [1.0], [100.0], [3.0]], dtype=torch.float64)
    G = (torch.randn(C, N, generator=gen, dtype=torch.float64) * rows).to(dtype).to(be.device)
    G[2, N // 2] = float("nan")
    acc = acc_of(dtype)
    lr = torch.tensor([0.1, 0.01, 0.5, 0.2], dtype=acc, device=be.device)
    wd = torch.tensor(0.01, dtype=acc, device=be.device)
    res, ref = run_batched(be, X, G, B, lr=lr, wd=wd, max_norm=1.0, mode=mode, momentum=0.9)
    assert res[2].skipped.tolist() == [False, False, True, False]
    assert same_bits(res[0][2], X[2]) and same_bits(res[1][2], B[2])  # the NaN row did not move
    check_batched(be, res, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_batched_per_row_lr_and_weight_decay(be, dtype, mode, momentum):
    C, N = 5, be.size(70001, 4099)  # several chunks per row
    gen = torch.Generator().manual_seed(10)
    X = randn((C, N), dtype, be.device, gen)
    G = randn((C, N), dtype, be.device, gen, 0.01)
    B = randn((C, N), dtype, be.device, gen)
    G[3, N - 1] = float("nan")
    acc = acc_of(dtype)
    lr = torch.tensor([0.1, 0.2, 0.05, 0.3, 0.01], dtype=acc, device=be.device)
    wd = torch.tensor([0.0, 0.01, 0.02, 0.03, 0.5], dtype=acc, device=be.device)
    res, ref = run_batched(be, X, G, B, lr=lr, wd=wd, max_norm=2.0, mode=mode, momentum=momentum)
    assert res[2].skipped.tolist() == [False, False, False, True, False]
    assert same_bits(res[0][3], X[3])  # the NaN row is untouched
    if momentum:
        assert same_bits(res[1][3], B[3])
    check_batched(be, res, ref, dtype)


def test_nar_step_batched_per_row_weight_decay_no_momentum(be):
    C, N = 3, 20000  # several chunks per row
    gen = torch.Generator().manual_seed(11)
    X, G = randn((C, N), torch.float32, be.device, gen), randn((C, N), torch.float32, be.device, gen)
    wd = torch.tensor([0.0, 0.1, 1.0], device=be.device)
    res, ref = run_batched(be, X, G, None, lr=0.1, wd=wd, max_norm=50.0, mode="co", momentum=0.0)
    check_batched(be, res, ref, torch.float32)


def test_nar_step_batched_is_nar_step_per_row(be):
    """Each row of the batched op gets exactly what nar_step_ gives it alone."""
    C, N = 4, 1025
    gen = torch.Generator().manual_seed(11)
    X, G = randn((C, N), torch.float32, be.device, gen), randn((C, N), torch.float32, be.device, gen)
    X1 = X.clone()
    st = stats(be.nar_step_batched_(X1, G, None, torch.tensor(0.1, device=be.device), 0.01, 5.0, 0, 0.0, None, None))
    for i in range(C):
        row = [X[i].clone()]
        st_i = stats(be.nar_step_(row, [G[i]], [], 0.1, 0.01, 5.0, 0, 0.0, None, None))
        assert_bitwise(row + [st_i.norm, st_i.scale], [X1[i], st.norm[i], st.scale[i]])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_batched_rows_of_alternating_alignment(be, dtype, mode, momentum):
    """N * sizeof not a multiple of 16: rows start at alternating 16-byte offsets, so some
    chunks are aligned and some not.  Each row equals, bitwise, the same row stepped
    alone in an aligned [1, N] tensor, and python_ref (issue 47: a client's bits must
    not depend on its row's parity, in any mode)."""
    C, N = 4, 5003
    gen = torch.Generator().manual_seed(27)
    X, G, B = (randn((C, N), dtype, be.device, gen) for _ in range(3))
    B = B if momentum else None
    lr = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=acc_of(dtype), device=be.device)
    res, ref = run_batched(be, X, G, B, lr=lr, wd=0.01, max_norm=1.0, mode=mode, momentum=momentum)
    check_batched(be, res, ref, dtype)
    Xf, Bf, st = res
    assert (Bf is not None) == bool(momentum)
    assert {X[r].data_ptr() % 16 == 0 for r in range(C)} == {True, False}  # both bodies run
    for r in range(C):
        x1 = X[r:r + 1].clone()
        b1 = B[r:r + 1].clone() if momentum else None
        st1 = stats(be.nar_step_batched_(x1, G[r:r + 1].clone(), b1, lr[r:r + 1], 0.01, 1.0, MODES[mode], momentum,
                                         None, None))
        got, want = [st.norm[r], st.scale[r], Xf[r]], [st1.norm[0], st1.scale[0], x1[0]]
        if momentum:
            got, want = got + [Bf[r]], want + [b1[0]]
        assert_bitwise(want, got)


def test_nar_step_batched_misaligned_rows_and_float_hyperparameters(be):
    # N * 4 bytes not a multiple of 16 -> the scalar bodies; long rows -> several chunks per row
    # (2.5M: a grown chunk size where chunks grow).
    for C, N in ((3, 1027), (2, be.size(2_500_003, 20_003))):
        gen = torch.Generator().manual_seed(10)
        X, G, B = (randn((C, N), torch.float32, be.device, gen) for _ in range(3))
        res, ref = run_batched(be, X, G, B, lr=0.05, wd=0.01, max_norm=10.0, mode="co", momentum=0.0)
        assert not bool(res[2].skipped.any())
        check_batched(be, res, ref, torch.float32)


@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_nar_step_batched_empty(be, shape):
    X = torch.zeros(shape, device=be.device)
    res, ref = run_batched(be, X, X.clone(), None, lr=0.1, wd=0.0, max_norm=1.0, mode="co", momentum=0.0)
    st = res[2]
    assert st.norm.shape == (shape[0],) and st.scale.shape == (shape[0],) and st.skipped.shape == (shape[0],)
    assert bool(st.norm.eq(0).all()) and bool(st.scale.eq(1).all()) and not bool(st.skipped.any())
    check_batched(be, res, ref, torch.float32)


def test_nar_step_batched_found_inf_skips_every_row(be):
    gen = torch.Generator().manual_seed(11)
    X, G = randn((3, 100), torch.float32, be.device, gen), randn((3, 100), torch.float32, be.device, gen)
    Xf = X.clone()
    st = stats(be.nar_step_batched_(Xf, G, None, 0.1, 0.0, 1.0, 0, 0.0, None, torch.tensor(1.0, device=be.device)))
    assert st.skipped.tolist() == [True] * 3 and same_bits(Xf, X)
