"""``torch.optim.Optimizer`` without importing torch's compiler on first use.

``Optimizer.add_param_group``, ``state_dict``, ``load_state_dict`` and ``zero_grad`` are
wrapped by ``torch._disable_dynamo``, which imports ``torch._dynamo`` (1-3 s, most of
``fedopt simulate --rounds 1`` beyond ``import torch``) the first time any of them runs
-- already in ``__init__``, through ``add_param_group``.  Outside ``torch.compile`` the
wrapper has nothing to disable, so :class:`EagerOptimizer` calls the functions it wraps
(``__wrapped__``, the same code); under compilation it calls the wrapped methods, so
Dynamo still skips them exactly as it does for ``torch.optim`` optimizers.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

__all__ = ["EagerOptimizer"]


def _unwrapped(name: str):
    method = getattr(Optimizer, name)
    return getattr(method, "__wrapped__", method)


_UNWRAPPED = {name: _unwrapped(name) for name in ("add_param_group", "state_dict", "load_state_dict", "zero_grad")}


def _call(name: str, self, *args):
    """``Optimizer.<name>(self, *args)``: the wrapped method under compilation, the
    function it wraps otherwise (the one place this choice is made)."""
    if torch.compiler.is_compiling():
        return getattr(Optimizer, name)(self, *args)
    return _UNWRAPPED[name](self, *args)


class EagerOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` whose bookkeeping does not import ``torch._dynamo``
    outside compilation (see the module docstring)."""

    def add_param_group(self, param_group: dict) -> None:
        return _call("add_param_group", self, param_group)

    def state_dict(self):
        return _call("state_dict", self)

    def load_state_dict(self, state_dict) -> None:
        return _call("load_state_dict", self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        return _call("zero_grad", self, set_to_none)
