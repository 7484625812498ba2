"""The C++ CUDA extension (``fedopt_kernels._C_cuda``, csrc/cuda) against python_ref.

* ``test_extension_registers_cuda_kernels`` runs everywhere: it skips only when torch is
  a CPU-only build (then the extension is never built) and FAILS when torch has CUDA but
  the extension is missing (CI builds it with FEDOPT_BUILD_CUDA=1).
* The host-side decisions of the CUDA launchers run everywhere too, through the
  extension's diagnostic ops (``torch.ops.fedopt_C._cuda_*``, no GPU needed): the chunk
  rule and row layout of csrc/include/fedopt/chunks.h against a Python statement of
  them, the aggregation's tiling rule, the finalize threshold and its environment
  variable, the table cache's counters.
* Every other test needs a GPU and is skipped with "needs a CUDA device" without one.
  They call the backend module directly (``fedopt_kernels.backends.cuda``, i.e. the
  ``torch.ops.fedopt_C`` ops dispatched to the CUDA kernels), so they also reach cases
  the public ops layer would reshape first (misaligned views, acc-dtype out/g, flags of
  other dtypes).

Kernel paths exercised on purpose: odd sizes (scalar tails of 16-byte vectors, chunk
and tile tails), empty tensors and all-empty calls (no chunk: the stats-only kernel),
misaligned views (the scalar bodies, chosen per chunk: one misaligned view among aligned
tensors, rows of a [C, N] tensor whose alignment alternates), more than one chunk per
tensor and more than one tile per block (grid-stride with the per-block partial
read-modify-write), more than 32 clients (several staged client batches), every tile
shape of the aggregation (C = 100 clients of N = 62,000 and smaller N), groups with more
than 4096 partials (the finalize pass, bitwise against the redundant combine).
Bitwise invariants: the FedNAR norm of a chunk does not depend on its alignment (the
scalar body adds in the vector body's order), nor on the finalize pass; the
aggregation's sums do not depend on alignment or on list vs [C, N] form.

server_update_ is checked BIT FOR BIT (no tolerance) against an oracle that performs
the contract's operations one torch op at a time on CPU copies in the acc dtype: the
kernel must round every operation separately, in that order (no FMA contraction, IEEE
division and sqrt), and store with round-to-nearest-even.  Its three load paths are
reached on purpose: everything 16-byte aligned (vectors), updates at odd offsets of a
flat vector (vector x/m/v with scalar D loads), params and state at odd offsets too
(scalar), plus the scalar tails and chunk tables with grown chunks.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import python_ref.aggregation as ref_agg
import python_ref.fednar as ref_nar
from python_ref.fednar import compute_dtype as acc_of  # the oracle's accumulation dtype
from _server_update_oracle import server_update_exact

OPS = ("nar_step_", "nar_step_batched_", "aggregate", "client_dots", "server_update_")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LOW = [torch.float32, torch.float16, torch.bfloat16]
MODES = {"co": 0, "grad": 1, "none": 2}

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _import_extension():
    """Import the CPU and CUDA extensions; None on success, else the error text."""
    try:
        import fedopt_kernels._C  # noqa: F401  (defines the fedopt_C schemas)
        import fedopt_kernels._C_cuda  # noqa: F401  (registers their CUDA kernels)
    except ImportError as exc:
        return str(exc)
    return None


def test_extension_registers_cuda_kernels():
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build, so the CUDA extension is not built")
    err = _import_extension()
    if err is not None:
        pytest.fail(f"torch has CUDA {torch.version.cuda} but fedopt_kernels._C_cuda cannot be imported: {err} "
                    "(build it: FEDOPT_BUILD_CUDA=1 pip install --no-build-isolation .)")
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fedopt_C::{op}", "CUDA"), op


@pytest.fixture(scope="module")
def host_ops():
    """torch.ops.fedopt_C with the CUDA extension's diagnostic ops (no GPU needed)."""
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build, so the CUDA extension is not built")
    err = _import_extension()
    if err is not None:
        pytest.fail(f"torch has CUDA {torch.version.cuda} but fedopt_kernels._C_cuda cannot be imported: {err}")
    return torch.ops.fedopt_C


# ----------------------------------------------------------------------------- host-side rules (no GPU)

MIN_CHUNK, TARGET_CHUNKS, ALIGNED16 = 2048, 1024, 1


def chunk_size_for(n):
    """The chunk rule of csrc/include/fedopt/chunks.h, stated in Python."""
    want, size = -(-n // TARGET_CHUNKS), MIN_CHUNK
    while size < want:
        size *= 2
    return size


def chunk_rows_oracle(tensors, esizes, num_groups):
    """The row layout of chunks.h: ``tensors`` = [(ptrs[4], numel, group)] group by group.
    Returns (rows [[8 ints]], ranges [[pbegin, pend]] per group, chunk_size)."""
    sizes = [0] * num_groups
    for _, n, g in tensors:
        sizes[g] += n
    cs = chunk_size_for(max(sizes, default=0))
    rows, first, last = [], [None] * num_groups, [None] * num_groups
    for ptrs, n, g in tensors:
        for start in range(0, n, cs):
            p = [a + start * e if a else 0 for a, e in zip(ptrs, esizes)]
            flags = ALIGNED16 if all(a % 16 == 0 for a in p) else 0
            if first[g] is None:
                first[g] = len(rows)
            rows.append(p + [min(cs, n - start), g, flags, 0])
            last[g] = len(rows)
    ranges, at = [], 0  # an empty group's range is empty, where the next group starts
    for g in range(num_groups):
        if first[g] is None:
            ranges.append([at, at])
        else:
            ranges.append([first[g], last[g]])
            at = last[g]
    return rows, ranges, cs


def test_chunk_rule(host_ops):
    def size(n):
        blob, rows, cs, _ = host_ops._cuda_chunk_rows([4096, 8192, 0, 0], [n], [0], [4, 4, 4, 4], 1)
        return cs

    for n in (0, 1, 2048, 2048 * 1024, 2048 * 1024 + 1, 11_689_512, 100_000_000, 2**33 + 5):
        assert size(n) == chunk_size_for(n), n
    assert size(2048 * 1024) == 2048 and size(2048 * 1024 + 1) == 4096
    assert size(11_689_512) == 16384  # ResNet-18


def test_chunk_rows_layout(host_ops):
    """Rows cut at multiples of the chunk size inside each tensor, every pointer advanced
    by its own element size, the alignment flag per row, empty tensors without a row,
    the largest GROUP deciding the chunk size, each group's partial range."""
    big = 5 * 2048 * 1024 + 3  # group 0 alone: chunk size 16384
    tensors = [
        ([1 << 20, 2 << 20, 3 << 20, 4 << 20], big, 0),       # aligned, ptr3 in use
        ([(5 << 20) + 2, 6 << 20, 0, 0], 40_000, 0),          # ptr0 only 2-byte aligned
        ([7 << 20, 8 << 20, 0, 0], 0, 1),                     # empty: no row; group 1 empty
        ([9 << 20, (10 << 20) + 8, 0, 0], 16385, 2),          # ptr1 8-byte aligned
        ([11 << 20, 12 << 20, 13 << 20, 0], 1, 2),            # ptr3 = 0 does not clear the flag
    ]
    esizes = [2, 4, 2, 2]  # e.g. fp16 params, fp32 updates
    blob, num_rows, cs, max_rows = host_ops._cuda_chunk_rows(
        [a for t in tensors for a in t[0]], [t[1] for t in tensors], [t[2] for t in tensors], esizes, 4)
    rows, ranges, cs_ref = chunk_rows_oracle(tensors, esizes, 4)
    assert cs == cs_ref == 16384
    assert num_rows == len(rows) and len(blob) == 8 * num_rows + 2 * 4
    got = [blob[8 * r:8 * r + 8] for r in range(num_rows)]
    assert got == rows
    assert [blob[8 * num_rows + 2 * g:8 * num_rows + 2 * g + 2] for g in range(4)] == ranges
    assert max_rows == max(e - b for b, e in ranges)
    # Spot checks of the oracle itself.
    assert rows[1][:6] == [(1 << 20) + 16384 * 2, (2 << 20) + 16384 * 4, (3 << 20) + 16384 * 2,
                           (4 << 20) + 16384 * 2, 16384, 0]
    assert all(r[6] == 0 for r in rows if r[0] % 16 or r[1] % 16)
    assert rows[-1] == [11 << 20, 12 << 20, 13 << 20, 0, 1, 2, ALIGNED16, 0]
    assert ranges[1][0] == ranges[1][1] and ranges[3][0] == ranges[3][1] == num_rows


def test_chunk_rows_random_against_oracle(host_ops):
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        G = int(torch.randint(1, 5, (), generator=gen))
        T = int(torch.randint(1, 12, (), generator=gen))
        groups = sorted(int(g) for g in torch.randint(0, G, (T,), generator=gen))
        numels = [int(n) for n in torch.randint(0, 9000, (T,), generator=gen)]
        if trial % 4 == 0:
            numels[0] = 3_000_001  # a grown chunk size
        ptrs = [[int(a) * 2 if k < 3 else 0 for k, a in enumerate(torch.randint(1, 1 << 30, (4,), generator=gen))]
                for _ in range(T)]
        esizes = [2, 4, 2, 2] if trial % 2 else [8, 8, 8, 8]
        tensors = list(zip(ptrs, numels, groups))
        blob, num_rows, cs, _ = host_ops._cuda_chunk_rows([a for p in ptrs for a in p], numels, groups, esizes, G)
        rows, ranges, cs_ref = chunk_rows_oracle(tensors, esizes, G)
        assert cs == cs_ref
        assert blob == [v for r in rows for v in r] + [v for r in ranges for v in r]


def test_chunk_rows_refuse_groups_out_of_order(host_ops):
    with pytest.raises(RuntimeError, match="group by group"):
        host_ops._cuda_chunk_rows([64, 64, 0, 0, 128, 128, 0, 0], [5, 5], [1, 0], [4, 4, 4, 4], 2)


def test_aggregate_tiling_rule(host_ops):
    """The tile shape depends on N and the element size only; small N gets >= ~256 blocks."""
    shapes = [(256, 2), (256, 1), (128, 1), (64, 1), (32, 1)]

    def rule(n, esize):
        vec = 16 // esize
        for threads, vectors in shapes:
            cols = threads * vectors * vec
            tiles = -(-n // cols)
            if tiles >= 256:
                break
        return [threads, vectors, cols, tiles, min(tiles, 1024)]

    for n in (0, 1, 5, 1025, 4099, 62_000, 100_000, 200_000, 278_011, 600_000, 1_100_003, 11_700_000):
        for esize in (2, 4, 8):
            assert host_ops._cuda_aggregate_tiling(n, esize) == rule(n, esize), (n, esize)
    # The examples of aggregate.cu's header comment.
    assert host_ops._cuda_aggregate_tiling(62_000, 4) == [32, 1, 128, 485, 485]  # was 31 blocks
    assert host_ops._cuda_aggregate_tiling(200_000, 4) == [128, 1, 512, 391, 391]
    assert host_ops._cuda_aggregate_tiling(600_000, 4) == [256, 2, 2048, 293, 293]
    assert host_ops._cuda_aggregate_tiling(11_700_000, 4)[4] == 1024
    assert host_ops._cuda_aggregate_tiling(62_000, 2) == [32, 1, 256, 243, 243]


def test_finalize_threshold_and_its_environment_variable(host_ops, monkeypatch):
    monkeypatch.delenv("FEDOPT_MAX_REDUNDANT_PARTIALS", raising=False)
    assert host_ops._cuda_max_redundant_partials() == 4096
    monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", "0")  # read at every call
    assert host_ops._cuda_max_redundant_partials() == 0
    monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", "1000000")
    assert host_ops._cuda_max_redundant_partials() == 1_000_000
    for bad in ("-1", "12x", "many"):
        monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", bad)
        with pytest.raises(RuntimeError, match="FEDOPT_MAX_REDUNDANT_PARTIALS must be a non-negative integer"):
            host_ops._cuda_max_redundant_partials()


def test_table_cache_info(host_ops):
    entries, captured, hits, misses, capacity = host_ops._cuda_table_cache_info()
    assert capacity == 64 and 0 <= entries <= capacity and captured >= 0 and hits >= 0 and misses >= 0
    host_ops._cuda_table_cache_clear()
    assert host_ops._cuda_table_cache_info()[0] == 0


@pytest.fixture(scope="module")
def cuda():
    """The cuda backend module (torch.ops.fedopt_C with CUDA kernels); needs a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    err = _import_extension()
    if err is not None:
        pytest.fail(f"a CUDA device is present but fedopt_kernels._C_cuda cannot be imported: {err}")
    from fedopt_kernels.backends import cuda as backend

    return backend


# ----------------------------------------------------------------------------- helpers

def bits(t):
    """Raw bits, so -0.0 != 0.0 and NaN payloads count."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).cuda()


def make_lists(shapes, dtype, seed=0, gscale=1.0):
    gen = torch.Generator().manual_seed(seed)
    params = [randn(s, dtype, gen) for s in shapes]
    grads = [randn(s, dtype, gen, gscale) for s in shapes]
    bufs = [randn(s, dtype, gen) for s in shapes]
    return params, grads, bufs


def clone(ts):
    return [t.clone() for t in ts]


def check_close(actual, expected, dtype):
    """Cast-to-dtype comparison with the dtype's default tolerances (1-ulp rounding
    flips allowed: the kernels contract a*b+c into FMAs and sum in another order)."""
    torch.testing.assert_close(actual.cpu(), expected.to(actual.dtype).cpu(), equal_nan=True)


def check_norm(actual, expected):
    torch.testing.assert_close(actual.cpu(), expected.to(actual.dtype).cpu(), rtol=2e-5, atol=1e-6, equal_nan=True)


def run_nar(cuda, params, grads, bufs, *, lr, wd, max_norm, mode, momentum, grad_scale=None, found_inf=None):
    """The CUDA op and python_ref on copies; returns ((p, b, stats) fused, (p, b, stats) ref)."""
    p_f, b_f = clone(params), clone(bufs)
    p_r, b_r = clone(params), clone(bufs)
    st_f = cuda.nar_step_(p_f, grads, b_f if momentum else [], lr, wd, max_norm, MODES[mode], momentum,
                          grad_scale, found_inf)
    st_r = ref_nar.nar_step_(p_r, grads, lr=lr, weight_decay=wd, max_norm=max_norm, mode=mode, momentum=momentum,
                             momentum_buffers=b_r if momentum else None, grad_scale=grad_scale, found_inf=found_inf)
    return (p_f, b_f, st_f), (p_r, b_r, st_r)


def assert_nar_matches(fused, reference, dtype, *, stats_shape=()):
    (p_f, b_f, (norm, scale, skipped)), (p_r, b_r, st_r) = fused, reference
    acc = acc_of(dtype)
    assert norm.dtype == acc and scale.dtype == acc and skipped.dtype == torch.bool
    assert norm.shape == stats_shape and scale.shape == stats_shape and skipped.shape == stats_shape
    assert norm.device.type == "cuda"
    check_norm(norm, st_r.norm)
    assert torch.equal(skipped.cpu(), st_r.skipped.cpu())
    if not bool(st_r.skipped.any()):
        check_norm(scale, st_r.scale)
    for a, b in zip(p_f + b_f, p_r + b_r):
        assert a.dtype == dtype
        check_close(a, b, dtype)


# ----------------------------------------------------------------------------- nar_step_

SHAPES = [(1,), (0,), (5,), (1025,), (3, 0, 2), (278011,)]


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_odd_sizes(cuda, dtype, mode, momentum):
    params, grads, bufs = make_lists(SHAPES, dtype, seed=1)
    fused, reference = run_nar(cuda, params, grads, bufs, lr=0.05, wd=0.01, max_norm=10.0, mode=mode,
                               momentum=momentum)
    assert_nar_matches(fused, reference, dtype)
    if mode != "none":  # ||g|| ~ 528 > 10: really clipped
        assert float(fused[2][1]) < 0.05


@needs_cuda
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("max_norm", [1e-3, 1e4, float("inf")])
def test_nar_step_single_sizes_and_clipping(cuda, mode, max_norm):
    for n in (1, 5, 1025, 278011):
        params, grads, bufs = make_lists([(n,)], torch.float32, seed=n, gscale=0.01)
        fused, reference = run_nar(cuda, params, grads, bufs, lr=0.1, wd=0.1, max_norm=max_norm, mode=mode,
                                   momentum=0.0)
        assert_nar_matches(fused, reference, torch.float32)


@needs_cuda
def test_nar_step_many_chunks_many_tensors(cuda):
    # > 1024 * 2048 elements in total: the chunk size grows past its minimum, and one
    # tensor spans many chunks while 40 small ones add one tail chunk each.
    shapes = [(2_500_001,)] + [(k * 37 + 1,) for k in range(40)] + [(64, 3, 3, 3)]
    params, grads, bufs = make_lists(shapes, torch.float32, seed=2, gscale=1e-3)
    fused, reference = run_nar(cuda, params, grads, bufs, lr=0.01, wd=5e-4, max_norm=1.0, mode="co", momentum=0.9)
    assert_nar_matches(fused, reference, torch.float32)


@needs_cuda
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_nar_step_misaligned_views(cuda, dtype, momentum):
    """Views at odd element offsets of flat buffers: not 16-byte aligned (scalar path)."""
    sizes = [1025, 7, 4099]
    gen = torch.Generator().manual_seed(3)
    flat = {k: randn((1 + sum(sizes),), dtype, gen) for k in ("p", "g", "b")}

    def views(buf):
        out, off = [], 1
        for n in sizes:
            out.append(buf[off:off + n])
            off += n
        return out

    params, grads, bufs = views(flat["p"]), views(flat["g"]), views(flat["b"])
    assert all(t.data_ptr() % 16 != 0 for t in params[:1])
    fused, reference = run_nar(cuda, params, grads, bufs, lr=0.05, wd=0.01, max_norm=1.0, mode="co",
                               momentum=momentum)
    assert_nar_matches(fused, reference, dtype)
    # The same values through the aligned (vectorised) bodies: the same bits (the scalar
    # body adds a chunk's terms in the vector body's order; the update is elementwise).
    aligned = run_nar(cuda, [p.clone() for p in params], [g.clone() for g in grads], [b.clone() for b in bufs],
                      lr=0.05, wd=0.01, max_norm=1.0, mode="co", momentum=momentum)[0]
    assert same_bits(aligned[2][0], fused[2][0]) and same_bits(aligned[2][1], fused[2][1])
    for a, b in zip(aligned[0] + aligned[1], fused[0] + fused[1]):
        assert same_bits(a, b)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_nar_step_one_misaligned_view_among_aligned_tensors(cuda, dtype, momentum):
    """Vectorisation is decided per chunk: params, grads and buffers of one tensor are
    views at an offset of 1 element of larger buffers (all its chunks misaligned), the
    other tensors aligned.  Before, that one view sent every tensor of the call to the
    scalar kernel; now only its own chunks take the scalar body, and the step equals
    python_ref and, bitwise, the same step on aligned copies."""
    gen = torch.Generator().manual_seed(21)
    sizes = [70_001, 5000, 33, 4099]
    start = [[randn((n,), dtype, gen) for n in sizes] for _ in range(3)]  # params, grads, bufs

    def with_view(ts, i):
        """Clones of ``ts``, tensor ``i`` as a view at element offset 1 of a guarded buffer."""
        out = clone(ts)
        buf = torch.full((ts[i].numel() + 2,), 7.0, dtype=dtype, device="cuda")
        buf[1:-1] = ts[i]
        out[i] = buf[1:-1]
        assert out[i].data_ptr() % 16 != 0
        return out

    p_v, g_v, b_v = (with_view(ts, 1) for ts in start)
    assert all(t.data_ptr() % 16 == 0 for ts in (p_v, g_v, b_v) for i, t in enumerate(ts) if i != 1)
    st_v = cuda.nar_step_(p_v, g_v, b_v if momentum else [], 0.05, 0.01, 1.0, 0, momentum, None, None)
    p_r, b_r = clone(start[0]), clone(start[2])
    st_r = ref_nar.nar_step_(p_r, start[1], lr=0.05, weight_decay=0.01, max_norm=1.0, mode="co", momentum=momentum,
                             momentum_buffers=b_r if momentum else None)
    assert_nar_matches((p_v, b_v if momentum else [], st_v), (p_r, b_r if momentum else [], st_r), dtype)
    p_a, b_a = clone(start[0]), clone(start[2])  # every tensor aligned: the vector bodies
    st_a = cuda.nar_step_(p_a, start[1], b_a if momentum else [], 0.05, 0.01, 1.0, 0, momentum, None, None)
    assert same_bits(st_a[0], st_v[0]) and same_bits(st_a[1], st_v[1])
    for a, v in zip(p_a + (b_a if momentum else []), p_v + (b_v if momentum else [])):
        assert same_bits(a, v)
    for ts in (p_v, b_v):  # nothing written around the view
        buf = ts[1]._base
        assert float(buf[0]) == 7.0 and float(buf[-1]) == 7.0


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nar_sq_norm_misaligned_view_among_aligned_tensors(cuda, dtype):
    gen = torch.Generator().manual_seed(22)
    params = [randn((n,), dtype, gen) for n in (9000, 3000)]
    grads = [randn((n,), dtype, gen) for n in (9000, 3000)]
    buf = torch.zeros(3002, dtype=dtype, device="cuda")
    buf[1:3001] = grads[1]
    view_grads = [grads[0], buf[1:3001]]
    sq = cuda.nar_sq_norm(params, view_grads, 0.01, 0, None)
    assert same_bits(sq, cuda.nar_sq_norm(params, grads, 0.01, 0, None))
    check_norm(sq, ref_nar.nar_sq_norm(params, grads, weight_decay=0.01, mode="co"))


def _lists_of_many_small_tensors(count, dtype, seed):
    """``count`` small tensors (1..13 elements): one tail chunk (one partial) each."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [(i * 7) % 13 + 1 for i in range(count)]
    total = sum(sizes)
    flat = {k: randn((total,), dtype, gen, 0.1) for k in ("p", "g", "b")}
    out = {}
    for k, v in flat.items():
        out[k], at = [], 0
        for n in sizes:
            out[k].append(v[at:at + n].clone())
            at += n
    return out["p"], out["g"], out["b"]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_nar_step_group_of_5000_partials_finalize_pass(cuda, dtype, monkeypatch):
    """5000 tensors -> 5000 partials in one group (> kMaxRedundantPartials = 4096): the
    finalize pass sums them once per group; the result equals python_ref, and forcing
    the redundant in-kernel combine (FEDOPT_MAX_REDUNDANT_PARTIALS, read at every call)
    gives the same bits."""
    params, grads, bufs = _lists_of_many_small_tensors(5000, dtype, seed=23)
    monkeypatch.delenv("FEDOPT_MAX_REDUNDANT_PARTIALS", raising=False)
    assert torch.ops.fedopt_C._cuda_max_redundant_partials() == 4096
    fused, reference = run_nar(cuda, params, grads, bufs, lr=0.1, wd=0.01, max_norm=0.5, mode="co", momentum=0.9)
    assert_nar_matches(fused, reference, dtype)
    assert float(fused[2][1]) < 1.0  # really clipped
    monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", "1000000")
    redundant = run_nar(cuda, params, grads, bufs, lr=0.1, wd=0.01, max_norm=0.5, mode="co", momentum=0.9)[0]
    assert same_bits(redundant[2][0], fused[2][0]) and same_bits(redundant[2][1], fused[2][1])
    for a, b in zip(redundant[0] + redundant[1], fused[0] + fused[1]):
        assert same_bits(a, b)
    # nar_sq_norm sums the same partials with the same loop: sqrt of it is the norm.
    sq = cuda.nar_sq_norm(params, grads, 0.01, 0, None)
    assert same_bits(torch.sqrt(sq), fused[2][0])


@needs_cuda
def test_finalize_pass_forced_on_small_calls_is_bitwise_the_redundant_combine(cuda, monkeypatch):
    params, grads, bufs = make_lists([(278011,), (1025,), (7,), (64, 3, 3, 3)], torch.float32, seed=24)
    X = randn((5, 70_001), torch.float32, torch.Generator().manual_seed(25))
    G = randn((5, 70_001), torch.float32, torch.Generator().manual_seed(26))
    results = []
    for threshold in ("1000000", "0"):  # redundant combine, then the finalize pass everywhere
        monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", threshold)
        p, b = clone(params), clone(bufs)
        st = cuda.nar_step_(p, grads, b, 0.01, 1e-3, 1.0, 0, 0.9, None, None)
        Xs = X.clone()
        st_b = cuda.nar_step_batched_(Xs, G, None, 0.01, 1e-3, 1.0, 0, 0.0, None, None)
        results.append((p + b + [Xs], list(st) + list(st_b)))
    (t1, s1), (t2, s2) = results
    assert all(same_bits(a, b) for a, b in zip(t1 + s1, t2 + s2))


@needs_cuda
def test_nar_step_channels_last(cuda):
    gen = torch.Generator().manual_seed(4)
    x = randn((4, 3, 5, 5), torch.float32, gen).to(memory_format=torch.channels_last)
    g = randn((4, 3, 5, 5), torch.float32, gen).to(memory_format=torch.channels_last)
    fused, reference = run_nar(cuda, [x], [g], [], lr=0.1, wd=0.01, max_norm=1.0, mode="co", momentum=0.0)
    assert_nar_matches(fused, reference, torch.float32)
    assert fused[0][0].is_contiguous(memory_format=torch.channels_last)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nar_step_nonfinite_skips_bit_identical(cuda, dtype, mode, bad):
    params, grads, bufs = make_lists([(17,), (5000,), (1,)], dtype, seed=5)
    grads[1][4321] = bad
    before = clone(params) + clone(bufs)
    norm, scale, skipped = cuda.nar_step_(params, grads, bufs, 0.1, 0.01, 1.0, MODES[mode], 0.5, None, None)
    assert bool(skipped) and not torch.isfinite(norm).item()
    assert all(same_bits(a, b) for a, b in zip(params + bufs, before))


@needs_cuda
def test_nar_step_found_inf_and_grad_scale(cuda):
    params, grads, bufs = make_lists([(50,), (4, 4), (3000,)], torch.float32, seed=6)
    scale_t = torch.tensor(1024.0, device="cuda")
    scaled = [g * 1024.0 for g in grads]
    fused, reference = run_nar(cuda, params, scaled, bufs, lr=0.1, wd=0.01, max_norm=1.0, mode="co", momentum=0.9,
                               grad_scale=scale_t, found_inf=torch.tensor(0.0, device="cuda"))
    assert_nar_matches(fused, reference, torch.float32)
    unscaled = run_nar(cuda, params, grads, bufs, lr=0.1, wd=0.01, max_norm=1.0, mode="co", momentum=0.9)[0]
    torch.testing.assert_close(fused[2][0], unscaled[2][0])  # the norm of the UNscaled gradient
    for a, b in zip(fused[0] + fused[1], unscaled[0] + unscaled[1]):
        torch.testing.assert_close(a, b)
    for flag in (torch.tensor(1.0, device="cuda"), torch.tensor([float("nan")], device="cuda"),
                 torch.tensor(2.0, dtype=torch.float64, device="cuda"), torch.tensor(1, device="cuda"),
                 torch.tensor(True, device="cuda")):
        p, b = clone(params), clone(bufs)
        _, _, skipped = cuda.nar_step_(p, scaled, b, 0.1, 0.01, 1.0, 0, 0.9, scale_t, flag)
        assert bool(skipped), flag
        assert all(same_bits(x, y) for x, y in zip(p + b, params + bufs))


@needs_cuda
def test_nar_step_tensor_hyperparameters(cuda):
    params, grads, bufs = make_lists([(100,), (3, 7), (2049,)], torch.float32, seed=7)
    lr_t, wd_t = torch.tensor(0.05, device="cuda"), torch.tensor(0.02, device="cuda")
    p_t, b_t = clone(params), clone(bufs)
    st_t = cuda.nar_step_(p_t, grads, b_t, lr_t, wd_t, 1.0, 0, 0.9, None, None)
    p_f, b_f = clone(params), clone(bufs)
    st_f = cuda.nar_step_(p_f, grads, b_f, 0.05, 0.02, 1.0, 0, 0.9, None, None)
    assert torch.equal(st_t[0], st_f[0]) and torch.equal(st_t[1], st_f[1])
    assert all(same_bits(a, b) for a, b in zip(p_t + b_t, p_f + b_f))
    fused, reference = run_nar(cuda, params, grads, bufs, lr=lr_t, wd=wd_t, max_norm=1.0, mode="grad", momentum=0.9)
    assert_nar_matches(fused, reference, torch.float32)


@needs_cuda
def test_nar_step_all_empty(cuda):
    params = [torch.empty(0, device="cuda"), torch.empty(2, 0, device="cuda")]
    grads = [torch.empty_like(p) for p in params]
    for mode in MODES.values():
        norm, scale, skipped = cuda.nar_step_(params, grads, [], 0.1, 0.1, 1.0, mode, 0.0, None, None)
        assert norm.shape == () and float(norm) == 0.0 and float(scale) == 1.0 and not bool(skipped)
    _, _, skipped = cuda.nar_step_(params, grads, [], 0.1, 0.1, 1.0, 0, 0.0, None, torch.tensor(1.0, device="cuda"))
    assert bool(skipped)


@needs_cuda
def test_nar_step_deterministic_bitwise(cuda):
    params, grads, bufs = make_lists([(278011,), (1025,), (64, 3, 3, 3), (2_300_000,)], torch.float32, seed=8)
    runs = []
    for _ in range(2):
        p, b = clone(params), clone(bufs)
        st = cuda.nar_step_(p, grads, b, 0.01, 1e-3, 1.0, 0, 0.9, None, None)
        runs.append((p, b, st))
    (p1, b1, s1), (p2, b2, s2) = runs
    assert same_bits(s1[0], s2[0]) and same_bits(s1[1], s2[1])
    assert all(same_bits(a, b) for a, b in zip(p1 + b1, p2 + b2))


# ----------------------------------------------------------------------------- nar_step_batched_

def run_batched(cuda, X, G, B, *, lr, wd, max_norm, mode, momentum, grad_scale=None, found_inf=None):
    Xf, Bf = X.clone(), (B.clone() if momentum else None)
    Xr, Br = X.clone(), (B.clone() if momentum else None)
    st_f = cuda.nar_step_batched_(Xf, G, Bf, lr, wd, max_norm, MODES[mode], momentum, grad_scale, found_inf)
    st_r = ref_nar.nar_step_batched_(Xr, G, lr=lr, weight_decay=wd, max_norm=max_norm, mode=mode,
                                     momentum=momentum, momentum_buffers=Br, grad_scale=grad_scale,
                                     found_inf=found_inf)
    return (Xf, Bf, st_f), (Xr, Br, st_r)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("N", [1, 5, 1024, 1025, 278011])
def test_batched_rows_with_row_lr_and_nan_row(cuda, dtype, mode, N):
    C = 4
    gen = torch.Generator().manual_seed(9)
    X, B = randn((C, N), dtype, gen), randn((C, N), dtype, gen)
    rows = torch.tensor([[0.001], [1.0], [100.0], [1.0]], dtype=torch.float64)
    G = (torch.randn(C, N, generator=gen, dtype=torch.float64) * rows).to(dtype).cuda()
    G[2, N // 2] = float("nan")
    acc = acc_of(dtype)
    lr = torch.tensor([0.1, 0.01, 0.5, 0.2], dtype=acc, device="cuda")
    wd = torch.tensor(0.01, dtype=acc, device="cuda")
    fused, reference = run_batched(cuda, X, G, B, lr=lr, wd=wd, max_norm=1.0, mode=mode, momentum=0.9)
    (Xf, Bf, (norm, scale, skipped)), (Xr, Br, st_r) = fused, reference
    assert norm.shape == (C,) and norm.dtype == acc and skipped.dtype == torch.bool
    assert skipped.tolist() == [False, False, True, False]
    assert same_bits(Xf[2], X[2]) and same_bits(Bf[2], B[2])  # the NaN row did not move
    keep = [0, 1, 3]
    check_norm(norm[keep], st_r.norm[keep])
    check_norm(scale[keep], st_r.scale[keep])
    check_close(Xf, Xr, dtype)
    check_close(Bf, Br, dtype)


@needs_cuda
def test_batched_misaligned_rows_and_float_hypers(cuda):
    # N * 4 bytes not a multiple of 16 -> scalar path; rows of 2.5M -> several chunks per row.
    for C, N in ((3, 1027), (2, 2_500_003)):
        gen = torch.Generator().manual_seed(10)
        X, G, B = (randn((C, N), torch.float32, gen) for _ in range(3))
        fused, reference = run_batched(cuda, X, G, B, lr=0.05, wd=0.01, max_norm=10.0, mode="co", momentum=0.0)
        (Xf, _, (norm, scale, skipped)), (Xr, _, st_r) = fused, reference
        check_norm(norm, st_r.norm)
        check_norm(scale, st_r.scale)
        assert not bool(skipped.any())
        check_close(Xf, Xr, torch.float32)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_rows_of_alternating_alignment(cuda, dtype):
    """N * sizeof not a multiple of 16: rows start at alternating 16-byte offsets, so some
    chunks are aligned and some not (decided per chunk from base + (row * N + start) *
    esize).  Each row equals, bitwise, the same row stepped alone in an aligned [1, N]
    tensor (same chunk size, same order whatever the body), and python_ref."""
    C, N = 4, 5003
    gen = torch.Generator().manual_seed(27)
    X, G, B = (randn((C, N), dtype, gen) for _ in range(3))
    lr = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=acc_of(dtype), device="cuda")
    fused, reference = run_batched(cuda, X, G, B, lr=lr, wd=0.01, max_norm=1.0, mode="co", momentum=0.9)
    (Xf, Bf, (norm, scale, skipped)), (Xr, Br, st_r) = fused, reference
    check_norm(norm, st_r.norm)
    check_close(Xf, Xr, dtype)
    check_close(Bf, Br, dtype)
    for r in range(C):
        x1, b1 = X[r:r + 1].clone(), B[r:r + 1].clone()
        n1, s1, _ = cuda.nar_step_batched_(x1, G[r:r + 1].clone(), b1, lr[r:r + 1], 0.01, 1.0, 0, 0.9, None, None)
        assert same_bits(n1[0], norm[r]) and same_bits(s1[0], scale[r])
        assert same_bits(x1[0], Xf[r]) and same_bits(b1[0], Bf[r])


@needs_cuda
def test_batched_empty_shapes(cuda):
    X = torch.empty(3, 0, device="cuda")
    norm, scale, skipped = cuda.nar_step_batched_(X, X.clone(), None, 0.1, 0.0, 1.0, 0, 0.0, None, None)
    assert norm.tolist() == [0.0] * 3 and scale.tolist() == [1.0] * 3 and skipped.tolist() == [False] * 3
    X = torch.empty(0, 5, device="cuda")
    norm, scale, skipped = cuda.nar_step_batched_(X, X.clone(), None, 0.1, 0.0, 1.0, 0, 0.0, None, None)
    assert norm.shape == (0,) and skipped.shape == (0,)


@needs_cuda
def test_batched_found_inf_skips_every_row(cuda):
    gen = torch.Generator().manual_seed(11)
    X, G = randn((3, 100), torch.float32, gen), randn((3, 100), torch.float32, gen)
    Xf = X.clone()
    _, _, skipped = cuda.nar_step_batched_(Xf, G, None, 0.1, 0.0, 1.0, 0, 0.0, None, torch.tensor(1.0, device="cuda"))
    assert skipped.tolist() == [True] * 3 and same_bits(Xf, X)


# ----------------------------------------------------------------------------- aggregate

def make_clients(C, N, dtype, seed=0, as_2d=False):
    gen = torch.Generator().manual_seed(seed)
    X = randn((C, N), dtype, gen)
    return X if as_2d else [X[i].clone() for i in range(C)]


def run_aggregate(cuda, clients, weights, gamma, out_dtype, skip=None):
    N = clients.shape[1] if isinstance(clients, torch.Tensor) else clients[0].numel()
    out = torch.full((N,), 7.0, dtype=out_dtype, device="cuda")
    q, Q = cuda.aggregate(clients, weights, gamma, out, skip)
    return out, q, Q


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
@pytest.mark.parametrize("out_acc", [False, True], ids=["out_data_dtype", "out_acc_dtype"])
@pytest.mark.parametrize("C,N", [(1, 1), (3, 5), (4, 1025), (5, 278011), (37, 4099)])
def test_aggregate_matches_reference(cuda, dtype, as_2d, out_acc, C, N):
    clients = make_clients(C, N, dtype, seed=C * 1000 + N, as_2d=as_2d)
    acc = acc_of(dtype)
    weights = torch.rand(C, dtype=acc, generator=torch.Generator().manual_seed(1)).cuda() + 0.1
    gamma = torch.tensor(0.9, dtype=acc, device="cuda") if C % 2 else 0.9
    out_dtype = acc if out_acc else dtype
    out, q, Q = run_aggregate(cuda, clients, weights, gamma, out_dtype)
    out_r, q_r, Q_r = ref_agg.aggregate(clients, weights, gamma)
    assert q.shape == (C,) and q.dtype == acc and Q.shape == () and Q.dtype == acc
    check_close(out, out_r, out_dtype)
    check_norm(q, q_r)
    check_norm(Q, Q_r)


@needs_cuda
@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
def test_aggregate_many_tiles_per_block(cuda, as_2d):
    # fp64 tiles are 1024 columns and at most 1024 blocks run: N > 2^20 makes blocks
    # take several tiles (the partials' read-modify-write path).
    C, N = 3, 1_100_003
    clients = make_clients(C, N, torch.float64, seed=12, as_2d=as_2d)
    weights = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64, device="cuda")
    out, q, Q = run_aggregate(cuda, clients, weights, 1.0, torch.float64)
    out_r, q_r, Q_r = ref_agg.aggregate(clients, weights, 1.0)
    torch.testing.assert_close(out, out_r)
    torch.testing.assert_close(q, q_r, rtol=1e-10, atol=0)
    torch.testing.assert_close(Q, Q_r, rtol=1e-10, atol=0)


@needs_cuda
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
def test_aggregate_zero_weight_nan_client(cuda, dtype, as_2d):
    clients = make_clients(3, 1025, dtype, seed=13, as_2d=as_2d)
    clients[1][17] = float("nan")
    clients[1][900] = float("inf")
    weights = torch.tensor([0.5, 0.0, 0.5], device="cuda")
    out, q, Q = run_aggregate(cuda, clients, weights, 1.0, dtype)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(Q))
    assert not bool(torch.isfinite(q[1])) and bool(torch.isfinite(q[[0, 2]]).all())
    out_r, q_r, Q_r = ref_agg.aggregate(clients, weights, 1.0)
    check_close(out, out_r, dtype)
    check_norm(q, q_r)
    check_norm(Q, Q_r)


@needs_cuda
@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
def test_aggregate_skip_flag(cuda, as_2d):
    clients = make_clients(4, 3001, torch.float32, seed=14, as_2d=as_2d)
    weights = torch.full((4,), 0.25, device="cuda")
    out, q, Q = run_aggregate(cuda, clients, weights, 1.0, torch.float32, torch.tensor(True, device="cuda"))
    assert same_bits(out, torch.full((3001,), 7.0, device="cuda"))  # not touched
    assert q.tolist() == [0.0] * 4 and float(Q) == 0.0
    out, q, Q = run_aggregate(cuda, clients, weights, 1.0, torch.float32, torch.tensor(False, device="cuda"))
    out_r, q_r, Q_r = ref_agg.aggregate(clients, weights, 1.0)
    check_close(out, out_r, torch.float32)
    check_norm(q, q_r)
    check_norm(Q, Q_r)


@needs_cuda
@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
def test_aggregate_empty_columns(cuda, as_2d):
    clients = torch.empty(3, 0, device="cuda") if as_2d else [torch.empty(0, device="cuda") for _ in range(3)]
    out = torch.empty(0, device="cuda")
    q, Q = cuda.aggregate(clients, torch.ones(3, device="cuda"), 1.0, out, None)
    assert q.tolist() == [0.0] * 3 and float(Q) == 0.0


@needs_cuda
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_aggregate_misaligned_views(cuda, dtype):
    C, N = 3, 2050
    gen = torch.Generator().manual_seed(15)
    flat = randn((1 + C * N,), dtype, gen)
    clients = [flat[1 + i * N:1 + (i + 1) * N] for i in range(C)]
    assert clients[0].data_ptr() % 16 != 0
    weights = torch.tensor([0.1, 0.6, 0.3], device="cuda")
    out_buf = torch.zeros(N + 1, dtype=dtype, device="cuda")
    out = out_buf[1:]
    q, Q = cuda.aggregate(clients, weights, 2.0, out, None)
    out_r, q_r, Q_r = ref_agg.aggregate(clients, weights, 2.0)
    check_close(out, out_r, dtype)
    check_norm(q, q_r)
    check_norm(Q, Q_r)
    assert float(out_buf[0]) == 0.0  # nothing written before the view
    # 2-D [C, N] with N * sizeof not a multiple of 16 (rows misaligned) too.
    X = torch.stack(clients)[:, :N - 1].contiguous()
    out2 = torch.empty(N - 1, dtype=dtype, device="cuda")
    q2, Q2 = cuda.aggregate(X, weights, 2.0, out2, None)
    out_r2, q_r2, Q_r2 = ref_agg.aggregate(X, weights, 2.0)
    check_close(out2, out_r2, dtype)
    check_norm(q2, q_r2)
    check_norm(Q2, Q_r2)


@needs_cuda
def test_aggregate_deterministic_bitwise(cuda):
    # N * 4 bytes is a multiple of 16, so the list and the [C, N] forms both take the
    # vectorised path (same per-thread columns, same order).
    clients = make_clients(40, 300_004, torch.float32, seed=16, as_2d=False)
    weights = torch.rand(40, generator=torch.Generator().manual_seed(2)).cuda()
    a = run_aggregate(cuda, clients, weights, 0.7, torch.float32)
    b = run_aggregate(cuda, clients, weights, 0.7, torch.float32)
    assert all(same_bits(x, y) for x, y in zip(a, b))
    # The same data as one [C, N] tensor goes through the same tiles and order.
    c = run_aggregate(cuda, torch.stack(clients), weights, 0.7, torch.float32)
    assert all(same_bits(x, y) for x, y in zip(a, c))


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [62_000, 3000, 5])
def test_aggregate_100_clients_small_n(cuda, dtype, N):
    """C = 100 clients of a small model: the tile shape follows N (62,000 fp32 columns ->
    485 blocks of 32 threads instead of 31 blocks of 256) and several client batches
    with their loads grouped.  List and [C, N] forms agree bitwise; misaligned views of
    the same values (scalar loads of the same columns) too; all equal python_ref."""
    C = 100
    clients = make_clients(C, N, dtype, seed=N, as_2d=False)
    acc = acc_of(dtype)
    weights = torch.rand(C, dtype=acc, generator=torch.Generator().manual_seed(3)).cuda()
    weights[7] = 0.0
    gamma = torch.tensor(0.8, dtype=acc, device="cuda")
    out, q, Q = run_aggregate(cuda, clients, weights, gamma, dtype)
    out_r, q_r, Q_r = ref_agg.aggregate(clients, weights, gamma)
    check_close(out, out_r, dtype)
    check_norm(q, q_r)
    check_norm(Q, Q_r)
    as_2d = run_aggregate(cuda, torch.stack(clients), weights, gamma, dtype)
    assert all(same_bits(a, b) for a, b in zip((out, q, Q), as_2d))
    flat = torch.zeros(1 + C * N, dtype=dtype, device="cuda")
    views = []
    for i, c in enumerate(clients):
        flat[1 + i * N:1 + (i + 1) * N] = c
        views.append(flat[1 + i * N:1 + (i + 1) * N])
    misaligned = run_aggregate(cuda, views, weights, gamma, dtype)
    assert all(same_bits(a, b) for a, b in zip((out, q, Q), misaligned))
    g = randn((N,), dtype, torch.Generator().manual_seed(4))
    d = cuda.client_dots(clients, g)
    torch.testing.assert_close(d.cpu(), ref_agg.client_dots(clients, g).cpu(), rtol=2e-5,
                               atol=2e-4 * (N ** 0.5) if dtype != torch.float64 else 1e-9)
    assert same_bits(d, cuda.client_dots(torch.stack(clients), g))
    assert same_bits(d, cuda.client_dots(views, g))


@needs_cuda
@pytest.mark.parametrize("N", [100, 62_000, 200_000, 600_000])
def test_aggregate_every_tile_shape(cuda, N):
    """N values that select each tile shape of the rule (fp32: 32x1, 32x1, 128x1, 256x2)."""
    shape = torch.ops.fedopt_C._cuda_aggregate_tiling(N, 4)
    C = 37
    clients = make_clients(C, N, torch.float32, seed=N + 1, as_2d=True)
    weights = torch.rand(C, generator=torch.Generator().manual_seed(5)).cuda()
    out, q, Q = run_aggregate(cuda, clients, weights, 1.0, torch.float32)
    out_r, q_r, Q_r = ref_agg.aggregate(clients, weights, 1.0)
    check_close(out, out_r, torch.float32)
    check_norm(q, q_r)
    check_norm(Q, Q_r)
    assert shape[4] == min(shape[3], 1024)


# ----------------------------------------------------------------------------- client_dots

@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
@pytest.mark.parametrize("g_acc", [False, True], ids=["g_data_dtype", "g_acc_dtype"])
@pytest.mark.parametrize("C,N", [(1, 1), (3, 5), (4, 1025), (33, 278011)])
def test_client_dots_matches_reference(cuda, dtype, as_2d, g_acc, C, N):
    clients = make_clients(C, N, dtype, seed=C + N, as_2d=as_2d)
    gen = torch.Generator().manual_seed(17)
    g = randn((N,), acc_of(dtype) if g_acc else dtype, gen)
    d = cuda.client_dots(clients, g)
    d_r = ref_agg.client_dots(clients, g)
    assert d.shape == (C,) and d.dtype == acc_of(dtype)
    torch.testing.assert_close(d.cpu(), d_r.cpu(), rtol=2e-5, atol=2e-4 * (N ** 0.5) if dtype != torch.float64 else 1e-9)


@needs_cuda
def test_client_dots_misaligned_and_deterministic(cuda):
    C, N = 5, 100_003
    gen = torch.Generator().manual_seed(18)
    flat = randn((1 + C * N,), torch.float32, gen)
    clients = [flat[1 + i * N:1 + (i + 1) * N] for i in range(C)]
    g = randn((N + 1,), torch.float32, gen)[1:]
    d1, d2 = cuda.client_dots(clients, g), cuda.client_dots(clients, g)
    assert same_bits(d1, d2)
    torch.testing.assert_close(d1, ref_agg.client_dots(clients, g), rtol=2e-5, atol=1e-2)
    # The aligned copies go through the vectorised path.
    d3 = cuda.client_dots([c.clone() for c in clients], g.clone())
    torch.testing.assert_close(d3, d1, rtol=2e-5, atol=1e-2)


# ----------------------------------------------------------------------------- server_update_

# name -> (rule integer of the schema, nesterov)
SERVER_RULES = {"sgd": (0, False), "momentum": (1, False), "nesterov": (1, True), "adagrad": (2, False),
                "adam": (3, False), "yogi": (4, False)}
SERVER_SIZES = [(0,), (1,), (5,), (1025,), (33, 31), (278011,)]
SERVER_HYPER = dict(beta1=0.8, beta2=0.95, tau=1e-2)


class ServerCase:
    """params, updates (acc dtype), exp_avg and exp_avg_sq on the GPU for one rule (state
    lists empty where the rule has none), laid out as ``layout`` says:

    * ``"separate"``: every tensor its own allocation: all 16-byte aligned (vector path);
    * ``"flat"``: updates are views at odd element offsets of ONE flat acc vector, as the
      ops layer passes them (most not 16-byte aligned: vector x/m/v, scalar D loads);
    * ``"views"``: params and state are views at odd offsets of flat buffers too (scalar
      path); the buffers' first and last elements are guards that must not change.
    """

    def __init__(self, rule, dtype, sizes, *, seed=0, layout="separate"):
        code, nesterov = SERVER_RULES[rule]
        self.code, self.nesterov, self.dtype, self.layout = code, nesterov, dtype, layout
        acc = acc_of(dtype)
        gen = torch.Generator().manual_seed(seed)
        total = sum(math.prod(s) for s in sizes)
        x = torch.randn(total, generator=gen, dtype=torch.float64)
        d = torch.randn(total, generator=gen, dtype=torch.float64) * 0.3
        m = torch.randn(total, generator=gen, dtype=torch.float64) * 0.1
        # v > 0 as a second moment is; about half of it below D^2 (both signs for Yogi).
        v = torch.rand(total, generator=gen, dtype=torch.float64) * 0.05 + 1e-4
        self.guards = []  # (buffer, its guard values) for the "views" layout
        self.params = self._place(x, dtype, sizes, as_views=layout == "views", offset=1)
        self.updates = self._place(d, acc, sizes, as_views=layout in ("flat", "views"), offset=3)
        self.exp_avg = self._place(m, dtype, sizes, as_views=layout == "views", offset=1) if code >= 1 else []
        self.exp_avg_sq = self._place(v, dtype, sizes, as_views=layout == "views", offset=1) if code >= 2 else []

    def _place(self, values, dtype, sizes, *, as_views, offset):
        if as_views:
            buf = torch.full((values.numel() + offset + 1,), 7.0, dtype=dtype, device="cuda")
            buf[offset:offset + values.numel()] = values.to(dtype).cuda()
            self.guards.append((buf, torch.cat([buf[:offset], buf[-1:]]).clone()))
        out, at = [], 0
        for s in sizes:
            n = math.prod(s)
            if as_views:
                out.append(buf[offset + at:offset + at + n].view(s))
            else:
                out.append(values[at:at + n].to(dtype).view(s).clone().cuda())  # own allocation
            at += n
        return out

    def writable(self):
        return self.params + self.exp_avg + self.exp_avg_sq

    def clone(self):
        """The same values in fresh aligned tensors (updates shared: they are only read)."""
        c = object.__new__(ServerCase)
        c.__dict__.update(self.__dict__)
        c.guards = []
        c.params, c.exp_avg, c.exp_avg_sq = ([t.clone() for t in ts] for ts in (self.params, self.exp_avg,
                                                                                  self.exp_avg_sq))
        return c

    def run(self, cuda, *, lr=0.3, gamma=0.9, skip=None, **hyper):
        h = dict(SERVER_HYPER, **hyper)
        cuda.server_update_(self.params, self.updates, self.exp_avg, self.exp_avg_sq, self.code, lr, gamma,
                            h["beta1"], h["beta2"], h["tau"], self.nesterov, skip)

    def expected(self, *, lr=0.3, gamma=0.9, **hyper):
        """The oracle's new (params, exp_avg, exp_avg_sq) from the CURRENT values, as CPU
        tensors in the params' dtype (the GPU tensors are not modified)."""
        h = dict(SERVER_HYPER, **hyper)
        acc = acc_of(self.dtype)
        out = ([], [], [])
        for i, (p, u) in enumerate(zip(self.params, self.updates)):
            x = p.cpu().reshape(-1).to(acc)
            m = self.exp_avg[i].cpu().reshape(-1).to(acc) if self.exp_avg else None
            v = self.exp_avg_sq[i].cpu().reshape(-1).to(acc) if self.exp_avg_sq else None
            x, m, v = server_update_exact(self.code, self.nesterov, x, u.cpu().reshape(-1), m, v, lr=lr, gamma=gamma,
                                          **h)
            for lst, new, keep in zip(out, (x, m, v), (True, bool(self.exp_avg), bool(self.exp_avg_sq))):
                if keep:
                    lst.append(new.to(self.dtype).view(p.shape))
        return out

    def assert_equals(self, expected, what, nan_ok=False):
        names = ("params", "exp_avg", "exp_avg_sq")
        for name, got, exp in zip(names, (self.params, self.exp_avg, self.exp_avg_sq), expected):
            assert len(got) == len(exp)
            for i, (a, e) in enumerate(zip(got, exp)):
                assert_bits_equal(a, e, f"{what}: {name}[{i}]", nan_ok=nan_ok)

    def assert_guards_untouched(self):
        for buf, before in self.guards:
            n = before.numel() - 1
            assert same_bits(torch.cat([buf[:n], buf[-1:]]), before), "wrote outside the views"


def assert_bits_equal(actual, expected, what, nan_ok=False):
    """Bitwise equality (NaN payloads aside when ``nan_ok``), with the first mismatches."""
    a = actual.detach().cpu()
    assert a.dtype == expected.dtype and a.shape == expected.shape, what
    differ = bits(a) != bits(expected)
    if nan_ok:
        both_nan = torch.isnan(a) & torch.isnan(expected)
        differ &= ~both_nan
    if bool(differ.any()):
        idx = differ.reshape(-1).nonzero().reshape(-1)[:5].tolist()
        pytest.fail(f"{what}: {int(differ.sum())} of {a.numel()} elements differ in their bits, first at {idx}: "
                    f"got {a.reshape(-1)[idx].tolist()}, expected {expected.reshape(-1)[idx].tolist()}")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(SERVER_RULES))
@pytest.mark.parametrize("layout", ["separate", "flat", "views"])
def test_server_update_matches_formulas_bitwise(cuda, dtype, rule, layout):
    case = ServerCase(rule, dtype, SERVER_SIZES, seed=len(rule) + 10 * DTYPES.index(dtype), layout=layout)
    nonempty = [i for i, p in enumerate(case.params) if p.numel()]
    aligned = [case.params[i].data_ptr() % 16 == 0 for i in nonempty]
    d_aligned = [case.updates[i].data_ptr() % 16 == 0 for i in nonempty]
    if layout == "separate":
        assert all(aligned) and all(d_aligned)
    elif layout == "flat":  # both the full-vector and the scalar-D variant occur
        assert all(aligned) and any(d_aligned) and not all(d_aligned)
    else:  # a view may still start aligned by chance; most do not
        assert not all(aligned)
    for rnd in range(2):  # the second round reads the state the first one wrote
        expected = case.expected()
        case.run(cuda)
        case.assert_equals(expected, f"round {rnd}")
    case.assert_guards_untouched()


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(SERVER_RULES))
def test_server_update_device_tensor_hyperparameters(cuda, dtype, rule):
    """lr / gamma as 0-d acc tensors on the device give the bits of the same values as
    floats (0.3 and 0.9 are not exact in fp32: both must round the same way), and the
    kernel reads the tensors when it runs (a value changed on the device is used)."""
    acc = acc_of(dtype)
    a = ServerCase(rule, dtype, [(5,), (1025,), (4099,)], seed=20, layout="flat")
    b = a.clone()
    expected = a.expected(lr=0.3, gamma=0.9)
    a.run(cuda, lr=0.3, gamma=0.9)
    lr_t = torch.tensor(0.3, dtype=acc, device="cuda")
    gamma_t = torch.tensor(0.9, dtype=acc, device="cuda")
    b.run(cuda, lr=lr_t, gamma=gamma_t)
    a.assert_equals(expected, "floats")
    b.assert_equals(expected, "0-d tensors")
    # Changed on the device (no host round trip), then read by the next launch.
    lr_t.mul_(0.5)
    gamma_t.fill_(0.5)
    expected = b.expected(lr=lr_t, gamma=gamma_t)
    b.run(cuda, lr=lr_t, gamma=gamma_t)
    b.assert_equals(expected, "updated 0-d tensors")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(SERVER_RULES))
def test_server_update_skip_flag(cuda, dtype, rule):
    case = ServerCase(rule, dtype, [(1,), (1025,), (278011,)], seed=30, layout="flat")
    case.updates[1][17] = float("nan")  # a skipped step must not write even these
    case.updates[2][5] = float("inf")
    before = [t.clone() for t in case.writable()]
    flag = torch.tensor(True, device="cuda")
    case.run(cuda, skip=flag)
    case.run(cuda, lr=torch.tensor(0.3, dtype=acc_of(dtype), device="cuda"), skip=flag)
    for t, b in zip(case.writable(), before):
        assert same_bits(t, b)
    # skip = False is exactly skip = None; the flag is read on the device at run time.
    other = case.clone()
    flag.fill_(False)
    expected = case.expected()
    case.run(cuda, skip=flag)
    other.run(cuda, skip=None)
    for t, o in zip(case.writable(), other.writable()):
        assert same_bits(t, o)
    case.assert_equals(expected, "skip=False", nan_ok=True)
    assert not same_bits(case.params[2], before[2])


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(SERVER_RULES))
def test_server_update_special_values(cuda, dtype, rule):
    """Zeros, infinities, NaN and v == D^2 exactly (Yogi's sign(0)) follow the oracle."""
    case = ServerCase(rule, dtype, [(37,)], seed=40)
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 0.5, -1.5, 0.25]
    u = case.updates[0]
    u[:len(specials)] = torch.tensor(specials, dtype=u.dtype, device="cuda")
    if case.exp_avg_sq:  # v = D^2 exactly (representable in every dtype for these D)
        v = case.exp_avg_sq[0]
        v[5:8] = (u[5:8] * u[5:8]).to(v.dtype)
        v[20] = 0.0
        u[20] = 0.0
    expected = case.expected()
    case.run(cuda)
    case.assert_equals(expected, "special values", nan_ok=True)


@needs_cuda
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_server_update_grown_chunks(cuda, rule):
    # > 2048 chunks of the minimum size in total: the chunk size doubles; the big tensor
    # spans many chunks, the small ones add a tail chunk each.
    case = ServerCase(rule, torch.float32, [(16_777_219,), (7,), (3, 5)], seed=50, layout="flat")
    expected = case.expected()
    case.run(cuda)
    case.assert_equals(expected, "grown chunks")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(SERVER_RULES))
def test_server_update_matches_cpu_kernel_bitwise(cuda, dtype, rule):
    """The CUDA and CPU kernels evaluate the same math.h functions: the same bits."""
    from fedopt_kernels.backends import cpu

    case = ServerCase(rule, dtype, [(5,), (1025,), (70001,)], seed=60, layout="flat")
    host = [[t.cpu() for t in ts] for ts in (case.params, case.updates, case.exp_avg, case.exp_avg_sq)]
    h = SERVER_HYPER
    cpu.server_update_(*host, case.code, 0.3, 0.9, h["beta1"], h["beta2"], h["tau"], case.nesterov, None)
    case.run(cuda)
    case.assert_equals((host[0], host[2], host[3]), "CPU kernel")


@needs_cuda
def test_server_update_empty_calls_launch_nothing(cuda):
    # Nothing to do must not even look up a table: the calls succeed during CUDA graph
    # capture on tensors never seen before, where a table cache miss is refused.
    # (Everything is created before the capture: a host-to-device copy cannot be captured.)
    empty = [[torch.empty(0, device="cuda"), torch.empty(0, 3, device="cuda")] for _ in range(4)]
    skip = torch.tensor(False, device="cuda")
    lr = torch.tensor(0.1, device="cuda")
    g = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty"
        with torch.cuda.graph(g):
            cuda.server_update_([], [], [], [], 3, 0.1, 1.0, 0.9, 0.99, 1e-3, False, None)
            cuda.server_update_(*empty, 4, lr, 1.0, 0.9, 0.99, 1e-3, False, skip)
            cuda.server_update_(empty[0], empty[1], [], [], 0, 0.1, lr, 0.9, 0.99, 1e-3, False, None)


@needs_cuda
def test_server_update_rejects_memory_unsafe_arguments(cuda):
    case = ServerCase("adam", torch.float16, [(5,), (6, 7)], seed=70)
    before = [t.clone() for t in case.writable()]
    h = SERVER_HYPER

    def call(params=None, updates=None, exp_avg=None, exp_avg_sq=None, rule=3):
        cuda.server_update_(case.params if params is None else params, case.updates if updates is None else updates,
                            case.exp_avg if exp_avg is None else exp_avg,
                            case.exp_avg_sq if exp_avg_sq is None else exp_avg_sq, rule, 0.1, 1.0, h["beta1"],
                            h["beta2"], h["tau"], False, None)

    with pytest.raises(RuntimeError, match=r"updates\[0\] has dtype"):  # params' dtype instead of acc
        call(updates=[u.half() for u in case.updates])
    with pytest.raises(RuntimeError, match=r"updates\[1\] has 41 elements"):
        call(updates=[case.updates[0], case.updates[1].reshape(-1)[:41]])
    with pytest.raises(RuntimeError, match=r"exp_avg\[1\] must be contiguous"):
        call(exp_avg=[case.exp_avg[0], case.exp_avg[1].t()])
    with pytest.raises(RuntimeError, match=r"params\[1\] is on cpu"):
        call(params=[case.params[0], case.params[1].cpu()])
    with pytest.raises(RuntimeError, match="needs one exp_avg_sq per param"):
        call(exp_avg_sq=[])
    with pytest.raises(RuntimeError, match="rule must be"):
        call(rule=5)
    for t, b in zip(case.writable(), before):
        assert same_bits(t, b)
