"""The backend contract of the DP noise -- ``aggregate``'s ``noise_key``/``noise_std``
and ``add_noise_`` (fedopt_kernels/backends/__init__.py) -- run against every backend
(reference, cpu, triton, cuda), BIT FOR BIT against python_ref/gaussian_noise.py.

The oracle of each case is independent of the backend's noise: python_ref's ``n``
(its own tests check it against Random123's vectors and float64), combined with the
backend's own noiseless sum by torch's correctly rounded fp32/fp64 ``*`` and ``+``.
So the noise is checked exactly, and the noiseless part exactly as
tests/test_contract_aggregate.py checks it (here it only has to be the same bits with
and without the noise).  Paths: N = 0, 1, a vector tail, several blocks/chunks;
fp32/fp64 clients with out in the data dtype, fp16/bf16 with out in the data dtype
(one rounding) and in fp32; std a number and a one-element tensor; the skip flag; keys
at both ends of ``[0, 2^63)``; lists and ``[C, N]`` clients; pieces on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from _contract import DTYPES, acc_of, assert_bitwise, randn
from fedopt_kernels import backends
from fedopt_kernels.backends.hyper import split
from python_ref import gaussian_noise as noise_ref

KEYS = [0, 0x5DEECE66D, (1 << 63) - 1]


@pytest.fixture
def be(backend_impl):
    return backend_impl


def sizes(be):
    """N: empty, one, a vector tail, past a Triton block and a CPU chunk (small under
    the interpreter and on the reference backend)."""
    return [0, 1, 17, be.size(70001, 4099)]


def expected(base: torch.Tensor, key: int, std: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``round_out(base + std * n)`` with ``base`` in the acc dtype and ``std`` rounded to
    it (as the kernels take a float std or an acc-dtype tensor), on the CPU."""
    acc = base.dtype
    n = noise_ref.noise(key, base.numel()).to(acc)
    return (base.cpu() + torch.tensor(std, dtype=acc) * n).to(out_dtype)


def std_arg(be, std, as_tensor, acc):
    return torch.tensor(std, dtype=acc, device=be.device) if as_tensor else std


def aggregate(be, X, w, gamma, out, skip=None, noise=None):
    if noise is None:
        return be.module.aggregate(X, w, *split(gamma), out, skip)
    key, std = noise
    return be.module.aggregate(X, w, *split(gamma), out, skip, key, *split(std))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key", KEYS)
def test_add_noise_is_python_ref_bit_for_bit(be, dtype, key):
    acc = acc_of(dtype)
    for N in sizes(be):
        for as_tensor in (False, True):
            out = randn((N,), dtype, be.device, torch.Generator().manual_seed(N))
            want = expected(out.to(acc), key, 0.37, dtype)
            be.module.add_noise_(out, key, *split(std_arg(be, 0.37, as_tensor, acc)))
            assert_bitwise(out.cpu(), want, f"add_noise_ N={N} tensor std={as_tensor}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_acc", [False, True], ids=["out_data_dtype", "out_acc_dtype"])
@pytest.mark.parametrize("as_2d", [False, True], ids=["list", "2d"])
def test_aggregate_noise_is_the_noiseless_sum_plus_python_refs_noise(be, dtype, out_acc, as_2d):
    """out = round_out(gamma * total + std * n): the same backend's noiseless sum (in the
    acc dtype, whose bits the out dtype does not change) plus python_ref's noise, rounded
    once; the norms are the noiseless call's, bit for bit."""
    acc = acc_of(dtype)
    out_dtype = acc if out_acc else dtype
    for N in sizes(be):
        C = 5
        X = randn((C, N), dtype, be.device, torch.Generator().manual_seed(N + 1))
        clients = X if as_2d else [X[i].clone() for i in range(C)]
        w = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.75], dtype=acc, device=be.device)  # a zero weight too
        for as_tensor, key in ((False, KEYS[1]), (True, KEYS[2])):
            std = std_arg(be, 0.6, as_tensor, acc)
            plain = torch.full((N,), 7.0, dtype=acc, device=be.device)
            q0, Q0 = aggregate(be, clients, w, 0.9, plain)
            out = torch.full((N,), 7.0, dtype=out_dtype, device=be.device)
            q, Q = aggregate(be, clients, w, 0.9, out, noise=(key, std))
            assert_bitwise(out.cpu(), expected(plain, key, 0.6, out_dtype), f"N={N}")
            assert_bitwise([q, Q], [q0, Q0], "norms with and without the noise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused_noise_equals_aggregate_then_add_noise(be, dtype):
    N = be.size(70001, 4099)
    X = randn((4, N), dtype, be.device, torch.Generator().manual_seed(3))
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype, device=be.device)
    fused = torch.empty(N, dtype=dtype, device=be.device)
    aggregate(be, X, w, 0.25, fused, noise=(KEYS[1], 1.5))
    apart = torch.empty(N, dtype=dtype, device=be.device)
    aggregate(be, X, w, 0.25, apart)
    be.module.add_noise_(apart, KEYS[1], *split(1.5))
    assert_bitwise(fused, apart, "fused vs separate")


def test_skip_leaves_out_untouched_noise_included(be):
    N = be.size(5000, 1025)
    X = randn((3, N), torch.float32, be.device, torch.Generator().manual_seed(4))
    w = torch.ones(3, device=be.device)
    out = torch.full((N,), 7.0, device=be.device)
    q, Q = aggregate(be, X, w, 1.0, out, skip=torch.ones((), dtype=torch.bool, device=be.device),
                     noise=(KEYS[1], 1.0))
    assert bool((out == 7.0).all()) and not bool(q.any()) and float(Q) == 0.0
    aggregate(be, X, w, 1.0, out, skip=torch.zeros((), dtype=torch.bool, device=be.device), noise=(KEYS[1], 1.0))
    plain = torch.empty(N, device=be.device)
    aggregate(be, X, w, 1.0, plain)
    assert_bitwise(out.cpu(), expected(plain, KEYS[1], 1.0, torch.float32))


def test_add_noise_skip_flag(be):
    N = be.size(5000, 1025)
    out = randn((N,), torch.float32, be.device, torch.Generator().manual_seed(7))
    before = out.clone()
    be.module.add_noise_(out, KEYS[1], 1.0, None, torch.ones((), dtype=torch.bool, device=be.device))
    assert_bitwise(out, before, "skipped")
    be.module.add_noise_(out, KEYS[1], 1.0, None, torch.zeros((), dtype=torch.bool, device=be.device))
    assert_bitwise(out.cpu(), expected(before.cpu(), KEYS[1], 1.0, torch.float32), "not skipped")


def test_keys_give_different_noise_and_std_zero_adds_nothing(be):
    N = be.size(4099, 257)
    draws = []
    for key in KEYS:
        out = torch.zeros(N, device=be.device)
        be.module.add_noise_(out, key, 1.0, None)
        draws.append(out.cpu())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    out = randn((N,), torch.float32, be.device, torch.Generator().manual_seed(5))
    before = out.clone()
    be.module.add_noise_(out, KEYS[0], 0.0, None)
    assert_bitwise(out, before, "std 0")


def test_pieces_with_noise_are_the_rows_with_noise(cpu_extension):
    """The CPU's in-place read of replies (aggregate_pieces, the one backend that has it)
    with the noise: the bits of aggregate over the rows they would be stacked into."""
    cpu = backends.resolve("cpu", torch.device("cpu"))
    N1, N2 = 1000, 2113
    X = randn((3, N1 + N2), torch.float32, "cpu", torch.Generator().manual_seed(6))
    pieces = [p.contiguous() for i in range(3) for p in (X[i, :N1], X[i, N1:])]
    w = torch.tensor([0.2, 0.3, 0.5])
    a, b = torch.empty(N1 + N2), torch.empty(N1 + N2)
    qa, Qa = cpu.aggregate_pieces(pieces, 2, None, w, 1.0, None, a, None, KEYS[1], 0.5, None)
    qb, Qb = cpu.aggregate(X, w, 1.0, None, b, None, KEYS[1], 0.5, None)
    assert_bitwise([a, qa, Qa], [b, qb, Qb], "pieces vs rows")  # rows with noise: the cases above
