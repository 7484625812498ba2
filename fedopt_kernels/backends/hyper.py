"""How a hyperparameter crosses an op boundary.

The public ops take ``lr``, ``weight_decay``, ``gamma``... as a Python number or a
tensor (0-d, or ``[C]`` where each client has its own).  An op schema cannot hold
that union, so at every boundary -- the ``fedopt::`` custom ops of ``torch.compile``
and the ``fedopt_C`` ops of the C++ backends alike -- a hyperparameter travels as ONE
pair of arguments ``(value, tensor)``: ``(float, None)`` for a number, ``(0.0,
tensor)`` for a tensor (the tensor wins; PyTorch's fused optimizers pass ``lr`` and a
``Tensor? lr`` the same way).  A number reaches the kernel as a runtime argument and a
tensor is read on the device, so a new value never recompiles anything and never
synchronises.  The Triton kernels add only a compile-time *kind* (number, 0-d tensor,
per-row tensor: :func:`kind`) to pick the load; the reference backend takes the union.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

# The Triton kernels' compile-time kinds (backends/triton/_helpers.py mirrors these values).
FLOAT, SCALAR, ROW = 0, 1, 2


def split(h) -> Tuple[float, Optional[torch.Tensor]]:
    """``h`` (a number or a tensor) as the ``(value, tensor)`` pair of an op schema."""
    return (0.0, h) if isinstance(h, torch.Tensor) else (float(h), None)


def join(value: float, tensor: Optional[torch.Tensor]):
    """The hyperparameter a ``(value, tensor)`` pair stands for."""
    return value if tensor is None else tensor


def kind(h, per_row: bool) -> int:
    """The Triton kernels' kind of ``h``: a number, one value on the device, or one per
    row (a ``[C]`` tensor of a per-row op)."""
    if not isinstance(h, torch.Tensor):
        return FLOAT
    return ROW if per_row and h.dim() != 0 else SCALAR
