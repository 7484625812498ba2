"""``weighted_sum``: the differentiable form of the aggregation (FedLAW's forward)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from . import _library, validation as V
from .aggregate import Clients, as_weight_tensor, check_clients, host_to_device


class _WeightedSum(torch.autograd.Function):
    """out = gamma * sum_i a_i X_i with the clients as constants.

    Backward (python_ref/aggregation.py), with G = dL/d out and d_i = <G, X_i> computed for all
    clients in ONE pass over the data (``client_dots``)::

        dL/da_i = gamma * d_i        dL/dgamma = <G, sum_i a_i X_i> = sum_i a_i d_i
    """

    @staticmethod
    def forward(ctx, weights, gamma, impl, rows):
        first = rows if isinstance(rows, torch.Tensor) else rows[0]
        N = first.shape[-1]
        out = torch.empty(N, dtype=first.dtype, device=first.device)
        impl.aggregate(rows, weights.detach(), 0.0, gamma.detach(), out, None)  # gamma: the pair's tensor half
        ctx.impl, ctx.rows = impl, rows
        ctx.save_for_backward(weights, gamma)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weights, gamma = ctx.saved_tensors
        dots = ctx.impl.client_dots(ctx.rows, grad_out.contiguous().to(weights.dtype))
        grad_weights = gamma * dots if ctx.needs_input_grad[0] else None
        grad_gamma = torch.dot(weights, dots) if ctx.needs_input_grad[1] else None
        return grad_weights, grad_gamma, None, None


def weighted_sum(clients: Clients, weights: torch.Tensor, gamma=1.0, *, backend: Optional[str] = None) -> torch.Tensor:
    r"""Differentiable ``gamma * sum_i weights[i] * clients[i]``.

    Gradients flow to ``weights`` (``[C]``) and ``gamma`` (number or 0-d tensor); the
    clients are constants: no gradient buffer is ever allocated for them, even if they
    require grad.  Forward is the fused aggregation (one pass), backward the fused
    ``client_dots`` (one pass: all ``C`` inner products with ``dL/d out``).  Both run in
    the acc dtype of the clients (float64 clients give float64 gradients, so
    ``torch.autograd.gradcheck`` applies).  No NaN exclusion here: this is the plain
    linear map FedLAW differentiates.
    """
    rows, C, N, dtype, device = check_clients(clients)
    acc = V.acc_dtype(dtype)
    weights = as_weight_tensor(weights, C)  # lists and integer tensors as elsewhere; autograd kept
    if weights.device != device:
        if weights.device.type != "cpu" or weights.requires_grad:
            raise ValueError(f"weights must be on {device} (the clients' device), got {weights.device}")
        weights = host_to_device(weights, device, "weights")
    if isinstance(gamma, torch.Tensor):
        if gamma.numel() != 1 or gamma.device != device:
            raise ValueError(f"gamma as a tensor must have one element and live on {device}")
        gamma = gamma.reshape(())
    else:
        # torch.full: a fill kernel on the device -- no blocking host-to-device copy per
        # forward (and none under CUDA-graph capture) -- in the acc dtype, so an fp64
        # client set gets gamma in fp64, not rounded through torch.tensor's fp32 default.
        gamma = torch.full((), V.check_real(gamma, "gamma", low=0.0, low_open=True), dtype=acc, device=device)
    if isinstance(rows, torch.Tensor):
        rows = rows.detach()
    else:
        rows = [r.detach() for r in rows]
    if torch.compiler.is_compiling():  # one custom-op node (forward and backward)
        return _library.weighted_sum_op(rows, weights.to(acc), gamma.to(acc),
                                        backends.resolve_name(backend, device.type))
    impl = backends.resolve(backend, device)
    return _WeightedSum.apply(weights.to(acc), gamma.to(acc), impl, rows)
