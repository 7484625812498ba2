"""What is specific to the C++ CUDA extension (``fedopt_kernels._C_cuda``, csrc/cuda).

* ``test_extension_registers_cuda_kernels`` runs everywhere: it skips only when torch is
  a CPU-only build (then the extension is never built) and FAILS when torch has CUDA but
  the extension is missing (CI builds it with FEDOPT_BUILD_CUDA=1).
* The host-side decisions of the CUDA launchers run everywhere too, through the
  extension's diagnostic ops (``torch.ops.fedopt_C._cuda_*``, no GPU needed): the chunk
  rule and row layout of csrc/include/fedopt/chunks.h against a Python statement of
  them, the aggregation's tiling rule, the finalize threshold and its environment
  variable, the table cache's counters.
* The launch shapes of the aggregation on a GPU (every tile shape of the rule, several
  tiles per block), ``server_update_`` calls without elements under CUDA-graph capture,
  and the CUDA op's own refusals of memory-unsafe arguments: skipped with "needs a CUDA
  device" without one.

The backend contract -- python_ref's results and the server-update oracle's bits, odd
sizes, misaligned views, more than 32 clients, groups with more than 4096 partials (the
finalize pass), grown chunk sizes, non-finite values, skip flags, determinism -- is
checked for every backend, CUDA included, by tests/test_contract_nar_step.py,
test_contract_aggregate.py and test_contract_server_update.py (their ``cuda`` cases run
wherever a CUDA device exists).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

import python_ref.aggregation as ref_agg
from _contract import same_bits
from fedopt_kernels.backends.hyper import split

OPS = ("nar_step_", "nar_step_batched_", "aggregate", "add_noise_", "client_dots", "server_update_",
       "coordinate_select", "block_decode_aggregate", "topk_decode_aggregate", "block_quantize")

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

def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).cuda()


def check_close(actual, expected, dtype):
    """Cast-to-dtype comparison with the dtype's default tolerances (1-ulp rounding
    flips allowed: the kernels contract a*b+c into FMAs and sum in another order)."""
    torch.testing.assert_close(actual.cpu(), expected.to(actual.dtype).cpu(), equal_nan=True)


def check_norm(actual, expected):
    torch.testing.assert_close(actual.cpu(), expected.to(actual.dtype).cpu(), rtol=2e-5, atol=1e-6, equal_nan=True)


# ----------------------------------------------------------------------------- aggregate launch shapes

def make_clients(C, N, dtype, seed=0, as_2d=False):
    gen = torch.Generator().manual_seed(seed)
    X = randn((C, N), dtype, gen)
    return X if as_2d else [X[i].clone() for i in range(C)]


def run_aggregate(cuda, clients, weights, gamma, out_dtype, skip=None):
    N = clients.shape[1] if isinstance(clients, torch.Tensor) else clients[0].numel()
    out = torch.full((N,), 7.0, dtype=out_dtype, device="cuda")
    q, Q = cuda.aggregate(clients, weights, *split(gamma), out, skip)
    return out, q, Q


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


# ----------------------------------------------------------------------------- server_update_

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
            cuda.server_update_([], [], [], [], 3, 0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False, None)
            cuda.server_update_(*empty, 4, 0.0, lr, 1.0, None, 0.9, 0.99, 1e-3, False, skip)
            cuda.server_update_(empty[0], empty[1], [], [], 0, 0.1, None, 0.0, lr, 0.9, 0.99, 1e-3, False, None)


@needs_cuda
def test_server_update_rejects_memory_unsafe_arguments(cuda):
    gen = torch.Generator().manual_seed(70)
    shapes = [(5,), (6, 7)]
    case = SimpleNamespace(params=[randn(s, torch.float16, gen) for s in shapes],
                           updates=[randn(s, torch.float32, gen, 0.3) for s in shapes],  # the acc dtype
                           exp_avg=[randn(s, torch.float16, gen, 0.1) for s in shapes],
                           exp_avg_sq=[randn(s, torch.float16, gen, 0.1).abs() for s in shapes])
    writable = case.params + case.exp_avg + case.exp_avg_sq
    before = [t.clone() for t in writable]

    def call(params=None, updates=None, exp_avg=None, exp_avg_sq=None, rule=3):
        cuda.server_update_(case.params if params is None else params, case.updates if updates is None else updates,
                            case.exp_avg if exp_avg is None else exp_avg,
                            case.exp_avg_sq if exp_avg_sq is None else exp_avg_sq, rule, 0.1, None, 1.0, None, 0.8,
                            0.95, 1e-2, False, None)

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
    for t, b in zip(writable, before):
        assert same_bits(t, b)
