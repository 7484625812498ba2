"""How a hyperparameter crosses the line between the ops layer and the kernels.

The public ops take ``lr``, ``weight_decay``, ``gamma``... as a Python number or a
tensor (0-d, or ``[C]`` where each client has its own).  An op schema cannot hold
that union, so the ops layer splits each one ONCE, right after validating it, into a
pair of arguments ``(value, tensor)``: ``(float, None)`` for a number, ``(0.0,
tensor)`` for a tensor (the tensor wins; PyTorch's fused optimizers pass ``lr`` and a
``Tensor? lr`` the same way).  From there the pair travels unchanged through every
layer below: the ``fedopt::`` custom ops of ``torch.compile``, the backend contract
(:mod:`fedopt_kernels.backends`) and the ``fedopt_C`` ops of the C++ backends, whose
schemas take exactly these pairs.  A number reaches the kernel as a runtime argument
and a tensor is read on the device, so a new value never recompiles anything and never
synchronises.

Only two places look inside a pair: the reference backend :func:`join`\\ s it back for
python_ref (the oracle keeps the plain union), and the Triton launchers add a
compile-time *kind* (number, 0-d tensor, per-row tensor: :func:`kind`) to pick the load.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

# The Triton kernels' compile-time kinds (backends/triton/_helpers.py mirrors these values).
FLOAT, SCALAR, ROW = 0, 1, 2


def split(h) -> Tuple[float, Optional[torch.Tensor]]:
    """``h`` (a number or a tensor) as the ``(value, tensor)`` pair of the contract."""
    return (0.0, h) if isinstance(h, torch.Tensor) else (float(h), None)


def join(value: float, tensor: Optional[torch.Tensor]):
    """The hyperparameter a ``(value, tensor)`` pair stands for."""
    return value if tensor is None else tensor


def kind(tensor: Optional[torch.Tensor], per_row: bool) -> int:
    """The Triton kernels' kind of a pair whose tensor half is ``tensor``: a number
    (None), one value on the device, or one per row (a ``[C]`` tensor of a per-row op)."""
    if tensor is None:
        return FLOAT
    return ROW if per_row and tensor.dim() != 0 else SCALAR
