"""Named factories: the datasets and models the simulator and ``fedopt`` can build by name.

A :class:`Registry` maps names to factories and resolves a spec -- a registered name,
or ``"package.module:function"`` for a factory of your own that was never registered.
:mod:`~fedopt_kernels.fl.data` keeps one of datasets, :mod:`~fedopt_kernels.fl.models`
one of models.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Optional

__all__ = ["Registry"]


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
                obj = importlib.import_module(module)
            except ImportError as exc:
                raise ValueError(f"{kind} {spec!r}: cannot import module {module!r} ({exc})") from None
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
