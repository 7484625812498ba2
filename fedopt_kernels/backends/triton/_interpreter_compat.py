"""A fix for Triton 3.6's interpreter under NumPy >= 2.4, applied only where needed.

The interpreter (``TRITON_INTERPRET=1``, how this backend runs on CPU tensors) holds
every scalar as a one-element NumPy array, and Triton 3.6 gives its tensors
``__index__ = lambda self: int(self.handle.data)``.  NumPy 2.4 made ``int()`` of an
array with ``ndim > 0`` an error ("only 0-dimensional arrays can be converted to Python
scalars"), so any loop bound loaded from memory -- ``for s in range(0, n, BLOCK)`` with
``n = tl.load(row + COL_LEN)``, as every kernel here has -- fails in the interpreter.
Triton 3.8 reads ``int(self.handle.data.squeeze())``; this module installs that same
``__index__`` when the installed interpreter still has the old one.  Compiled kernels
(a GPU) never run this code: the interpreter is the only thing touched.

The check is by behaviour, not by version number: the patch goes in only if a
one-element block's ``__index__`` raises, so a Triton that fixed it is left alone.
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


def install() -> None:
    """Give the interpreter's tensors a NumPy-2.4-safe ``__index__`` (idempotent; a
    no-op where the interpreter does not need it or cannot be inspected)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    try:
        from triton.runtime import interpreter
    except ImportError:  # a Triton without the interpreter: nothing to fix
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return
    try:
        if not _needs_fix(interpreter):
            return
    except Exception:  # an interpreter of another shape: leave it as it is
        return

    @functools.wraps(original)
    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
