"""backends/triton/_interpreter_compat.py: Triton 3.6's interpreter under NumPy >= 2.4.

Every kernel of the Triton backend loops to a bound loaded from memory; Triton 3.6's
interpreter converts that bound with ``int()`` of a one-element array, which NumPy 2.4
refuses.  The first test runs such a loop in the installed interpreter (the torch-2.11
tier, tests/test_oldest_torch.py, runs this file under triton 3.6); the others give
``install`` an interpreter module with the old ``__index__`` and one with the fixed one.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from conftest import import_triton_module

triton = import_triton_module("triton")
tl = import_triton_module("triton.language")
from fedopt_kernels.backends import triton_interpret_mode  # noqa: E402

compat = import_triton_module("fedopt_kernels.backends.triton._interpreter_compat")


@triton.jit
def _count_blocks_kernel(table_ptr, out_ptr, BLOCK: tl.constexpr):
    n = tl.load(table_ptr + 1)  # a loop bound loaded from memory, as every kernel's chunk length
    count = 0
    for _start in range(0, n, BLOCK):
        count += 1
    tl.store(out_ptr, count)


@pytest.mark.skipif(not triton_interpret_mode(), reason="the interpreter runs on CPU tensors only")
def test_a_loop_bound_loaded_from_memory_runs_in_the_interpreter():
    import fedopt_kernels.backends.triton  # noqa: F401 - installs the fix where needed

    out = torch.zeros(1, dtype=torch.int64)
    _count_blocks_kernel[(1,)](torch.tensor([0, 37], dtype=torch.int64), out, BLOCK=8)
    assert out.item() == 5  # ceil(37 / 8), by hand


def _fake_interpreter(index):
    """An interpreter module whose ``_patch_lang_tensor`` sets ``__index__`` to ``index``
    (and one other attribute, which the probe must restore)."""
    real = import_triton_module("triton.runtime.interpreter")

    def _patch_lang_tensor(tensor, scope):
        scope.set_attr(tensor, "__index__", index)
        scope.set_attr(tensor, "__repr__", lambda self: "patched")

    return types.SimpleNamespace(_patch_lang_tensor=_patch_lang_tensor, TensorHandle=real.TensorHandle)


def test_the_old_index_is_detected_under_numpy_2_4():
    old = _fake_interpreter(lambda self: int(self.handle.data))
    new = _fake_interpreter(lambda self: int(self.handle.data.squeeze()))
    numpy_refuses = tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4)
    assert compat._needs_fix(old) is numpy_refuses
    assert compat._needs_fix(new) is False
    # the probe leaves triton.language's tensor class as it found it
    assert "__index__" not in vars(tl.core.tensor) and "patched" not in repr(tl.core.tensor)


def test_install_wraps_the_old_patch_and_leaves_a_fixed_one(monkeypatch):
    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4):
        pytest.skip(f"NumPy {np.__version__} still converts a one-element array with int()")
    import triton.runtime as runtime

    for index, wrapped in ((lambda self: int(self.handle.data), True),
                           (lambda self: int(self.handle.data.squeeze()), False)):
        fake = _fake_interpreter(index)
        before = fake._patch_lang_tensor
        monkeypatch.setattr(runtime, "interpreter", fake, raising=False)
        monkeypatch.setitem(__import__("sys").modules, "triton.runtime.interpreter", fake)
        monkeypatch.setattr(compat, "_INSTALLED", False)
        compat.install()
        assert (fake._patch_lang_tensor is not before) is wrapped
        if wrapped:  # the wrapped patch gives a squeezing __index__
            calls = []
            scope = types.SimpleNamespace(set_attr=lambda obj, name, value: calls.append((name, value)))
            fake._patch_lang_tensor(object, scope)
            index_fn = [v for n, v in calls if n == "__index__"][-1]
            handle = types.SimpleNamespace(data=np.array([7]))
            assert index_fn(types.SimpleNamespace(handle=handle)) == 7


# ----------------------------------------------------------------------------- fp32 -> bf16

def _bf16_cases() -> torch.Tensor:
    """fp32 values around every rounding case: exact bf16 values, ties to even (both
    parities), just above/below a tie, the largest finite that rounds to inf, inf, NaN,
    subnormals, zeros of both signs, and a spread of random values."""
    base = torch.tensor([1.0, 1.5, -3.25, 65504.0, 3.3895314e38], dtype=torch.float32).view(torch.int32)
    near = [base + d for d in (0, 0x7FFF, 0x8000, 0x8001, 0x18000, 0xFFFF)]  # 0x8000: a tie
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-45, 3.4e38],
                           dtype=torch.float32)
    rand = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    return torch.cat([torch.cat(near).view(torch.float32), special, rand, -rand * 1e-38])


def test_fp32_to_bf16_bits_is_torchs_rounding():
    """Bit for bit torch's conversion, NaN aside (torch's own NaN bits depend on its code
    path: 0x7FC0 scalar, 0xFFFF vectorised): a NaN stays a quiet NaN."""
    x = _bf16_cases()
    got = torch.from_numpy(compat.fp32_to_bf16_bits(x.numpy()).view(np.int16))
    nan = torch.isnan(x)
    assert int(nan.sum()) == 2  # the NaN case and 3.3895314e38 + 0x18000 bits (past the largest exponent)
    assert torch.equal(got[~nan], x.to(torch.bfloat16).view(torch.int16)[~nan])
    assert bool((got[nan] == 0x7FC0).all())


@triton.jit
def _to_bf16_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.bfloat16), mask=mask)


def test_a_bf16_store_rounds_to_nearest_even(triton_device):
    """A kernel's fp32 -> bf16 store gives torch's bits: on the GPU (cvt.rn) as in the
    interpreter, where install() replaces its truncation."""
    import fedopt_kernels.backends.triton  # noqa: F401 - installs the fixes where needed

    x = _bf16_cases()
    out = torch.empty(x.numel(), dtype=torch.bfloat16, device=triton_device)
    _to_bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(triton_device), out, x.numel(), BLOCK=1024)
    got, want = out.cpu().view(torch.int16), x.to(torch.bfloat16).view(torch.int16)
    nan = torch.isnan(x)  # the GPU's NaN is 0x7FFF, torch's 0x7FC0: any NaN will do there
    assert torch.equal(got[~nan], want[~nan]) and bool(torch.isnan(out.cpu()[nan].float()).all())


@pytest.mark.skipif(not triton_interpret_mode(), reason="the interpreter runs on CPU tensors only")
def test_the_truncating_conversion_is_detected():
    interpreter = import_triton_module("triton.runtime.interpreter")
    # the installed (fixed) conversion no longer truncates; the original one did
    assert compat._bf16_truncates(interpreter) is False
    original = interpreter.InterpreterBuilder.cast_impl.__wrapped__
    fake = types.SimpleNamespace(TensorHandle=interpreter.TensorHandle,
                                 InterpreterBuilder=types.SimpleNamespace(cast_impl=original))
    assert compat._bf16_truncates(fake) is True
