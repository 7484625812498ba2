"""Where an op's call goes: the ONE place that chooses between eager mode and ``torch.compile``.

Every public op validates its input, then asks :func:`kernel` for the callable of one
backend op and calls it with the backend contract's arguments
(:mod:`fedopt_kernels.backends`):

* eager, that callable is the backend's own method -- no dispatcher round trip;
* under ``torch.compile`` it is the op's ``torch.library`` custom op (:mod:`._library`),
  one opaque node of the graph, with the backend's NAME as its ``backend`` argument (a
  graph cannot hold the backend object).

Clients given as :class:`~fedopt_kernels.ops.ClientPieces` are read in place, eager, by a
backend's ``<op>_pieces`` where it has one, else stacked once; a custom-op node takes
rows, so under ``torch.compile`` they are refused by name.  ``weighted_sum`` is, eager,
an autograd function over the backend's ``aggregate`` (forward) and ``client_dots``
(backward); compiled, one custom op with the same forward and backward.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import backends
from ..backends import compressed as _compressed_table
from . import _library
from .client_pieces import ClientPieces

__all__ = ["kernel"]


def kernel(op: str, backend: Optional[str], device: torch.device) -> Callable:
    """The callable that runs backend op ``op`` (a name of :data:`_EAGER`) of
    ``backend`` (a name or None: resolved as :func:`backends.resolve` does) on
    ``device``.  Resolving raises if the backend cannot run there."""
    if torch.compiler.is_compiling():
        custom, name = _COMPILED[op], backends.resolve_name(backend, device.type)
        return lambda *args: custom(*args, backend=name)
    return _EAGER[op](backends.resolve(backend, device))


def _rows_op(op: str):
    """Eager form of an op over clients: ``impl.<op>(rows, *args)`` over rows or
    :class:`ClientPieces` -- read in place by ``impl.<op>_pieces`` where the backend has
    it, else the rows stacked once (:meth:`ClientPieces.stacked`)."""

    def bind(impl):
        def call(rows, *args):
            if not isinstance(rows, ClientPieces):
                return getattr(impl, op)(rows, *args)
            in_place = getattr(impl, f"{op}_pieces", None)
            if in_place is None:
                return getattr(impl, op)(rows.stacked(), *args)
            return in_place(rows.flat(), rows.num_pieces, rows.subtract_from, *args)

        return call

    return bind


class _WeightedSum(torch.autograd.Function):
    """Eager ``weighted_sum``: out = gamma * sum_i a_i X_i with the clients as constants.

    Backward (python_ref/aggregation.py), with G = dL/d out and d_i = <G, X_i> computed for all
    clients in ONE pass over the data (``client_dots``)::

        dL/da_i = gamma * d_i        dL/dgamma = <G, sum_i a_i X_i> = sum_i a_i d_i
    """

    @staticmethod
    def forward(ctx, weights, gamma, impl, rows):
        if isinstance(rows, ClientPieces):
            out = torch.empty(rows.numel, dtype=rows.dtype, device=rows.device)
        else:
            first = rows if isinstance(rows, torch.Tensor) else rows[0]
            out = torch.empty(first.shape[-1], dtype=first.dtype, device=first.device)
        # gamma as the (value, tensor) pair's tensor half
        _rows_op("aggregate")(impl)(rows, weights.detach(), 0.0, gamma.detach(), out, None)
        ctx.impl, ctx.rows = impl, rows
        ctx.save_for_backward(weights, gamma)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weights, gamma = ctx.saved_tensors
        dots = _rows_op("client_dots")(ctx.impl)(ctx.rows, grad_out.contiguous().to(weights.dtype))
        grad_weights = gamma * dots if ctx.needs_input_grad[0] else None
        grad_gamma = torch.dot(weights, dots) if ctx.needs_input_grad[1] else None
        return grad_weights, grad_gamma, None, None


def _method(op: str):
    return lambda impl: getattr(impl, op)


def _compressed(op: str):
    """An op of the compressed decode-aggregate: backends/compressed.py's table, by the
    backend module's name (``fedopt_kernels.backends.cpu`` -> ``cpu``)."""
    return lambda impl: getattr(_compressed_table, op)(impl.__name__.rsplit(".", 1)[-1])


# op -> (backend object -> the eager callable)
_EAGER = {
    "nar_step_": _method("nar_step_"),
    "nar_step_batched_": _method("nar_step_batched_"),
    "nar_sq_norm": _method("nar_sq_norm"),
    "nar_apply_": _method("nar_apply_"),
    "server_update_": _method("server_update_"),
    "aggregate": _rows_op("aggregate"),
    "add_noise_": _method("add_noise_"),
    "client_dots": _rows_op("client_dots"),
    "weighted_sum": lambda impl: lambda rows, weights, gamma: _WeightedSum.apply(weights, gamma, impl, rows),
    "block_decode_aggregate": _compressed("block_decode_aggregate"),
    "topk_decode_aggregate": _compressed("topk_decode_aggregate"),
    "block_quantize": _compressed("block_quantize"),
}


def _rows_only(op: str, custom):
    """A custom op over clients: rows (a list or one ``[C, N]`` tensor), never pieces."""

    def call(rows, *args, **kwargs):
        if isinstance(rows, ClientPieces):
            raise TypeError(f"{op}: clients given as ClientPieces cannot be traced by torch.compile; pass the [C, N] "
                            "rows instead (ClientPieces.stack())")
        return custom(rows, *args, **kwargs)

    return call


# op -> its custom op, called with the contract's arguments and the backend's name
_COMPILED = {
    "nar_step_": _library.nar_step_op,
    "nar_step_batched_": _library.nar_step_batched_op,
    "nar_sq_norm": _library.nar_sq_norm_op,
    "nar_apply_": _library.nar_apply_op,
    "server_update_": _library.server_update_op,
    "aggregate": _rows_only("aggregate", _library.aggregate_op),
    "add_noise_": _library.add_noise_op,
    "client_dots": _rows_only("client_dots", _library.client_dots_op),
    "weighted_sum": _rows_only("weighted_sum", _library.weighted_sum_op),
    "block_decode_aggregate": _library.block_decode_aggregate_op,
    "topk_decode_aggregate": _library.topk_decode_aggregate_op,
    "block_quantize": _library.block_quantize_op,
}
