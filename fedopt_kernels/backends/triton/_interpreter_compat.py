"""Two fixes for Triton's interpreter, each applied only where needed.

1. Triton 3.6's interpreter under NumPy >= 2.4.  The interpreter (``TRITON_INTERPRET=1``,
   how this backend runs on CPU tensors) holds every scalar as a one-element NumPy
   array, and Triton 3.6 gives its tensors ``__index__ = lambda self:
   int(self.handle.data)``.  NumPy 2.4 made ``int()`` of an array with ``ndim > 0`` an
   error ("only 0-dimensional arrays can be converted to Python scalars"), so any loop
   bound loaded from memory -- ``for s in range(0, n, BLOCK)`` with ``n = tl.load(row +
   COL_LEN)``, as every kernel here has -- fails in the interpreter.  Triton 3.8 reads
   ``int(self.handle.data.squeeze())``; :func:`install` puts that same ``__index__`` in
   when the installed interpreter still has the old one.

2. fp32 -> bf16 conversion.  The interpreter's ``.to(tl.bfloat16)`` of fp32 values (every
   store of an acc-dtype result into a bf16 tensor) drops the low 16 bits -- rounds
   toward zero -- where the GPU (``cvt.rn.bf16.f32``) and torch round to nearest even.
   The contracts say "rounded to the out dtype" and test it bit for bit (the DP noise's
   tests/test_contract_noise.py), so :func:`install` makes the interpreter's conversion
   round to nearest even, NaN to torch's quiet NaN ``0x7FC0``.  Conversions with an
   explicit rounding mode and every other cast are left as they are.

Compiled kernels (a GPU) never run this code: the interpreter is the only thing
touched.  Each check is by behaviour, not by version number: a patch goes in only if
the installed interpreter shows the problem, so a Triton that fixed it is left alone.
"""

from __future__ import annotations

import functools

_INSTALLED = False


def _needs_fix(interpreter) -> bool:
    import numpy as np
    import triton.language as tl

    class _Scope:  # the two methods _patch_lang_tensor calls on its scope argument
        def __init__(self):
            self.changes = []

        def set_attr(self, obj, name, value):
            self.changes.append((obj, name, obj.__dict__.get(name, _Scope)))
            setattr(obj, name, value)

        def restore(self):
            for obj, name, old in reversed(self.changes):
                if old is _Scope:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)

    scope = _Scope()
    try:
        interpreter._patch_lang_tensor(tl.core.tensor, scope)
        handle = interpreter.TensorHandle(np.array([3], dtype=np.int64), tl.int64)
        probe = tl.core.tensor(handle, tl.int64)
        try:
            return range(probe).stop != 3
        except TypeError:
            return True
    finally:
        scope.restore()


def fp32_to_bf16_bits(x) -> "np.ndarray":
    """The bf16 bits (uint16) of fp32 values ``x`` rounded to nearest even (torch's
    ``round_to_nearest_even``: ties to the even bf16, overflow to inf, NaN to 0x7FC0)."""
    import numpy as np

    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _bf16_truncates(interpreter) -> bool:
    """Whether the interpreter converts fp32 1 + 3 * 2^-9 (0.75 of a bf16 ulp above 1) to
    bf16 1.0 -- truncation -- instead of 1 + 2^-7."""
    import numpy as np
    import triton.language as tl

    handle = interpreter.TensorHandle(np.array([1.0 + 3 * 2.0 ** -9], dtype=np.float32), tl.float32)
    out = interpreter.InterpreterBuilder.cast_impl(None, handle, tl.bfloat16)
    return int(np.asarray(out.data).view(np.uint16)[0]) == 0x3F80


def _replace_if_needed(owner, name: str, needed, make) -> None:
    """``owner.name = make(original)`` when ``owner`` has ``name`` and ``needed()`` says the
    installed interpreter shows the problem; left as it is when either check fails (an
    interpreter of another shape)."""
    original = getattr(owner, name, None)
    if original is None:
        return
    try:
        if not needed():
            return
    except Exception:
        return
    setattr(owner, name, functools.wraps(original)(make(original)))


def _bf16_rounding_cast(interpreter):
    """``InterpreterBuilder.cast_impl`` with fp32 -> bf16 rounded to nearest even."""
    import triton.language as tl

    def make(original):
        def cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                data = fp32_to_bf16_bits(src.data).view(interpreter._get_np_dtype(dst_type))
                return interpreter.TensorHandle(data, dst_type.scalar)
            return original(self, src, dst_type)

        return cast_impl

    return make


def _index_safe_patch(original):
    """``_patch_lang_tensor`` that also gives tensors Triton 3.8's ``__index__``."""

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch_lang_tensor


def install() -> None:
    """Give the interpreter's tensors a NumPy-2.4-safe ``__index__`` and its fp32 -> bf16
    conversion round to nearest even (idempotent; each a no-op where the interpreter does
    not need it or cannot be inspected)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    try:
        from triton.runtime import interpreter
    except ImportError:  # a Triton without the interpreter: nothing to fix
        return
    _replace_if_needed(getattr(interpreter, "InterpreterBuilder", None), "cast_impl",
                       lambda: _bf16_truncates(interpreter), _bf16_rounding_cast(interpreter))
    _replace_if_needed(interpreter, "_patch_lang_tensor", lambda: _needs_fix(interpreter), _index_safe_patch)
