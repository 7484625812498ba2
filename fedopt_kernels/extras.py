"""What a lean install leaves out, and the extra that brings it.

``pip install fedopt_kernels`` needs torch and numpy only: the kernels and ops, the
optimizers, server optimizers and schedulers, ``fedopt selftest`` and ``fedopt info``.
The simulator (:mod:`fedopt_kernels.fl`, ``fedopt simulate`` / ``compare`` and their
plots) come with the ``sim`` extra: ``pip install fedopt_kernels[sim]``.  The benchmark
lab (:mod:`fedopt_kernels.benchmarks`, ``fedopt bench``) is not part of the core either:
it comes with the ``bench`` extra (``pip install fedopt_kernels[bench]``; today the
sim extra's distributions, since its suites run the simulator and print rich's tables).  The Flower integration
comes with ``flower`` (:data:`fedopt_kernels.integrations.INTEGRATIONS`), which brings
``sim`` too: its client trains as the simulator's clients do.  The privacy accountant of
differentially private aggregation (:mod:`fedopt_kernels.server.differential_privacy.privacy_accountant`)
comes with ``privacy`` (Google's ``dp-accounting``).

Importing an optional part without its extra raises :class:`MissingExtraError`, an
``ImportError`` that says what to install.  Whether a module is there is asked of the
import system without importing it (scikit-learn and matplotlib take about as long to
import as torch).
"""

from __future__ import annotations

import importlib.util
from typing import Dict, List, Optional, Tuple

__all__ = ["EXTRAS", "MissingExtraError", "missing", "message", "require"]

# extra -> its distributions, each as (distribution, module it installs); pyproject.toml's
# [project.optional-dependencies] lists the same distributions with their versions.
EXTRAS: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "sim": (("scikit-learn", "sklearn"),  # the digits dataset
            ("matplotlib", "matplotlib"),  # plots of the simulator
            ("rich", "rich")),  # progress bars and tables of fedopt simulate, compare and bench
    # the benchmark lab (fedopt_kernels.benchmarks, fedopt bench): its suites run the simulator
    "bench": (("scikit-learn", "sklearn"), ("matplotlib", "matplotlib"), ("rich", "rich")),
    # privacy accounting of DP aggregation (fedopt_kernels.server.differential_privacy.privacy_accountant):
    # Google's dp-accounting
    "privacy": (("dp-accounting", "dp_accounting"),),
}


class MissingExtraError(ImportError):
    """An optional part of fedopt_kernels imported without the extra that brings it."""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import; a module without a spec
        return False


def missing(extra: str) -> List[str]:
    """The distributions of ``extra`` that cannot be imported here."""
    return [dist for dist, module in EXTRAS[extra] if not _importable(module)]


def message(extra: str, part: str, install: Optional[str] = None) -> Optional[str]:
    """What to say when ``part`` is used without ``extra``; None when nothing is missing."""
    gone = missing(extra)
    if not gone:
        return None
    names = gone[0] if len(gone) == 1 else ", ".join(gone[:-1]) + " and " + gone[-1]
    return (f"{part} needs {names}, which {'is' if len(gone) == 1 else 'are'} not installed: "
            f"{install or f'pip install fedopt_kernels[{extra}]'}")


def require(extra: str, part: str, install: Optional[str] = None) -> None:
    """Raise :class:`MissingExtraError` saying what to install when ``extra`` is not
    (entirely) installed; ``part`` names what needs it, ``install`` overrides the
    command (default ``pip install fedopt_kernels[<extra>]``)."""
    text = message(extra, part, install)
    if text is not None:
        raise MissingExtraError(text)
