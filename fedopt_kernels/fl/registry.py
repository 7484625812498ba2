"""Named factories: the datasets and models the simulator and ``fedopt`` can build by name.

A :class:`Registry` maps names to factories and resolves a spec -- a registered name,
or ``"package.module:function"`` for a factory of your own that was never registered.
:mod:`~fedopt_kernels.fl.datasets.data` keeps one of datasets, :mod:`~fedopt_kernels.fl.engine.models`
one of models.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, Dict, List, Optional

__all__ = ["Registry"]


def _import_from_here(module: str):
    """``importlib.import_module(module)``, also finding it in the current directory as
    ``python -m`` does: the ``fedopt`` console script's ``sys.path`` starts at its own
    folder, not at the one it was run from (the current directory is then added to
    ``sys.path`` for the rest of the run, for the module's own imports)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        top = module.split(".")[0]
        if exc.name != top or any(os.path.abspath(p or os.curdir) == here for p in sys.path):
            raise
        if not (os.path.isfile(os.path.join(here, top + ".py")) or os.path.isdir(os.path.join(here, top))):
            raise
        sys.path.insert(0, here)
        importlib.invalidate_caches()
        return importlib.import_module(module)


class Registry:
    """Factories by name, for one ``kind`` of thing (``"dataset"``, ``"model"``: the
    word the error messages use, and the suffix of the public ``register_<kind>``)."""

    def __init__(self, kind: str, factories: Optional[Dict[str, Callable]] = None):
        self.kind = kind
        self.factories: Dict[str, Callable] = dict(factories or {})

    def register(self, name: str, factory: Callable, *, overwrite: bool = False) -> None:
        """Make ``factory`` available as ``name``; an existing name needs ``overwrite``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string")
        if not callable(factory):
            raise TypeError(f"register_{self.kind}({name!r}, ...): the factory must be callable (a function or "
                            f"class that builds the {self.kind}), got {type(factory).__name__} {factory!r}")
        if name in self.factories and not overwrite:
            raise ValueError(f"{self.kind} {name!r} is already registered (pass overwrite=True to replace it)")
        self.factories[name] = factory

    def names(self) -> List[str]:
        return sorted(self.factories)

    def __contains__(self, name: object) -> bool:
        return name in self.factories

    def resolve(self, spec: str) -> Callable:
        """The factory registered as ``spec``, or for ``"package.module:function"`` that
        function (imported)."""
        kind = self.kind
        if spec in self.factories:
            return self.factories[spec]
        if ":" in spec:
            module, _, attr = spec.partition(":")
            try:
                obj = _import_from_here(module)
            except ImportError as exc:
                hint = ""
                if isinstance(exc, ModuleNotFoundError) and exc.name == module.split(".")[0]:
                    hint = (f"; it is looked for on sys.path and in the current directory {os.getcwd()} -- run "
                            "from the folder that holds it, or add that folder to PYTHONPATH")
                raise ValueError(f"{kind} {spec!r}: cannot import module {module!r} ({exc}){hint}") from None
            try:
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                raise ValueError(f"{kind} {spec!r}: module {module!r} has no {attr!r}") from None
            if not callable(obj):
                raise ValueError(f"{kind} {spec!r} is not callable")
            return obj
        raise ValueError(f"unknown {kind} {spec!r}; choose one of {', '.join(self.names())} "
                         f"or give 'package.module:function' (or register your own with "
                         f"fedopt_kernels.fl.register_{kind})")
