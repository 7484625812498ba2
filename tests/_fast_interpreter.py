"""Triton's interpreter without its redundant re-patching of ``triton.language`` on every
device-function call (the test session's speed-up; the kernels' semantics are untouched).

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``) patches
``triton.language`` once -- its builtins swapped for the interpreter's, through
``_patch_lang``, restored when the launch ends.  But every call of a ``@triton.jit``
*device* function inside the kernel (``InterpretedFunction.__call__``: the helpers in
backends/triton/_helpers.py, the per-block bodies) calls ``_patch_lang`` again, which
walks ``tl``, ``tl.tensor``, ``tl.math`` with ``inspect.getmembers`` to find builtins
that are no longer there (already swapped, so it changes nothing) -- and never restores
what it set.  Measured on a 3 x 4099 aggregation: 55% of the interpreted call's time,
and the suite's interpreted Triton cases are most of its time.

So, while a launch is running in this thread, a device-function call whose
``triton.language`` modules are all patched already -- by the launch, or for good by an
earlier device-function call (``tl.sum`` and ``tl.zeros`` see ``tl.core``, which a
kernel's launch does not patch: Triton's own path patches it at their first call and
never restores it) -- goes straight to its rewritten function (what
``InterpretedFunction.__call__`` does after ``_patch_lang``).  Anything else -- the
first such call, a call outside a launch, a Triton whose interpreter is not shaped as
expected -- takes Triton's own path.  tests/test_triton_interpreter_compat.py checks
that kernels give the same bits both ways.
"""

from __future__ import annotations

import functools
import inspect
import threading

_state = threading.local()
# Language modules a device-function call has patched through Triton's own path: that
# patch is never restored (its scope is dropped), so they stay patched for the process.
_leaked: set = set()
_INSTALLED = False


_LANGS: dict = {}


def _langs(fn, tl) -> frozenset:
    """The ``triton.language`` modules ``_patch_lang`` would patch for ``fn``."""
    langs = _LANGS.get(fn)
    if langs is None:
        langs = _LANGS[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                       if inspect.ismodule(v) and v in (tl, tl.core))
    return langs


def _shaped_as_expected(interpreter) -> bool:
    """The two methods still do what this module assumes (Triton 3.6 and 3.8 do)."""
    try:
        device = inspect.getsource(interpreter.InterpretedFunction.__call__)
        launch = inspect.getsource(interpreter.GridExecutor.__call__)
    except (AttributeError, OSError, TypeError):
        return False
    return ("_patch_lang(self.fn)" in device and "fn = self.rewrite()" in device
            and "patch_scope = _patch_lang(self.fn)" in launch and "patch_scope.restore()" in launch)


def install() -> bool:
    """Install the shortcut (idempotent).  Returns whether it is installed."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not _shaped_as_expected(interpreter):
        return False
    launch_call = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__

    @functools.wraps(launch_call)
    def launch(self, *args, **kwargs):
        stack = _state.__dict__.setdefault("patched", [])
        stack.append(_langs(self.fn, tl))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            stack.pop()

    @functools.wraps(device_call)
    def device(self, *args, **kwargs):
        stack = getattr(_state, "patched", None)
        langs = _langs(self.fn, tl)
        if not stack or not getattr(_state, "enabled", True) or not langs <= stack[-1] | _leaked:
            if stack:
                _leaked.update(langs)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = device
    _INSTALLED = True
    return True


class disabled:
    """``with disabled():`` -- Triton's own path for every device-function call in this
    thread (the check that both paths give the same bits)."""

    def __enter__(self):
        self.before = getattr(_state, "enabled", True)
        _state.enabled = False

    def __exit__(self, *exc):
        _state.enabled = self.before
