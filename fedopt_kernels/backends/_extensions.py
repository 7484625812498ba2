"""Loading of the compiled C++ extensions, remembering why one is unavailable."""

from __future__ import annotations

import importlib
from typing import Optional

_loaded: dict[str, Optional[str]] = {}  # module name -> None if loaded, else the reason


def load(module: str) -> Optional[str]:
    """Import ``fedopt_kernels.<module>``; return None on success, else why it failed."""
    if module not in _loaded:
        # The CUDA library registers kernels for the ops that _C defines.
        base = load("_C") if module == "_C_cuda" else None
        if base is not None:
            _loaded[module] = base
            return base
        try:
            importlib.import_module(f"fedopt_kernels.{module}")
            _loaded[module] = None
        except ImportError as exc:  # not built, or built against another torch
            _loaded[module] = f"fedopt_kernels.{module} could not be imported ({exc})"
    return _loaded[module]
