"""The ``reference`` backend: python_ref behind the backend contract (see __init__)."""

from __future__ import annotations

import torch

import python_ref.aggregation as _agg
import python_ref.fednar as _nar

_MODE_NAMES = _nar.MODES  # index = the integer mode of the contract


def nar_step_(params, grads, momentum_buffers, lr, weight_decay, max_norm, mode, momentum,
              grad_scale, found_inf):
    return tuple(_nar.nar_step_(
        params, grads, lr=lr, weight_decay=weight_decay, max_norm=max_norm,
        mode=_MODE_NAMES[mode], momentum=momentum, momentum_buffers=momentum_buffers or None,
        grad_scale=grad_scale, found_inf=found_inf))


def nar_step_batched_(X, G, B, lr, weight_decay, max_norm, mode, momentum, grad_scale, found_inf):
    return tuple(_nar.nar_step_batched_(
        X, G, lr=lr, weight_decay=weight_decay, max_norm=max_norm, mode=_MODE_NAMES[mode],
        momentum=momentum, momentum_buffers=B, grad_scale=grad_scale, found_inf=found_inf))


def aggregate(clients, weights, gamma, out, enabled):
    result, q, Q = _agg.aggregate(clients, weights, gamma)
    if enabled is not None:
        out.copy_(torch.where(enabled, result.to(out.dtype), out))
        return torch.where(enabled, q, torch.zeros_like(q)), torch.where(enabled, Q, torch.zeros_like(Q))
    out.copy_(result)
    return q, Q


def client_dots(clients, g):
    return _agg.client_dots(clients, g)
