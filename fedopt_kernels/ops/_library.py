"""``torch.library`` registration of the public ops, for ``torch.compile``.

Eager calls go straight from the ops layer to a backend (no dispatcher round trip).
Under ``torch.compile`` the ops layer calls these custom ops instead (the choice is
made in one place, :mod:`._dispatch`): Dynamo records each as one opaque node (no
graph break), the fake kernels give it output shapes, and ``mutates_args`` tells
AOTAutograd which inputs are written in place.  Hyperparameters
that are tensors stay graph inputs, so a new lr does not recompile.

Each op's schema is the backend contract (:mod:`fedopt_kernels.backends`) plus the
backend's name: hyperparameters arrive as the ``(value, tensor)`` pairs the ops layer
split them into (:mod:`fedopt_kernels.backends.hyper`) and go on to the backend as
they are.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from .validation import acc_dtype


@torch.library.custom_op("fedopt::nar_step_", mutates_args=("params", "momentum_buffers"))
def nar_step_op(
    params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
    lr: float, lr_tensor: Optional[torch.Tensor], weight_decay: float,
    weight_decay_tensor: Optional[torch.Tensor], max_norm: float, nar_mode: int, momentum: float,
    grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor], backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = backends.resolve(backend, params[0].device)
    norm, scale, skipped = impl.nar_step_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay,
                                          weight_decay_tensor, max_norm, nar_mode, momentum, grad_scale, found_inf)
    return norm, scale, skipped


@nar_step_op.register_fake
def _(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm,
      nar_mode, momentum, grad_scale, found_inf, backend):
    acc = acc_dtype(params[0].dtype)
    dev = params[0].device
    return (params[0].new_empty((), dtype=acc, device=dev), params[0].new_empty((), dtype=acc, device=dev),
            params[0].new_empty((), dtype=torch.bool, device=dev))


@torch.library.custom_op("fedopt::nar_sq_norm", mutates_args=())
def nar_sq_norm_op(
    params: list[torch.Tensor], grads: list[torch.Tensor], weight_decay: float,
    weight_decay_tensor: Optional[torch.Tensor], nar_mode: int, grad_scale: Optional[torch.Tensor], backend: str,
) -> torch.Tensor:
    impl = backends.resolve(backend, params[0].device)
    return impl.nar_sq_norm(params, grads, weight_decay, weight_decay_tensor, nar_mode, grad_scale)


@nar_sq_norm_op.register_fake
def _(params, grads, weight_decay, weight_decay_tensor, nar_mode, grad_scale, backend):
    return params[0].new_empty((), dtype=acc_dtype(params[0].dtype))


@torch.library.custom_op("fedopt::nar_apply_", mutates_args=("params", "momentum_buffers"))
def nar_apply_op(
    params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
    sq_norm: torch.Tensor, lr: float, lr_tensor: Optional[torch.Tensor], weight_decay: float,
    weight_decay_tensor: Optional[torch.Tensor], max_norm: float, nar_mode: int, momentum: float,
    grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor], backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = backends.resolve(backend, params[0].device)
    norm, scale, skipped = impl.nar_apply_(params, grads, momentum_buffers, sq_norm, lr, lr_tensor, weight_decay,
                                           weight_decay_tensor, max_norm, nar_mode, momentum, grad_scale, found_inf)
    return norm, scale, skipped


@nar_apply_op.register_fake
def _(params, grads, momentum_buffers, sq_norm, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm,
      nar_mode, momentum, grad_scale, found_inf, backend):
    acc = acc_dtype(params[0].dtype)
    return (params[0].new_empty((), dtype=acc), params[0].new_empty((), dtype=acc),
            params[0].new_empty((), dtype=torch.bool))


@torch.library.custom_op("fedopt::nar_step_batched_", mutates_args=("X", "B"))
def nar_step_batched_op(
    X: torch.Tensor, G: torch.Tensor, B: Optional[torch.Tensor],
    lr: float, lr_tensor: Optional[torch.Tensor], weight_decay: float,
    weight_decay_tensor: Optional[torch.Tensor], max_norm: float, nar_mode: int, momentum: float,
    grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor], backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = backends.resolve(backend, X.device)
    norm, scale, skipped = impl.nar_step_batched_(X, G, B, lr, lr_tensor, weight_decay, weight_decay_tensor,
                                                  max_norm, nar_mode, momentum, grad_scale, found_inf)
    return norm, scale, skipped


@nar_step_batched_op.register_fake
def _(X, G, B, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm, nar_mode, momentum,
      grad_scale, found_inf, backend):
    acc = acc_dtype(X.dtype)
    C = X.shape[0]
    return (X.new_empty((C,), dtype=acc), X.new_empty((C,), dtype=acc), X.new_empty((C,), dtype=torch.bool))


@torch.library.custom_op("fedopt::aggregate", mutates_args=("out",))
def _aggregate(
    clients: list[torch.Tensor], weights: torch.Tensor, gamma: float, gamma_tensor: Optional[torch.Tensor],
    out: torch.Tensor, skip: Optional[torch.Tensor], noise_key: Optional[int], noise_std: float,
    noise_std_tensor: Optional[torch.Tensor], backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = backends.resolve(backend, out.device)
    rows = clients[0] if len(clients) == 1 and clients[0].dim() == 2 else clients
    noise = () if noise_key is None else (noise_key, noise_std, noise_std_tensor)  # the eager call's arguments
    q, Q = impl.aggregate(rows, weights, gamma, gamma_tensor, out, skip, *noise)
    return q, Q


@_aggregate.register_fake
def _(clients, weights, gamma, gamma_tensor, out, skip, noise_key, noise_std, noise_std_tensor, backend):
    C = clients[0].shape[0] if len(clients) == 1 and clients[0].dim() == 2 else len(clients)
    acc = acc_dtype(clients[0].dtype)
    return out.new_empty((C,), dtype=acc), out.new_empty((), dtype=acc)


def aggregate_op(clients, weights, gamma, gamma_tensor, out, skip, noise_key=None, noise_std=0.0,
                 noise_std_tensor=None, backend="reference"):
    """``fedopt::aggregate`` on the contract's clients (a list, or one ``[C, N]`` tensor)."""
    rows = [clients] if isinstance(clients, torch.Tensor) else list(clients)
    return _aggregate(rows, weights, gamma, gamma_tensor, out, skip, noise_key, noise_std, noise_std_tensor, backend)


@torch.library.custom_op("fedopt::add_noise_", mutates_args=("out",))
def add_noise_op(out: torch.Tensor, noise_key: int, noise_std: float, noise_std_tensor: Optional[torch.Tensor],
                 skip: Optional[torch.Tensor] = None, backend: str = "reference") -> None:
    backends.resolve(backend, out.device).add_noise_(out, noise_key, noise_std, noise_std_tensor, skip)


@add_noise_op.register_fake
def _(out, noise_key, noise_std, noise_std_tensor, skip=None, backend="reference"):
    return None


@torch.library.custom_op("fedopt::client_dots", mutates_args=())
def _client_dots(clients: list[torch.Tensor], g: torch.Tensor, backend: str) -> torch.Tensor:
    impl = backends.resolve(backend, g.device)
    rows = clients[0] if len(clients) == 1 and clients[0].dim() == 2 else clients
    return impl.client_dots(rows, g)


@_client_dots.register_fake
def _(clients, g, backend):
    C = clients[0].shape[0] if len(clients) == 1 and clients[0].dim() == 2 else len(clients)
    return g.new_empty((C,), dtype=acc_dtype(clients[0].dtype))


def client_dots_op(clients, g, backend):
    rows = [clients] if isinstance(clients, torch.Tensor) else list(clients)
    return _client_dots(rows, g, backend)


@torch.library.custom_op("fedopt::server_update_", mutates_args=("params", "exp_avg", "exp_avg_sq"))
def server_update_op(
    params: list[torch.Tensor], updates: list[torch.Tensor], exp_avg: list[torch.Tensor],
    exp_avg_sq: list[torch.Tensor], rule: int, lr: float, lr_tensor: Optional[torch.Tensor], gamma: float,
    gamma_tensor: Optional[torch.Tensor], beta1: float, beta2: float, tau: float, nesterov: bool,
    skip: Optional[torch.Tensor], backend: str,
) -> None:
    impl = backends.resolve(backend, params[0].device)
    impl.server_update_(params, updates, exp_avg, exp_avg_sq, rule, lr, lr_tensor, gamma, gamma_tensor, beta1, beta2,
                        tau, nesterov, skip)


@server_update_op.register_fake
def _(params, updates, exp_avg, exp_avg_sq, rule, lr, lr_tensor, gamma, gamma_tensor, beta1, beta2, tau,
      nesterov, skip, backend):
    return None


# ``weighted_sum`` (FedLAW's differentiable aggregation): forward is the backend's
# aggregation, backward its ``client_dots``, each one opaque node under compile (the
# backend's Triton launches are never traced into).  Clients are constants: no gradient.
@torch.library.custom_op("fedopt::weighted_sum", mutates_args=())
def _weighted_sum(clients: list[torch.Tensor], weights: torch.Tensor, gamma: torch.Tensor,
                  backend: str) -> torch.Tensor:
    rows = clients[0] if len(clients) == 1 and clients[0].dim() == 2 else clients
    first = clients[0]
    impl = backends.resolve(backend, first.device)
    out = torch.empty(first.shape[-1], dtype=first.dtype, device=first.device)
    impl.aggregate(rows, weights, 0.0, gamma, out, None)
    return out


@_weighted_sum.register_fake
def _(clients, weights, gamma, backend):
    first = clients[0]
    return first.new_empty((first.shape[-1],))


def _weighted_sum_setup(ctx, inputs, output):
    clients, weights, gamma, backend = inputs
    ctx.backend = backend
    ctx.num_clients = len(clients)
    ctx.save_for_backward(weights, gamma, *clients)


def _weighted_sum_backward(ctx, grad_out):
    """``dL/dw_i = gamma <G, X_i>``, ``dL/dgamma = sum_i w_i <G, X_i>`` (one pass)."""
    weights, gamma, *clients = ctx.saved_tensors
    dots = _client_dots(clients, grad_out.contiguous().to(weights.dtype), ctx.backend)
    grad_w = gamma * dots if ctx.needs_input_grad[1] else None
    grad_gamma = torch.dot(weights, dots) if ctx.needs_input_grad[2] else None
    return [None] * ctx.num_clients, grad_w, grad_gamma, None


_weighted_sum.register_autograd(_weighted_sum_backward, setup_context=_weighted_sum_setup)


def weighted_sum_op(clients, weights, gamma, backend):
    rows = [clients] if isinstance(clients, torch.Tensor) else list(clients)
    return _weighted_sum(rows, weights, gamma, backend)


# The compressed decode-aggregate (ops/compressed.py; backend table:
# backends/compressed.py): one opaque node each, ``out`` written in place.
@torch.library.custom_op("fedopt::block_decode_aggregate", mutates_args=("out",))
def block_decode_aggregate_op(
    codes: list[torch.Tensor], scales: list[torch.Tensor], kind: int, block: int, numel: int, weights: torch.Tensor,
    gamma: float, gamma_tensor: Optional[torch.Tensor], out: torch.Tensor, skip: Optional[torch.Tensor],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    from ..backends import compressed

    backends.resolve(backend, out.device)
    q, Q = compressed.block_decode_aggregate(backend)(codes, scales, kind, block, numel, weights, gamma, gamma_tensor,
                                                      out, skip)
    return q, Q


@block_decode_aggregate_op.register_fake
def _(codes, scales, kind, block, numel, weights, gamma, gamma_tensor, out, skip, backend):
    return out.new_empty((len(codes),), dtype=torch.float32), out.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fedopt::topk_decode_aggregate", mutates_args=("out",))
def topk_decode_aggregate_op(
    values: list[torch.Tensor], indices: list[torch.Tensor], numel: int, weights: torch.Tensor, gamma: float,
    gamma_tensor: Optional[torch.Tensor], out: torch.Tensor, skip: Optional[torch.Tensor], backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    from ..backends import compressed

    backends.resolve(backend, out.device)
    q, Q = compressed.topk_decode_aggregate(backend)(values, indices, numel, weights, gamma, gamma_tensor, out, skip)
    return q, Q


@topk_decode_aggregate_op.register_fake
def _(values, indices, numel, weights, gamma, gamma_tensor, out, skip, backend):
    return out.new_empty((len(values),), dtype=torch.float32), out.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fedopt::block_quantize", mutates_args=())
def block_quantize_op(x: torch.Tensor, kind: int, block: int, stochastic: bool, key: int, client: int,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    from ..backends import compressed

    backends.resolve(backend, x.device)
    codes, scales = compressed.block_quantize(backend)(x, kind, block, stochastic, key, client)
    return codes, scales


@block_quantize_op.register_fake
def _(x, kind, block, stochastic, key, client, backend):
    n = x.numel()
    codes = x.new_empty(((n + 1) // 2 if kind == 1 else n,), dtype=torch.uint8 if kind == 1 else torch.int8)
    return codes, x.new_empty((-(-n // block),), dtype=torch.float32)
