"""Loading of the compiled C++ extensions, remembering why one is unavailable.

An extension links against the C++ library of the torch it was compiled with, whose
symbols change from release to release: under another torch its import fails with an
"undefined symbol" ImportError (or, worse, succeeds and misbehaves).  So before
importing one, the torch it was built for -- ``fedopt_kernels._build_info``, written by
setup.py's ``build_ext`` -- is compared with the running torch, and a mismatch is
reported as such, saying what to install, without importing the extension.

An extension that is there but cannot be used (another torch, a broken build) is also
WARNED about, once: its ops would otherwise fall back silently to a slower backend.
One that was simply not built (a CPU-only torch's CUDA extension, a source checkout
never built) is not; ``fedopt info`` lists every reason.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Optional

import torch

_loaded: dict[str, Optional[str]] = {}  # module name -> None if loaded, else the reason
_import = importlib.import_module  # of the extensions (tests replace it)


def build_info():
    """The ``_build_info`` module of the build in use, or None when none was recorded
    (a build from before setup.py wrote one: then the import alone decides)."""
    try:
        return importlib.import_module("fedopt_kernels._build_info")
    except ImportError:
        return None


def _release(version: str) -> str:
    # setup.py pins torch==<release>: every local build of it (+cpu, +cu130) matches.
    return version.split("+", 1)[0]


def _describe(version: str, cuda: Optional[str], abi: Optional[bool] = None) -> str:
    what = f"CUDA {cuda}" if cuda else "CPU-only"
    if abi is not None:
        what += f", {'new' if abi else 'old'} C++11 ABI"
    return f"torch {version} ({what})"


def mismatch(module: str, info=None) -> Optional[str]:
    """Why extension ``module`` (``"_C"`` or ``"_C_cuda"``) cannot run under the installed
    torch according to ``info`` (default: the recorded build), or None if it can."""
    info = build_info() if info is None else info
    if info is None:
        return None
    built_abi = bool(getattr(info, "CXX11_ABI", True))
    abi = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    same = _release(info.TORCH_VERSION) == _release(torch.__version__) and built_abi == abi
    if module == "_C_cuda":
        same = same and info.TORCH_CUDA == torch.version.cuda
    if same:
        return None
    shown_abi = (built_abi, abi) if built_abi != abi else (None, None)
    return (f"fedopt_kernels was built for {_describe(info.TORCH_VERSION, info.TORCH_CUDA, shown_abi[0])} but "
            f"{_describe(torch.__version__, torch.version.cuda, shown_abi[1])} is installed: install the matching "
            f"torch (pip install torch=={_release(info.TORCH_VERSION)}) or rebuild fedopt_kernels against the "
            "installed one (from its source tree or sdist: pip install --no-build-isolation --no-deps "
            "--force-reinstall <source>)")


def _warn(module: str, reason: str) -> None:
    backend = {"_C": "cpu", "_C_cuda": "cuda"}[module]
    warnings.warn(f"the {backend} backend is unavailable: {reason}.  Until then its ops run on the next "
                  f"available backend (`fedopt info` lists them).", RuntimeWarning, stacklevel=3)


def _load(module: str) -> Optional[str]:
    info = build_info()
    if module == "_C_cuda" and info is not None and not info.CUDA_EXTENSION:
        # Not built by the build in use; a _C_cuda file here is left from an earlier one.
        return (f"fedopt_kernels._C_cuda was not built (the build for {_describe(info.TORCH_VERSION, info.TORCH_CUDA)}"
                " skipped it)")
    reason = mismatch(module, info)
    if reason is not None:
        # A CUDA extension under a CPU-only torch is not worth a warning: nothing here
        # could run it (the cpu backend, checked on its own, is what matters).
        if not (module == "_C_cuda" and torch.version.cuda is None):
            _warn(module, reason)
        return reason
    name = f"fedopt_kernels.{module}"
    try:
        _import(name)
    except ImportError as exc:  # not built, or a broken build (undefined symbols, ...)
        reason = f"{name} could not be imported ({exc})"
        if not (isinstance(exc, ModuleNotFoundError) and exc.name == name):  # there, but unusable
            _warn(module, reason)
        return reason
    return None


def load(module: str) -> Optional[str]:
    """Import ``fedopt_kernels.<module>``; return None on success, else why it failed."""
    if module not in _loaded:
        # The CUDA library registers kernels for the ops that _C defines.
        base = load("_C") if module == "_C_cuda" else None
        _loaded[module] = base if base is not None else _load(module)
    return _loaded[module]
