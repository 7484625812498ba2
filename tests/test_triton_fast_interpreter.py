"""tests/_fast_interpreter.py: the suite's shortcut past Triton's redundant re-patching
in the interpreter gives every kernel of the Triton backend the same bits as Triton's
own path, and really skips the re-patching (else the interpreted cases cost 3-4x)."""

from __future__ import annotations

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
