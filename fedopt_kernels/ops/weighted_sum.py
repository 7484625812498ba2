"""``weighted_sum``: the differentiable form of the aggregation (FedLAW's forward)."""

from __future__ import annotations

from typing import Optional

import torch

from . import _dispatch, validation as V
from .aggregate import Clients, as_weight_tensor, check_clients, host_to_device
from .client_pieces import ClientPieces


def weighted_sum(clients: Clients, weights: torch.Tensor, gamma=1.0, *, backend: Optional[str] = None) -> torch.Tensor:
    r"""Differentiable ``gamma * sum_i weights[i] * clients[i]``.

    Gradients flow to ``weights`` (``[C]``) and ``gamma`` (number or 0-d tensor); the
    clients are constants: no gradient buffer is ever allocated for them, even if they
    require grad.  Forward is the fused aggregation (one pass), backward the fused
    ``client_dots`` (one pass: all ``C`` inner products with ``dL/d out``).  Both run in
    the acc dtype of the clients (float64 clients give float64 gradients, so
    ``torch.autograd.gradcheck`` applies).  No NaN exclusion here: this is the plain
    linear map FedLAW differentiates.  :class:`ClientPieces` are read in place (both
    passes) as :func:`aggregate` reads them.
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
    elif isinstance(rows, ClientPieces):
        if any(t.requires_grad for t in rows.tensors()):
            rows = ClientPieces([[t.detach() for t in client] for client in rows.pieces],
                                subtract_from=None if rows.subtract_from is None else rows.subtract_from.detach())
    else:
        rows = [r.detach() for r in rows]
    # eager: an autograd function over the backend's aggregate and client_dots; compiled:
    # one custom-op node, forward and backward (_dispatch)
    return _dispatch.kernel("weighted_sum", backend, device)(rows, weights.to(acc), gamma.to(acc))
