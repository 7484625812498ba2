"""Where an op's call goes: the ONE route from the ops layer to a kernel, and the one place
that chooses between eager mode and ``torch.compile``.

Every public op validates its input, then asks :func:`kernel` for the callable of one
backend op and calls it with the backend contract's arguments
(:mod:`fedopt_kernels.backends`) -- the FedNAR steps, the aggregation and its noise,
the server step, the robust aggregators' ``coordinate_select`` and ``client_gram``, and
the batched engine's ragged products alike; nothing above the backends calls a kernel
or a ``torch.ops`` op any other way:

* eager, that callable is the backend's own method -- no dispatcher round trip;
* under ``torch.compile`` it is the op's routed form ``fedopt_C::routed_<op>``
  (:mod:`fedopt_kernels.backends.library`, the one registration of the namespace), one
  opaque node of the graph, with the backend's NAME as its ``backend`` argument (a
  graph cannot hold the backend object).  The ragged products and the ``*_pieces``
  forms have no routed form: they are called eagerly (the C++ ragged ops are nodes
  of the batched engine's own traced graphs, with their fake kernels).

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
from ..backends import library
from ..backends import compressed as _compressed_table
from .client_pieces import ClientPieces

__all__ = ["kernel"]


def kernel(op: str, backend: Optional[str], device: torch.device) -> Callable:
    """The callable that runs backend op ``op`` (a name of :data:`_EAGER`) of
    ``backend`` (a name or None: resolved as :func:`backends.resolve` does) on
    ``device``.  Resolving raises if the backend cannot run there."""
    if torch.compiler.is_compiling() and op in _COMPILED:
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
    "coordinate_select": _rows_op("coordinate_select"),
    "client_gram": _rows_op("client_gram"),
    # the batched engine's ragged products (the cpu and reference backends)
    "ragged_bmm": _method("ragged_bmm"),
    "ragged_bmm_out": _method("ragged_bmm_out"),
    "ragged_bmm_blas": _method("ragged_bmm_blas"),
    "ragged_bias_relu_": _method("ragged_bias_relu_"),
    "ragged_relu_backward_": _method("ragged_relu_backward_"),
    # the compressed replies' decode-aggregate and encode (backends/compressed.py's table)
    "block_decode_aggregate": _compressed("block_decode_aggregate"),
    "topk_decode_aggregate": _compressed("topk_decode_aggregate"),
    "block_quantize": _compressed("block_quantize"),
    "block_quantize_into": _compressed("block_quantize_into"),
    "topk_encode": _compressed("topk_encode"),
}


def _rows_only(op: str):
    """The routed form of an op over clients: rows (a list or one ``[C, N]`` tensor,
    passed as the schema's ``Tensor[]``), never pieces."""
    custom = library.routed(op)

    def call(rows, *args, **kwargs):
        if isinstance(rows, ClientPieces):
            raise TypeError(f"{op}: clients given as ClientPieces cannot be traced by torch.compile; pass the [C, N] "
                            "rows instead (ClientPieces.stack())")
        return custom([rows] if isinstance(rows, torch.Tensor) else list(rows), *args, **kwargs)

    return call


# op -> its routed form, called with the contract's arguments and the backend's name
_COMPILED = {
    "nar_step_": library.routed("nar_step_"),
    "nar_step_batched_": library.routed("nar_step_batched_"),
    "nar_sq_norm": library.routed("nar_sq_norm"),
    "nar_apply_": library.routed("nar_apply_"),
    "server_update_": library.routed("server_update_"),
    "aggregate": _rows_only("aggregate"),
    "add_noise_": library.routed("add_noise_"),
    "client_dots": _rows_only("client_dots"),
    "weighted_sum": _rows_only("weighted_sum"),
    "coordinate_select": _rows_only("coordinate_select"),
    "client_gram": _rows_only("client_gram"),
    "block_decode_aggregate": library.routed("block_decode_aggregate"),
    "topk_decode_aggregate": library.routed("topk_decode_aggregate"),
    "block_quantize": library.routed("block_quantize"),
    "block_quantize_into": library.routed("block_quantize_into"),
    "topk_encode": library.routed("topk_encode"),
}
