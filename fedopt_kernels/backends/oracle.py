"""python_ref -- the pure-PyTorch, paper-literal oracle -- as this installation has it.

The repository keeps python_ref at its top level (``python_ref/``): the tests compare
every fused path with it, ``tools/mutants.py`` mutates it, and it is read as the
statement of each paper's math.  An installed wheel has no top-level module of that
name: it carries the same files as ``fedopt_kernels._python_ref`` (setup.py's
``package_dir``).  The ``reference`` backend and the benchmarks take the formulas from
here:

* in a source checkout (``python_ref/`` beside this package's directory, importable
  as ``python_ref``): the repository's python_ref itself -- the very modules the tests
  import, so an edit there (a mutant) is what the reference backend runs;
* otherwise (a wheel; an editable install used from another directory, whose finder
  maps the name to the checkout's files): ``fedopt_kernels._python_ref``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["FROM_CHECKOUT", "aggregation", "compression", "fednar", "gaussian_noise", "server_optimizers"]

_CHECKOUT = Path(__file__).resolve().parents[2] / "python_ref"


def _from_checkout() -> bool:
    """Whether ``import python_ref`` gives the checkout's ``python_ref/`` beside this package."""
    if not (_CHECKOUT / "__init__.py").is_file():
        return False
    try:
        spec = importlib.util.find_spec("python_ref")
    except (ImportError, ValueError):
        return False
    return spec is not None and bool(spec.origin) and Path(spec.origin).resolve().parent == _CHECKOUT


FROM_CHECKOUT = _from_checkout()
if FROM_CHECKOUT:
    from python_ref import aggregation, compression, fednar, gaussian_noise, server_optimizers
else:
    from fedopt_kernels._python_ref import aggregation, compression, fednar, gaussian_noise, server_optimizers
