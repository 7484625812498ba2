"""The C++ backends (``cpu`` and ``cuda``) share one set of ``torch.ops.fedopt_C`` ops:
the dispatcher picks the CPU or CUDA kernel from the tensors' device.  Their schemas
are the backend contract itself -- hyperparameters as :mod:`~fedopt_kernels.backends.hyper`'s
``(value, tensor)`` pairs -- so this module only normalises Python scalars and the
two forms of a client list.
"""

from __future__ import annotations

import torch

from . import gram


def nar_step_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm, mode,
              momentum, grad_scale, found_inf):
    return torch.ops.fedopt_C.nar_step_(
        params, grads, momentum_buffers, float(lr), lr_tensor, float(weight_decay), weight_decay_tensor,
        float(max_norm), int(mode), float(momentum), grad_scale, found_inf)


def nar_sq_norm(params, grads, weight_decay, weight_decay_tensor, mode, grad_scale):
    return torch.ops.fedopt_C.nar_sq_norm(params, grads, float(weight_decay), weight_decay_tensor, int(mode),
                                          grad_scale)


def nar_apply_(params, grads, momentum_buffers, sq_norm, lr, lr_tensor, weight_decay, weight_decay_tensor,
               max_norm, mode, momentum, grad_scale, found_inf):
    return torch.ops.fedopt_C.nar_apply_(
        params, grads, momentum_buffers, sq_norm, float(lr), lr_tensor, float(weight_decay), weight_decay_tensor,
        float(max_norm), int(mode), float(momentum), grad_scale, found_inf)


def nar_step_batched_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm,
                      mode, momentum, grad_scale, found_inf):
    X, G, B = params, grads, momentum_buffers
    return torch.ops.fedopt_C.nar_step_batched_(
        X, G, B, float(lr), lr_tensor, float(weight_decay), weight_decay_tensor, float(max_norm), int(mode),
        float(momentum), grad_scale, found_inf)


def _key(noise_key):
    return None if noise_key is None else int(noise_key)


def aggregate(clients, weights, gamma, gamma_tensor, out, skip, noise_key=None, noise_std=0.0,
              noise_std_tensor=None):
    if isinstance(clients, torch.Tensor):
        clients = [clients]
    return torch.ops.fedopt_C.aggregate(clients, weights, float(gamma), gamma_tensor, out, skip, _key(noise_key),
                                        float(noise_std), noise_std_tensor)


def aggregate_pieces(pieces, pieces_per_client, subtract_from, weights, gamma, gamma_tensor, out, skip,
                     noise_key=None, noise_std=0.0, noise_std_tensor=None):
    return torch.ops.fedopt_C.aggregate_pieces(pieces, int(pieces_per_client), subtract_from, weights, float(gamma),
                                               gamma_tensor, out, skip, _key(noise_key), float(noise_std),
                                               noise_std_tensor)


def add_noise_(out, noise_key, noise_std, noise_std_tensor, skip=None):
    torch.ops.fedopt_C.add_noise_(out, int(noise_key), float(noise_std), noise_std_tensor, skip)


def client_dots(clients, g):
    if isinstance(clients, torch.Tensor):
        clients = [clients]
    return torch.ops.fedopt_C.client_dots(clients, g)


def client_dots_pieces(pieces, pieces_per_client, subtract_from, g):
    return torch.ops.fedopt_C.client_dots_pieces(pieces, int(pieces_per_client), subtract_from, g)


def server_update_(params, updates, exp_avg, exp_avg_sq, rule, lr, lr_tensor, gamma, gamma_tensor, beta1, beta2,
                   tau, nesterov, skip):
    if not params:  # nothing to do, and no tensor the dispatcher could pick a kernel by
        return
    torch.ops.fedopt_C.server_update_(
        params, updates, exp_avg, exp_avg_sq, int(rule), float(lr), lr_tensor, float(gamma), gamma_tensor,
        float(beta1), float(beta2), float(tau), bool(nesterov), skip)


def coordinate_select(clients, keep, count, mode, out, skip):
    if isinstance(clients, torch.Tensor):
        clients = [clients]
    return torch.ops.fedopt_C.coordinate_select(list(clients), keep, count, int(mode), out, skip)


def coordinate_select_pieces(pieces, pieces_per_client, subtract_from, keep, count, mode, out, skip):
    return torch.ops.fedopt_C.coordinate_select_pieces(pieces, int(pieces_per_client), subtract_from, keep, count,
                                                        int(mode), out, skip)


def client_gram(clients, float64_products):
    """The C++ kernel (CPU only) over rows of one dtype; rows of several dtypes (the ops
    layer's reference point of another dtype than the clients) take the torch form."""
    rows = [clients.contiguous()] if isinstance(clients, torch.Tensor) else [r.contiguous() for r in clients]
    if any(r.dtype != rows[0].dtype for r in rows):
        return gram.client_gram(clients, float64_products)
    return torch.ops.fedopt_C.client_gram(rows, bool(float64_products))


def client_gram_pieces(pieces, pieces_per_client, subtract_from, float64_products):
    return torch.ops.fedopt_C.client_gram_pieces(pieces, int(pieces_per_client), subtract_from,
                                                 bool(float64_products))


def ragged_bmm_blas(dtype):
    return bool(torch.ops.fedopt_C.ragged_bmm_blas(dtype))

