"""The Triton top-k encode (backends/triton/topk_encode.py, a radix select) under the
interpreter (tests/conftest.py sets TRITON_INTERPRET=1), against two oracles: python_ref's
stable sort of |x| (bit for bit: the indices and the fp32 values) and, independently of
torch.sort, a numpy lexsort on (-|x|, j) in float64 written here.  Cases that decide the
selection on each part of the key: distinct magnitudes (the magnitude digits), long runs
of equal |x| with the k-th inside them (the index digits), NaN / +-Inf / +-0, fp32 and bf16
subnormals, every dtype, tails of a tile, k = 0, 1, N - 1, N; and the wrapper's argument
checks, made before any launch.  tests/test_compressed_encode.py runs the same encode
through ``ops.compressed.encode`` on every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import import_triton_module

import_triton_module("triton")

from fedopt_kernels.backends import compressed as B  # noqa: E402
from fedopt_kernels.backends.triton import topk_encode as K  # noqa: E402
from python_ref import compression as P  # noqa: E402

encode = B.topk_encode("triton")


def lexsort_oracle(x: torch.Tensor, k: int):
    """The k largest |x| by a float64 lexsort (NaN largest, ties to the lower index), indices ascending."""
    a = np.abs(x.to(torch.float32).to(torch.float64).numpy())
    a = np.where(np.isnan(a), np.inf, a)
    rank = np.isnan(x.to(torch.float32).numpy()).astype(np.int8)  # NaN above +Inf
    order = np.lexsort((np.arange(a.size), -a, -rank))[:k]  # last key is the primary one
    idx = np.sort(order)
    return torch.from_numpy(idx.astype(np.int64))


def check(x: torch.Tensor, k: int):
    values, indices = encode(x, k)
    want_v, want_i = P.topk_encode(x, k)
    assert indices.dtype == torch.int64 and values.dtype == torch.float32
    assert torch.equal(indices, want_i), (x.dtype, x.numel(), k)
    assert torch.equal(values.view(torch.int32), want_v.view(torch.int32)), (x.dtype, x.numel(), k)
    assert torch.equal(indices, lexsort_oracle(x, k)), (x.dtype, x.numel(), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_distinct_magnitudes_every_k(dtype):
    g = torch.Generator().manual_seed(1)
    N = 3 * K.TOPK_BLOCK + 17  # a tail tile
    x = (torch.randn(N, generator=g, dtype=torch.float64) * 10).to(dtype)
    for k in (1, 2, 31, N // 100, N // 2, N - 1):
        check(x, k)


def test_ties_decided_by_the_index_digits():
    """One magnitude over whole tiles, both signs: the k-th largest lies inside the run, so
    the index digits decide; the first k of the run are taken, lowest indices first."""
    N = 2 * K.TOPK_BLOCK + 5
    x = torch.full((N,), 0.5)
    x[1::3] = -0.5
    x[100] = 2.0
    for k in (1, 2, 3, 700, K.TOPK_BLOCK + 1, N - 2):
        check(x, k)
    v, i = encode(x, 4)
    assert i.tolist() == [0, 1, 2, 100]


def test_nan_inf_signed_zero_and_subnormals():
    x = torch.tensor([1.0, -2.0, 2.0, float("nan"), -float("inf"), 0.0, -0.0, -1.0, 2.0, 1e-45, -1e-40, 1e-40])
    for k, want in ((1, [3]), (2, [3, 4]), (3, [1, 3, 4]), (5, [1, 2, 3, 4, 8]), (9, [0, 1, 2, 3, 4, 7, 8, 10, 11]),
                    (11, [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11])):
        v, i = encode(x, k)
        assert i.tolist() == want, k
        check(x, k)
    # many NaNs (all equal: the lowest indices first) and zeros of both signs
    y = torch.zeros(1500)
    y[::2] = -0.0
    y[[7, 3, 900, 1499]] = float("nan")
    y[[5, 11]] = -float("inf")
    for k in (2, 4, 5, 6, 7, 1000):
        check(y, k)


def test_bf16_and_fp16_subnormals():
    """bf16 subnormals reach the kernel as bits (the interpreter's bf16 conversion flushes
    them); fp16 subnormals widen exactly."""
    x = (torch.arange(1, 401, dtype=torch.float32) * 1e-40 * torch.where(torch.arange(400) % 2 == 0, 1.0, -1.0))
    check(x.to(torch.bfloat16), 37)
    h = (torch.arange(1, 401, dtype=torch.float32) * 6e-8).to(torch.float16)
    check(h, 37)
    assert (x.to(torch.bfloat16).float() != 0).all() and (h.float() < 6.1e-5).all()  # they are subnormal, not zero


def test_all_equal_and_the_edges_of_k():
    for N in (1, 7, K.TOPK_BLOCK, K.TOPK_BLOCK + 1):
        x = torch.full((N,), -3.0)
        for k in {0, 1, N - 1, N}:
            check(x, k)
    v, i = encode(torch.empty(0), 0)
    assert v.shape == (0,) and i.shape == (0,) and i.dtype == torch.int64
    x = torch.randn(50, dtype=torch.float64)
    v, i = encode(x, 50)  # k == N: every index, values rounded once to fp32
    assert torch.equal(i, torch.arange(50)) and torch.equal(v, x.to(torch.float32))
    assert v.data_ptr() != x.data_ptr()


def test_bad_input_is_refused_before_any_launch():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="k must be in \\[0, 10\\], got 11"):
        encode(x, 11)
    with pytest.raises(ValueError, match="k must be in"):
        encode(x, -1)
    with pytest.raises(ValueError, match="x must be a 1-D floating-point tensor"):
        encode(x.reshape(2, 5), 1)
    with pytest.raises(ValueError, match="x must be a 1-D floating-point tensor"):
        encode(torch.arange(10), 1)
