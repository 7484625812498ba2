"""The C++ backends (``cpu`` and ``cuda``) share one set of ``torch.ops.fedopt_C`` ops:
the dispatcher picks the CPU or CUDA kernel from the tensors' device.  This module
adapts the backend contract (floats or tensors for hyperparameters) to their schemas.
"""

from __future__ import annotations

import torch

from . import hyper


_split = hyper.split  # a hyperparameter as the (value, Tensor?) pair of the schemas


def nar_step_(params, grads, momentum_buffers, lr, weight_decay, max_norm, mode, momentum,
              grad_scale, found_inf):
    lr_f, lr_t = _split(lr)
    wd_f, wd_t = _split(weight_decay)
    return torch.ops.fedopt_C.nar_step_(
        params, grads, momentum_buffers, lr_f, lr_t, wd_f, wd_t, float(max_norm), int(mode),
        float(momentum), grad_scale, found_inf)


def nar_sq_norm(params, grads, weight_decay, mode, grad_scale):
    wd_f, wd_t = _split(weight_decay)
    return torch.ops.fedopt_C.nar_sq_norm(params, grads, wd_f, wd_t, int(mode), grad_scale)


def nar_apply_(params, grads, momentum_buffers, sq_norm, lr, weight_decay, max_norm, mode, momentum,
               grad_scale, found_inf):
    lr_f, lr_t = _split(lr)
    wd_f, wd_t = _split(weight_decay)
    return torch.ops.fedopt_C.nar_apply_(
        params, grads, momentum_buffers, sq_norm, lr_f, lr_t, wd_f, wd_t, float(max_norm), int(mode),
        float(momentum), grad_scale, found_inf)


def nar_step_batched_(X, G, B, lr, weight_decay, max_norm, mode, momentum, grad_scale, found_inf):
    lr_f, lr_t = _split(lr)
    wd_f, wd_t = _split(weight_decay)
    return torch.ops.fedopt_C.nar_step_batched_(
        X, G, B, lr_f, lr_t, wd_f, wd_t, float(max_norm), int(mode), float(momentum),
        grad_scale, found_inf)


def aggregate(clients, weights, gamma, out, skip):
    gamma_f, gamma_t = _split(gamma)
    if isinstance(clients, torch.Tensor):
        clients = [clients]
    return torch.ops.fedopt_C.aggregate(clients, weights, gamma_f, gamma_t, out, skip)


def client_dots(clients, g):
    if isinstance(clients, torch.Tensor):
        clients = [clients]
    return torch.ops.fedopt_C.client_dots(clients, g)


def server_update_(params, updates, exp_avg, exp_avg_sq, rule, lr, gamma, beta1, beta2, tau, nesterov, skip):
    if not params:  # nothing to do, and no tensor the dispatcher could pick a kernel by
        return
    lr_f, lr_t = _split(lr)
    gamma_f, gamma_t = _split(gamma)
    torch.ops.fedopt_C.server_update_(
        params, updates, exp_avg, exp_avg_sq, int(rule), lr_f, lr_t, gamma_f, gamma_t, float(beta1),
        float(beta2), float(tau), bool(nesterov), skip)
