"""The fused fp8 (e4m3fn) encode, ``block_quantize`` kind 2 (issue 42), on every backend
(reference, the C++ CPU kernel, Triton under the interpreter, CUDA where a GPU exists)
against python_ref.compression.fp8_encode bit for bit -- scales and every code -- and
against hand-computed cases: every one of the 256 codes reached, ties rounded to even
(normal and subnormal), zeros, an all-zero block, Inf and NaN input, fp16/bf16/fp64
input, odd sizes, a tail block, empty.  Then the top-k encode (``topk_encode``: a C++ selection on
the CPU) against python_ref's stable sort: ties, NaN, +-0, +-Inf, k = 0 and k = N, odd
sizes, fp16/bf16/fp64."""

from __future__ import annotations

import pytest
import torch

from fedopt_kernels.ops import compressed as C
from python_ref import compression as P

NAN_SIGN_FREE = ("cuda",)  # the GPU's Inf / Inf is +NaN, x86's -NaN: the NaN code's sign bit may differ


def _bits(r):
    return r.codes.view(torch.uint8).cpu(), r.scales.cpu().view(torch.int32)


def _oracle(x, block):
    codes, scales = P.fp8_encode(x, block)
    return codes.view(torch.uint8), scales.view(torch.int32)


def _assert_codes_equal(got, want, name):
    if name in NAN_SIGN_FREE:  # both are NaN codes; which sign is the division's
        nan = (want & 0x7F) == 0x7F
        got, want = torch.where(nan, 0x7F, got), torch.where(nan, 0x7F, want)
    assert torch.equal(got, want), (name, (got != want).nonzero()[:5].reshape(-1).tolist())


def _assert_scales_equal(got, want):
    nan = torch.isnan(want.view(torch.float32))  # a NaN scale: any NaN (the server refuses it)
    assert torch.equal(torch.isnan(got.view(torch.float32)), nan)
    assert torch.equal(got[~nan], want[~nan])


def every_code_input() -> torch.Tensor:
    """Two blocks of 256: the first holds the value of every non-NaN e4m3fn code (with 448,
    so its scale is exactly 1 and x / s = x), 0.0 where a NaN code would be; the second a
    +NaN and a -NaN (scale NaN: every code of that block is a NaN code of its value's sign)."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = torch.where(torch.isnan(vals), 0.0, vals)
    nan_block = torch.zeros(256)
    nan_block[0] = float("nan")
    nan_block[1] = -float("nan")
    nan_block[2:] = (torch.arange(254) - 127) / 64
    return torch.cat([vals, nan_block])


def edge_input(N: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(N)
    # exact in fp32 and the same under every instruction set (torch.randn's bits are not):
    # 23-bit mantissas times powers of two over a wide range of magnitudes
    mant = torch.randint(-(2 ** 22), 2 ** 22, (N,), generator=g).float() / 2 ** 21
    x = (mant * torch.ldexp(torch.ones(N), torch.randint(-12, 12, (N,), generator=g))).to(dtype)
    if N > 500:
        x[96:192] = 0.0  # an all-zero block: scale 0, codes +0 (also for a -0.0)
        x[100] = -0.0
        x[192:288] = torch.tensor(1e-40).to(dtype)  # fp32 subnormals (0 in fp16/bf16)
        x[200] = -1e-39
        x[288:384] = ((torch.arange(96) - 48) / 32).to(dtype)  # exact (linspace's last bit depends on the ISA)
        x[300] = float("inf")  # scale +Inf: Inf / Inf is NaN, the rest / Inf is +-0
        x[400] = float("nan")  # scale NaN: every code of the block a NaN code
        x[480] = -float("inf")
        x[481] = float("nan")
    return x


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Triton interpreter: Inf / Inf
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_fused_fp8_encode_gives_python_refs_bits(backend, dtype):
    name, device = backend
    for N, block in ((0, 32), (1, 32), (31, 32), (263, 32), (1000 + 7, 96)):
        x = edge_input(N, dtype)
        r = C.encode(x.to(device), "fp8", block=block, backend=name)
        assert r.codes.dtype == torch.float8_e4m3fn and r.codes.shape == (N,) and r.scales.shape == (-(-N // block),)
        codes, scales = _bits(r)
        want_codes, want_scales = _oracle(x, block)
        _assert_codes_equal(codes, want_codes, name)
        _assert_scales_equal(scales, want_scales)
        if name not in NAN_SIGN_FREE:
            assert torch.equal(scales, want_scales)  # the NaN scale's bits too


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_every_code_is_reached(backend):
    name, device = backend
    x = every_code_input()
    r = C.encode(x.to(device), "fp8", block=256, backend=name)
    codes, scales = _bits(r)
    assert scales.view(torch.float32)[0] == 1.0 and torch.isnan(scales.view(torch.float32)[1])
    # the first block: x / 1 is the code's own value, so each code comes back (the NaN codes
    # 0x7F / 0xFF hold 0.0 and come back as 0x00); the second block holds the NaN codes
    want = torch.arange(256, dtype=torch.uint8)
    want[0x7F] = want[0xFF] = 0
    assert torch.equal(codes[:256], want)
    assert codes[256] == 0x7F and (codes[257] == 0xFF or name in NAN_SIGN_FREE)
    assert bool(((codes[256:] & 0x7F) == 0x7F).all())
    assert set(codes.tolist()) == set(range(256)) or name in NAN_SIGN_FREE
    _assert_codes_equal(codes, _oracle(x, 256)[0], name)


def test_hand_computed_ties_round_to_even(backend):
    """Scale 1 (448 in the block); ties between two e4m3fn neighbours go to the even
    mantissa, subnormals (spacing 2^-9) too, and past 448 the value clamps to 448."""
    name, device = backend
    x = torch.zeros(32)
    cases = {  # value -> its code's value, by hand
        448.0: 448.0, 1 + 1 / 16: 1.0, 1 + 3 / 16: 1.25, -(2 + 1 / 8): -2.0, -(2 + 3 / 8): -2.5,
        2.0 ** -10: 0.0, 3 * 2.0 ** -10: 2 * 2.0 ** -9, 2.0 ** -6 - 2.0 ** -10: 2.0 ** -6,  # ties at 2^-10 steps
        -2.0 ** -11: -0.0, 7 * 2.0 ** -10: 4 * 2.0 ** -9, 2.0 ** -20: 0.0, 1e-30: 0.0,
    }
    x[:len(cases)] = torch.tensor(list(cases))
    r = C.encode(x.to(device), "fp8", block=32, backend=name)
    assert float(r.scales[0]) == 1.0
    got = r.codes.cpu().float()[:len(cases)]
    want = torch.tensor(list(cases.values()))
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    # the clamp: 480 and more would be NaN in e4m3fn; with a scale of 1 the block's max
    # maps to 448 exactly, and a value of 448.5 (scale 448.5 / 448) to 448
    y = torch.tensor([448.5, -448.5, 1.0] + [0.0] * 29)
    codes = C.encode(y.to(device), "fp8", block=32, backend=name).codes.cpu().float()
    assert codes[0] == 448.0 and codes[1] == -448.0


def test_fp8_refuses_stochastic_and_the_raw_op_checks_its_kind(cpu_extension):
    x = torch.randn(64)
    with pytest.raises(ValueError, match="stochastic"):
        C.encode(x, "fp8", stochastic=True)
    with pytest.raises(RuntimeError, match="not fp8"):
        torch.ops.fedopt_C.block_quantize(x, 2, 32, True, 0, 0)
    with pytest.raises(RuntimeError, match=r"kind must be 0 \(int8\), 1 \(int4\) or 2 \(fp8\)"):
        torch.ops.fedopt_C.block_quantize(x, 3, 32, False, 0, 0)


# --------------------------------------------------------------------------------------
# top-k: the C++ CPU selection (fedopt_C::topk_encode), python_ref's sort elsewhere


def topk_input(N: int, dtype) -> torch.Tensor:
    """Values with many ties (|x| from a few levels, both signs), +-0, +-Inf, NaNs."""
    g = torch.Generator().manual_seed(N + 1)
    levels = torch.tensor([0.0, 0.25, 1.0, 3.0, 1e-3])
    x = levels[torch.randint(0, 5, (N,), generator=g)] * torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0)
    if N > 40:
        x[3], x[17], x[30] = float("nan"), -float("nan"), float("inf")
        x[11], x[12] = -float("inf"), -0.0
        x[20:25] = torch.randn(5, generator=g) * 10
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_fused_topk_encode_gives_python_refs_bits(backend, dtype):
    name, device = backend
    for N in (0, 1, 7, 263, 1000 + 3):
        x = topk_input(N, dtype)
        for k in sorted(k for k in {0, 1, 2, 3, 4, 5, N // 3, N - 1, N} if 0 <= k <= N):
            r = C.encode(x.to(device), "topk", k=k, backend=name)
            values, indices = P.topk_encode(x, k)
            assert torch.equal(r.indices.cpu(), indices), (name, N, k)
            assert torch.equal(r.codes.cpu().view(torch.int32), values.view(torch.int32)), (name, N, k)


@pytest.mark.parametrize("case", ["five_levels", "all_zero", "randn"])
def test_cpu_topk_over_several_chunks_gives_python_refs_bits(cpu_extension, case):
    """The CPU radix select's passes work by fixed chunks of 64 Ki values (csrc/cpu/
    compressed_encode.cpp): a run of equal magnitudes that k cuts spreads over several
    chunks, an all-zero update puts every value in one bucket, randn has distinct values;
    one and two threads."""
    N = 3 * 65536 + 123
    g = torch.Generator().manual_seed(11)
    x = {"five_levels": topk_input(N, torch.float32), "all_zero": torch.zeros(N),
         "randn": torch.randn(N, generator=g)}[case]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for k in (1, 65537, N // 3, N // 2 + 7, N - 1):
                r = C.encode(x, "topk", k=k, backend="cpu")
                values, indices = P.topk_encode(x, k)
                assert torch.equal(r.indices, indices), (case, threads, k)
                assert torch.equal(r.codes.view(torch.int32), values.view(torch.int32)), (case, threads, k)
    finally:
        torch.set_num_threads(before)


def test_topk_hand_computed_ties_nan_and_zeros(backend):
    """By hand: NaN ranks above +-Inf, equal magnitudes go to the lower index, -0 ties +0."""
    name, device = backend
    x = torch.tensor([1.0, -2.0, 2.0, float("nan"), -float("inf"), 0.0, -0.0, -1.0, 2.0])
    for k, want in ((1, [3]), (2, [3, 4]), (3, [1, 3, 4]), (5, [1, 2, 3, 4, 8]), (7, [0, 1, 2, 3, 4, 7, 8]),
                    (8, [0, 1, 2, 3, 4, 5, 7, 8])):
        r = C.encode(x.to(device), "topk", k=k, backend=name)
        assert r.indices.cpu().tolist() == want, (name, k)
        assert torch.equal(r.codes.cpu().view(torch.int32), x[want].view(torch.int32)), (name, k)


def test_topk_encode_op_checks_its_arguments_on_meta(cpu_extension):
    """The raw op on meta tensors (its fake: what a traced call runs, and the checks the
    CUDA kernel makes before it launches, csrc/cuda/topk_encode.cu): the shapes, and k
    outside [0, N] or an x that is not a 1-D float tensor refused with the argument named."""
    op = torch.ops.fedopt_C.topk_encode
    x = torch.empty(1001, device="meta")
    for k in (0, 1, 500, 1001):
        values, indices = op(x, k)
        assert (values.shape, values.dtype, indices.shape, indices.dtype) == ((k,), torch.float32, (k,), torch.int64)
    for bad_k in (-1, 1002):
        with pytest.raises(RuntimeError, match=r"k must be in \[0, 1001\]"):
            op(x, bad_k)
    with pytest.raises(RuntimeError, match="x must be a 1-D floating-point"):
        op(torch.empty(4, 5, device="meta"), 1)
    with pytest.raises(RuntimeError, match="x must be a 1-D floating-point"):
        op(torch.empty(9, dtype=torch.int32, device="meta"), 1)
    # and the CPU kernel itself says the same
    with pytest.raises(RuntimeError, match=r"k must be in \[0, 7\]"):
        op(torch.zeros(7), 8)
