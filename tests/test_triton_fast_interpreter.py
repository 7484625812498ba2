"""tests/_fast_interpreter.py: the suite's shortcut past Triton's redundant re-patching
in the interpreter gives every kernel of the Triton backend the same bits as Triton's
own path, and really skips the re-patching (else the interpreted cases cost 3-4x)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from _contract import Backend, assert_bitwise, make_lists, randn
from conftest import import_triton_module
from fedopt_kernels.backends import triton_interpret_mode

import_triton_module("fedopt_kernels.backends.triton")
interpreter = import_triton_module("triton.runtime.interpreter")
import _fast_interpreter  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_interpret_mode(), reason="the interpreter runs on CPU tensors only")


def _every_kernel(be: Backend, dtype: torch.dtype):
    """Every launch of the backend once (odd sizes, a misaligned view, a NaN row): the
    outputs and statistics, flattened to a list of tensors."""
    gen = torch.Generator().manual_seed(5)
    params, grads, bufs = make_lists([(5,), (1025,), (3, 7)], dtype, be.device, seed=3)
    stats = be.nar_step_(params, grads, bufs, 0.1, 0.01, 1.0, 0, 0.9, None, None)
    X, G, B = (randn((3, 1027), dtype, be.device, gen) for _ in range(3))
    G[1, 4] = float("nan")
    bstats = be.nar_step_batched_(X, G, B, torch.tensor([0.1, 0.2, 0.3]), 0.01, 1.0, 1, 0.9, None, None)
    flat = randn((1 + 4 * 1029,), dtype, be.device, gen)
    clients = [flat[1 + i * 1029:1 + (i + 1) * 1029] for i in range(4)]
    out = torch.empty(1029, dtype=dtype)
    q, Q = be.aggregate(clients, torch.tensor([0.1, 0.2, 0.3, 0.4]), 0.9, out, None)
    d = be.client_dots(torch.stack(clients), randn((1029,), dtype, be.device, gen))
    x, m, v = ([randn((1025,), dtype, be.device, gen, 0.1).abs()] for _ in range(3))
    be.server_update_(x, [randn((1025,), torch.float32, be.device, gen)], m, v, 3, 0.03, 0.9, 0.9, 0.99, 1e-3,
                      False, None)
    stat_tensors = [t for st in (stats, bstats) for t in (st if isinstance(st, (tuple, list)) else [st])
                    if isinstance(t, torch.Tensor)]
    return params + bufs + [X, B, out, q, Q, d] + x + m + v + stat_tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_shortcut_gives_the_bits_of_tritons_own_path(dtype):
    assert _fast_interpreter.install(), (
        "tests/_fast_interpreter.py no longer recognises this Triton's interpreter: the interpreted "
        "cases still pass, 3-4x slower; update the shortcut to the new InterpretedFunction.__call__")
    be = Backend("triton", torch.device("cpu"))
    fast = _every_kernel(be, dtype)  # first: nothing patched for good yet (in a fresh process)
    with _fast_interpreter.disabled():
        own = _every_kernel(be, dtype)
    assert_bitwise(fast, own, "shortcut vs Triton's own path", nan_ok=False)


def test_the_shortcut_skips_the_re_patching(monkeypatch):
    """Triton's path re-patches triton.language at every device-function call; the
    shortcut only at each launch (and at the first call of a function that sees a
    language module no launch patched)."""
    be = Backend("triton", torch.device("cpu"))
    _every_kernel(be, torch.float32)  # the first calls, which patch tl.core for good
    calls = []
    real = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn.__name__) or real(fn))
    with _fast_interpreter.disabled():
        _every_kernel(be, torch.float32)
    own = list(calls)
    calls.clear()
    _every_kernel(be, torch.float32)
    launches = [n for n in own if n.endswith("_kernel")]
    assert launches and sorted(calls) == sorted(launches), (calls, launches)
    assert len(own) > 5 * len(launches), own  # the device calls' re-patching, skipped


# ---------------------------------------------------------------- xor_sum through numpy

triton = import_triton_module("triton")
tl = import_triton_module("triton.language")


@triton.jit
def _sort_rows_kernel(x_ptr, out_ptr, R: tl.constexpr, CP: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * CP + tl.arange(0, CP)[None, :]
    tl.store(out_ptr + offs, tl.sort(tl.load(x_ptr + offs), dim=1))


@triton.jit
def _xor_sums_kernel(x_ptr, rows_ptr, cols_ptr, all_ptr, R: tl.constexpr, CP: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * CP + tl.arange(0, CP)[None, :])
    tl.store(rows_ptr + tl.arange(0, R)[:, None], tl.xor_sum(x, axis=1, keep_dims=True))
    tl.store(cols_ptr + tl.arange(0, CP), tl.xor_sum(x, axis=0))
    tl.store(all_ptr, tl.xor_sum(x))


def _awkward_rows(dtype, R=8, CP=16):
    """Rows of NaN, signed zeros, infinities, ties and plain normals; NaN and -0.0 vs 0.0
    are ordered by the network's positions, not by value."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(R, CP, generator=g, dtype=torch.float64).to(dtype)
    x[0, ::3] = float("nan")
    x[1, :8] = 0.0
    x[1, 1::2] = -0.0
    x[2, ::2] = float("inf")
    x[2, 1::4] = float("-inf")
    x[3] = x[3, :4].repeat(4)  # ties
    x[4] = float("nan")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_sort_through_the_numpy_xor_gives_the_bits_of_tritons_own_path(dtype):
    x = _awkward_rows(dtype)
    fast, own = torch.empty_like(x), torch.empty_like(x)
    _sort_rows_kernel[(1,)](x, fast, R=x.shape[0], CP=x.shape[1])
    with _fast_interpreter.disabled():
        _sort_rows_kernel[(1,)](x, own, R=x.shape[0], CP=x.shape[1])
    # bit patterns, so that the places of -0.0 / 0.0 and NaN payloads count too
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    assert torch.equal(fast.view(bits), own.view(bits))
    if dtype == torch.bfloat16:
        return  # the interpreter keeps bf16 as uint16 and compares those, so its bf16 "sort" is
        # no sort on either path (coordinate_select sorts in the acc dtype, fp32 / fp64)
    clean = ~torch.isnan(x).any(dim=1)  # rows without NaN: the values are torch's sort
    assert torch.equal(fast[clean], torch.sort(x[clean], dim=1).values)


def test_xor_sum_through_numpy_is_the_xor_of_the_bits():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-2**31, 2**31 - 1, (4, 8), generator=g, dtype=torch.int32)
    runs = []
    for ctx in (_fast_interpreter.disabled, contextlib.nullcontext):
        rows, cols, whole = torch.empty(4, 1, dtype=torch.int32), torch.empty(8, dtype=torch.int32), \
            torch.empty(1, dtype=torch.int32)
        with ctx():
            _xor_sums_kernel[(1,)](x, rows, cols, whole, R=4, CP=8)
        runs.append((rows, cols, whole))
    want_rows = x[:, 0].clone()
    for j in range(1, 8):
        want_rows ^= x[:, j]
    want_cols = x[0].clone()
    for i in range(1, 4):
        want_cols ^= x[i]
    want_all = want_rows[0].clone()
    for i in range(1, 4):
        want_all ^= want_rows[i]
    for rows, cols, whole in runs:
        assert torch.equal(rows[:, 0], want_rows) and torch.equal(cols, want_cols) and int(whole) == int(want_all)


def test_the_shortcut_reduces_xor_without_the_per_element_combine(monkeypatch):
    calls = []
    real = interpreter.ReduceOps.generic_reduce
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce",
                        lambda self, input: calls.append(1) or real(self, input))
    x = _awkward_rows(torch.float32)
    _sort_rows_kernel[(1,)](x, torch.empty_like(x), R=x.shape[0], CP=x.shape[1])
    assert calls == []
    with _fast_interpreter.disabled():
        _sort_rows_kernel[(1,)](x, torch.empty_like(x), R=x.shape[0], CP=x.shape[1])
    assert len(calls) == 10  # log2(16) = 4 stages: 1 + 2 + 3 + 4 compare-and-swaps
