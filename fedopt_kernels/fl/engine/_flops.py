"""FLOPs of a model's forward pass on one sample: its linear layers and convolutions.

The batched engine needs one rough total to weigh a batched call against the model's
arithmetic (:meth:`~fedopt_kernels.fl.engine.round_plan.RoundPlanner.levels`).  torch's
``FlopCounterMode`` counts every matrix product, but its dispatch mode and module
tracker are wrapped by ``torch._disable_dynamo``, so entering it imports
``torch._dynamo`` (1-3 s of a command's start-up).  Forward hooks on ``nn.Linear`` and
``nn.Conv*`` give the same total for the models such simulations train (checked
against ``FlopCounterMode`` in the tests); matrix products written inside a custom
``forward`` are not seen, which the caller's floor of ``6 N`` per sample covers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["forward_flops"]


def _layer_flops(module: nn.Module, output: torch.Tensor) -> int:
    """Multiply-adds x 2 of one call of a linear layer or convolution producing ``output``."""
    if isinstance(module, nn.Linear):
        return 2 * module.in_features * output.numel()
    # output elements x (input channels per group x kernel elements)
    per_output = module.in_channels // module.groups * math.prod(module.kernel_size)
    return 2 * per_output * output.numel()


def forward_flops(model: nn.Module, sample: torch.Tensor) -> int:
    """FLOPs of ``model(sample)``'s linear layers and convolutions, under ``no_grad``."""
    total = [0]

    def hook(module, _inputs, output):
        if isinstance(output, torch.Tensor):
            total[0] += _layer_flops(module, output)

    kinds = (nn.Linear, nn.modules.conv._ConvNd)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, kinds)]
    try:
        with torch.no_grad():
            model(sample)
    finally:
        for h in handles:
            h.remove()
    return total[0]
