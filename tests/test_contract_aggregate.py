"""The backend contract of the aggregation -- ``aggregate`` and ``client_dots`` -- run
against every backend (reference, cpu, triton, cuda) through the backend module itself
(fedopt_kernels/backends/__init__.py), against python_ref.

Paths reached on purpose: one client of one element up to 100 clients (several client
batches), odd column counts (vector and tile tails), whole and ragged chunk stripes,
lists of 1-D clients and one ``[C, N]`` tensor (the same bits), misaligned client
views and output views, an output in the data or the acc dtype, a float or a 0-d
gamma, a zero-weight client holding NaN and Inf, the in-kernel skip flag, no columns
at all.  Sizes, interpreter sizes and tolerances: tests/_contract.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import python_ref.aggregation as ref_agg
from _contract import (DTYPES, LOW, acc_of, assert_bitwise, assert_norms_close, assert_values_close, randn,
                       same_bits)


@pytest.fixture
def be(backend_impl):
    return backend_impl


def make_clients(be, C, N, dtype, seed=0, as_2d=False):
    X = randn((C, N), dtype, be.device, torch.Generator().manual_seed(seed))
    return X if as_2d else [X[i].clone() for i in range(C)]


def stacked(clients):
    return clients if isinstance(clients, torch.Tensor) else torch.stack(clients)


def as_list(clients):
    return [c.clone() for c in clients.unbind(0)] if isinstance(clients, torch.Tensor) else clients


def run_aggregate(be, clients, weights, gamma, out_dtype, skip=None, fill=7.0):
    """``out`` (filled with ``fill`` first), ``client_sq_norms``, ``sq_norm``."""
    N = clients.shape[1] if isinstance(clients, torch.Tensor) else clients[0].numel()
    out = torch.full((N,), fill, dtype=out_dtype, device=be.device)
    q, Q = be.aggregate(clients, weights, gamma, out, skip)
    return out, q, Q


def check_out(be, out, out_r):
    """The aggregate against python_ref's: bitwise where the backend sums as python_ref
    does (same client order, no FMA), else within the backend's tolerance."""
    expected = out_r.to(out.dtype)
    if be.rounds_like_python_ref:
        assert_bitwise([out], [expected], "aggregate")
    else:
        assert_values_close(be, out, expected)


def check_aggregate(be, result, clients, weights, gamma, dtype):
    out, q, Q = result
    C = len(clients)
    out_r, q_r, Q_r = ref_agg.aggregate(clients, weights, gamma)
    acc = acc_of(dtype)
    assert q.shape == (C,) and q.dtype == acc and Q.shape == () and Q.dtype == acc
    assert q.device.type == be.device.type
    check_out(be, out, out_r)
    # Sums of squares: no cancellation, so no absolute floor where the backend was held to none.
    atol = 0.0 if be.name in ("cpu", "triton") else None
    assert_norms_close(be, q, q_r, dtype, atol=atol)
    assert_norms_close(be, Q, Q_r, dtype, atol=atol)


# ----------------------------------------------------------------------------- aggregate

# name -> ((C, N), small (C, N)): one client of one element; 7 clients (the CPU kernels'
# batches of four and the rest) of one element, of a vector tail, of odd N past a block;
# a CPU stripe (16 chunks of 4096 columns) exactly, and one column more; several
# chunks/tiles with a ragged one; more than 32 clients (several client batches).
AGG_SIZES = {"1x1": ((1, 1), (1, 1)), "7x1": ((7, 1), (7, 1)), "3x5": ((3, 5), (3, 5)), "7x5": ((7, 5), (7, 5)),
             "4x1025": ((4, 1025), (4, 1025)), "7x1025": ((7, 1025), (7, 1025)),
             "stripe": ((7, 65536), (7, 2048)), "stripe+1": ((7, 65537), (7, 2049)),
             "many_chunks": ((5, 278011), (3, 30011)), "37_clients": ((37, 4099), (37, 129))}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_acc", [False, True], ids=["out_data_dtype", "out_acc_dtype"])
@pytest.mark.parametrize("size", list(AGG_SIZES))
def test_aggregate_matches_python_ref(be, dtype, out_acc, size):
    """A list of 1-D clients and one [C, N] tensor: python_ref's aggregate, and the same
    bits as each other where the kernels' sums do not depend on the layout."""
    full, small = AGG_SIZES[size]
    if size == "many_chunks" and be.interpreted:  # Triton's own sizes: fp32 at full length
        small = (3, 4099) if out_acc else (3, 278011) if dtype == torch.float32 else (3, 30011)
    C, N = be.size(full, small)
    X = make_clients(be, C, N, dtype, seed=C * 1000 + N, as_2d=True)
    acc = acc_of(dtype)
    weights = (torch.rand(C, dtype=acc, generator=torch.Generator().manual_seed(1)) + 0.1).to(be.device)
    gamma = torch.tensor(0.9, dtype=acc, device=be.device) if C % 2 else 0.9
    out_dtype = acc if out_acc else dtype
    results = []
    for clients in (as_list(X), X):
        result = run_aggregate(be, clients, weights, gamma, out_dtype)
        assert result[0].dtype == out_dtype and result[0].shape == (N,)
        check_aggregate(be, result, clients, weights, gamma, dtype)
        results.append(result)
    if be.layout_free_sums:
        assert_bitwise(results[0], results[1], "list vs [C, N]")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aggregate_out_in_acc_dtype_and_gamma_tensor(be, dtype):
    C, N = 4, be.size(40000, 5003)  # several chunks
    X = make_clients(be, C, N, dtype, seed=13, as_2d=True)
    acc = acc_of(dtype)
    w = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=acc, device=be.device)
    out = torch.full((N,), 7.0, dtype=acc, device=be.device)
    q, Q = be.aggregate(X, w, torch.tensor(1.5, dtype=acc, device=be.device), out, None)
    out_r, q_r, Q_r = ref_agg.aggregate(X, w, 1.5)
    assert out.dtype == acc
    check_out(be, out, out_r)
    if be.name == "triton":
        torch.testing.assert_close(out, out_r, rtol=1e-6, atol=1e-6)
    out2, _, _ = run_aggregate(be, X, w, 1.5, dtype)  # a float gamma, out in the data dtype
    check_out(be, out2, out_r)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
@pytest.mark.parametrize("N", [1025, 3000, 140001])
def test_aggregate_zero_weight_client_with_nan(be, dtype, as_2d, N):
    """A weight-0 client holding NaN and Inf leaves the aggregate finite (0 * its values is
    never added); its own squared norm is NaN.  Clients 0-3 include the zero weight, so
    the CPU kernels run them one at a time; 4-7 run as four; 8 alone."""
    C, N = 9, be.size(N, min(N, 4099))
    X = randn((C, N), dtype, be.device, torch.Generator().manual_seed(14))
    X[2, ::7] = float("nan")
    X[2, 5 % N] = float("inf")
    w = torch.tensor([0.3, 0.3, 0.0, 0.4, 0.1, 0.2, 0.3, 0.4, 0.5], device=be.device)
    clients = X if as_2d else [r.clone() for r in X]
    out, q, Q = run_aggregate(be, clients, w, 1.0, dtype)
    assert bool(torch.isfinite(out).all()) and math.isfinite(float(Q))
    assert math.isnan(float(q[2])) and bool(torch.isfinite(q[[0, 1] + list(range(3, C))]).all())
    check_aggregate(be, (out, q, Q), clients, w, 1.0, dtype)


@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
def test_aggregate_skip_flag(be, as_2d):
    """skip true: ``out`` untouched, zero statistics; false: the aggregate (read on the
    device when the kernel runs)."""
    C, N = 3, 3001
    clients = make_clients(be, C, N, torch.float32, seed=14, as_2d=as_2d)
    w = torch.tensor([0.2, 0.3, 0.5], device=be.device)
    out, q, Q = run_aggregate(be, clients, w, 2.0, torch.float32, torch.tensor(True, device=be.device), fill=3.0)
    assert same_bits(out, torch.full((N,), 3.0, device=be.device))
    assert q.shape == (C,) and q.tolist() == [0.0] * C and Q.shape == () and float(Q) == 0.0
    result = run_aggregate(be, clients, w, 2.0, torch.float32, torch.tensor(False, device=be.device), fill=3.0)
    check_aggregate(be, result, clients, w, 2.0, torch.float32)


@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
def test_aggregate_no_columns(be, as_2d):
    clients = torch.empty(3, 0, device=be.device) if as_2d else [torch.empty(0, device=be.device) for _ in range(3)]
    out = torch.empty(0, device=be.device)
    q, Q = be.aggregate(clients, torch.tensor([0.2, 0.3, 0.5], device=be.device), 1.0, out, None)
    assert out.shape == (0,) and q.tolist() == [0.0] * 3 and Q.shape == () and float(Q) == 0.0


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_aggregate_misaligned_views(be, dtype):
    """Clients and ``out`` as views at odd offsets (the scalar bodies); rows of a [C, N]
    tensor with N * sizeof not a multiple of 16 (rows misaligned) too."""
    C, N = 3, 2050
    flat = randn((1 + C * N,), dtype, be.device, torch.Generator().manual_seed(15))
    clients = [flat[1 + i * N:1 + (i + 1) * N] for i in range(C)]
    assert clients[0].data_ptr() % 16 != 0
    w = torch.tensor([0.1, 0.6, 0.3], device=be.device)
    out_buf = torch.zeros(N + 1, dtype=dtype, device=be.device)
    out = out_buf[1:]
    q, Q = be.aggregate(clients, w, 2.0, out, None)
    check_aggregate(be, (out, q, Q), clients, w, 2.0, dtype)
    assert float(out_buf[0]) == 0.0  # nothing written before the view
    X = torch.stack(clients)[:, :N - 1].contiguous()
    check_aggregate(be, run_aggregate(be, X, w, 2.0, dtype), X, w, 2.0, dtype)
    # Two views at odd offsets beside an aligned client (alignment decided per client).
    base = randn((3, N + 1), dtype, be.device, torch.Generator().manual_seed(16))
    mixed = [base[0, 1:], base[1, 1:], base[2, :N]]
    check_aggregate(be, run_aggregate(be, mixed, w, 2.0, dtype), mixed, w, 2.0, dtype)
    # The same values in aligned tensors: the same bits.
    aligned = run_aggregate(be, [c.clone() for c in clients], w, 2.0, dtype)
    if be.layout_free_sums:
        assert_bitwise([out, q, Q], aligned, "misaligned vs aligned")


def test_aggregate_deterministic_bitwise(be):
    """Twice the same bits; the same data as one [C, N] tensor the same bits again (N * 4
    bytes a multiple of 16: both forms vectorised)."""
    C, N = be.size((40, 300_004), (5, 100_004), host=(40, 70_004))
    clients = make_clients(be, C, N, torch.float32, seed=16, as_2d=False)
    w = torch.rand(C, generator=torch.Generator().manual_seed(2)).to(be.device)
    a = run_aggregate(be, clients, w, 0.7, torch.float32)
    b = run_aggregate(be, clients, w, 0.7, torch.float32)
    assert_bitwise(a, b, "second run")
    if be.layout_free_sums and not be.small:  # (the small sizes compare the layouts elsewhere)
        c = run_aggregate(be, torch.stack(clients), w, 0.7, torch.float32)
        assert_bitwise(a, c, "[C, N]")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [62_000, 3000, 5])
def test_aggregate_100_clients_small_n(be, dtype, N):
    """C = 100 clients of a small model (several client batches; 40 at the small sizes):
    the list and [C, N] forms agree bitwise, misaligned views of the same values (scalar
    loads) too; all equal python_ref; client_dots likewise."""
    C = be.size(100, 40)
    N = be.size(N, {62_000: 129, 3000: 33, 5: 5}[N], host={62_000: 4099}.get(N, N))
    clients = make_clients(be, C, N, dtype, seed=N, as_2d=False)
    acc = acc_of(dtype)
    w = torch.rand(C, dtype=acc, generator=torch.Generator().manual_seed(3)).to(be.device)
    w[7] = 0.0
    gamma = torch.tensor(0.8, dtype=acc, device=be.device)
    result = run_aggregate(be, clients, w, gamma, dtype)
    check_aggregate(be, result, clients, w, gamma, dtype)
    flat = torch.zeros(1 + C * N, dtype=dtype, device=be.device)
    views = []
    for i, c in enumerate(clients):
        flat[1 + i * N:1 + (i + 1) * N] = c
        views.append(flat[1 + i * N:1 + (i + 1) * N])
    g = randn((N,), dtype, be.device, torch.Generator().manual_seed(4))
    d = be.client_dots(clients, g)
    check_dots(be, d, clients, g)
    for other in (torch.stack(clients), views):
        if be.layout_free_sums:
            assert_bitwise(result, run_aggregate(be, other, w, gamma, dtype), "other layout")
            assert same_bits(d, be.client_dots(other, g))
        else:
            check_aggregate(be, run_aggregate(be, other, w, gamma, dtype), other, w, gamma, dtype)
            check_dots(be, be.client_dots(other, g), other, g)


# ----------------------------------------------------------------------------- client_dots

def check_dots(be, d, clients, g):
    """``client_dots`` against python_ref's and the exact (fp64) dots of the same inputs,
    within a summation-error bound relative to the terms' magnitude (the dots
    themselves may cancel): each backend as strictly as it has been held."""
    X = stacked(clients)
    C, N = X.shape
    acc = acc_of(X.dtype)
    assert d.shape == (C,) and d.dtype == acc and d.device.type == be.device.type
    d_r = ref_agg.client_dots(clients, g)
    prod = X.cpu().double() * g.cpu().double()
    terms = prod.abs().sum(1)
    err_ref = (d.cpu().double() - d_r.cpu().double()).abs()
    err_exact = (d.cpu().double() - prod.sum(1)).abs()
    fp64 = acc == torch.float64
    if be.name == "reference":
        assert_bitwise([d], [d_r], "python_ref")
    elif be.name == "cpu":
        assert bool((err_ref <= (1e-12 if fp64 else 1e-6) * terms).all()), (d, d_r)
    elif be.name == "triton":
        assert bool((err_exact <= (1e-14 if fp64 else 1e-6) * terms).all()), (d, prod.sum(1))
        torch.testing.assert_close(d.cpu(), d_r.cpu(), rtol=1e-4, atol=1e-3)
    else:
        torch.testing.assert_close(d.cpu(), d_r.cpu(), rtol=2e-5, atol=1e-9 if fp64 else 2e-4 * N ** 0.5)


# name -> ((C, N), small (C, N)[, (C, N) on the CPU kernels])
DOT_SIZES = {"1x1": ((1, 1), (1, 1)), "3x5": ((3, 5), (3, 5)), "6x5": ((6, 5), (6, 5)),
             "4x1025": ((4, 1025), (4, 1025)), "6x1025": ((6, 1025), (6, 1025)),
             "stripe": ((6, 65536), (6, 2048)), "6x70001": ((6, 70001), (6, 2049)), "4x10007": ((4, 10007), (4, 10007)),
             "33_clients": ((33, 278011), (33, 129), (33, 4099))}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g_acc", [False, True], ids=["g_data_dtype", "g_acc_dtype"])
@pytest.mark.parametrize("size", list(DOT_SIZES))
def test_client_dots_matches_python_ref(be, dtype, g_acc, size):
    """A list of 1-D clients and one [C, N] tensor, g in the data or the acc dtype:
    python_ref's dots, the same bits for both layouts where the kernels promise it."""
    C, N = be.size(*DOT_SIZES[size])
    X = make_clients(be, C, N, dtype, seed=C + N, as_2d=True)
    g = randn((N,), acc_of(dtype) if g_acc else dtype, be.device, torch.Generator().manual_seed(17))
    dots = []
    for clients in (as_list(X), X):
        dots.append(be.client_dots(clients, g))
        check_dots(be, dots[-1], clients, g)
    if be.layout_free_sums:
        assert same_bits(dots[0], dots[1])  # list vs [C, N]


def test_client_dots_no_columns(be):
    assert be.client_dots(torch.empty(2, 0, device=be.device), torch.empty(0, device=be.device)).tolist() == [0.0] * 2
    empty = [torch.empty(0, device=be.device) for _ in range(3)]
    assert be.client_dots(empty, torch.empty(0, device=be.device)).tolist() == [0.0] * 3


def test_client_dots_misaligned_and_deterministic(be):
    C, N = 5, be.size(100_003, 10_007)
    gen = torch.Generator().manual_seed(18)
    flat = randn((1 + C * N,), torch.float32, be.device, gen)
    clients = [flat[1 + i * N:1 + (i + 1) * N] for i in range(C)]
    g = randn((N + 1,), torch.float32, be.device, gen)[1:]
    d1, d2 = be.client_dots(clients, g), be.client_dots(clients, g)
    assert same_bits(d1, d2)
    torch.testing.assert_close(d1, ref_agg.client_dots(clients, g), rtol=2e-5, atol=1e-2)
    check_dots(be, d1, clients, g)
    # The aligned copies go through the vectorised bodies: close, and the same bits where
    # held to it (not CUDA with g misaligned too).
    aligned = be.client_dots([c.clone() for c in clients], g.clone())
    torch.testing.assert_close(aligned, d1, rtol=2e-5, atol=1e-2)
    if be.layout_free_sums and be.name != "cuda":
        assert same_bits(aligned, d1)
