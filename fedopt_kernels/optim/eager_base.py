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


_ADD_PARAM_GROUP = _unwrapped("add_param_group")
_STATE_DICT = _unwrapped("state_dict")
_LOAD_STATE_DICT = _unwrapped("load_state_dict")
_ZERO_GRAD = _unwrapped("zero_grad")


class EagerOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` whose bookkeeping does not import ``torch._dynamo``
    outside compilation (see the module docstring)."""

    def add_param_group(self, param_group: dict) -> None:
        if torch.compiler.is_compiling():
            return Optimizer.add_param_group(self, param_group)
        return _ADD_PARAM_GROUP(self, param_group)

    def state_dict(self):
        if torch.compiler.is_compiling():
            return Optimizer.state_dict(self)
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict) -> None:
        if torch.compiler.is_compiling():
            return Optimizer.load_state_dict(self, state_dict)
        return _LOAD_STATE_DICT(self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if torch.compiler.is_compiling():
            return Optimizer.zero_grad(self, set_to_none)
        return _ZERO_GRAD(self, set_to_none)
