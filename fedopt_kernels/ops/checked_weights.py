"""``CheckedWeights``: client weights whose values were checked once, where they entered.

A federated round checks its weights by value once (the server's round,
:func:`fedopt_kernels.server.aggregation.check_round_weights`) and hands them down
wrapped in this type; every layer below -- the server's normaliser, a robust rule,
DP's clipped sum, the compressed replies' decode-aggregate, the distributed union --
trusts the wrapper and checks only the form (length, dtype, device), which costs no
read of the values.  A raw tensor or a list reaching an op is still checked by value
(:func:`fedopt_kernels.ops.aggregate.check_weights`): the wrapper is the only way to
skip that guard, so a direct caller cannot skip it by accident.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CheckedWeights"]


@dataclass(frozen=True)
class CheckedWeights:
    """A round's ``[C]`` client weights, checked by value once where they entered:
    finite numbers ``>= 0``, not all zero (unless they are one rank's share of a
    distributed round, where "not all zero" is a property of the union).

    ``values``: as the round formed them, a float64 CPU tensor (the server's round); or,
    once normalised for an op, the normalised weights on the clients' device (their
    values were checked before they were normalised, or -- weights that live on a
    device -- they are not read at all, the op's own rule for device weights)."""

    values: torch.Tensor

    def __len__(self) -> int:
        return self.values.numel()
