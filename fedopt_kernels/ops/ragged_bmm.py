"""Batched matrix products over clients whose batches have different lengths.

The batched simulation engine pads every client's batch to one length ``B``; its
matrix products would spend the padded part of their arithmetic on samples that do
not count.  :func:`ragged_bmm` multiplies only the real part: for client ``i`` with
``L_i = lengths[i]`` real samples and the sample dimension ``dim`` of ``a @ b``
(``a``: ``[C, M, K]``, ``b``: ``[C, K, N]``)::

    dim 1 (rows):         out[i, :L_i]    = a[i, :L_i] @ b[i]
    dim 2 (contraction):  out[i]          = a[i, :, :L_i] @ b[i, :L_i]
    dim 3 (columns):      out[i, :, :L_i] = a[i] @ b[i, :, :L_i]

and, for dims 1 and 3, the padded rows (columns) of ``out`` are zeros
(``zero_fill=True``) or copies of row (column) 0.  With operands whose padding is
zeros (gradients) or copies of the first sample (the forward pass), this equals
``torch.bmm`` of the padded operands value for value, up to rounding.

On CPU with a torch linked to a BLAS (MKL in the PyPI builds) each client's product is
one single-threaded BLAS GEMM of its own shape, the clients spread over torch's
threads (``csrc/cpu/ragged_bmm.cpp``): fewer operations than the padded ``bmm``, and
a client's bits depend on its own shape and data alone -- never on which clients share
the call, on the number of threads or on where in memory its operands lie (MKL's
kernels for skinny products, under 4 rows or 12 columns, follow the operands'
alignment: those run on aligned copies).  Elsewhere a loop of ``torch.mm`` per client
gives the same values (slower than the padded ``bmm``: :func:`ragged_bmm_uses_blas`
says which applies, so callers can keep ``bmm``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import backends
from . import _dispatch

__all__ = ["ragged_bmm", "ragged_bmm_uses_blas", "RaggedGraphOps", "ragged_graph_ops"]

_DIMS = (1, 2, 3)
_CPU = torch.device("cpu")


def _backend(device) -> str:
    """The backend of the ragged ops on ``device``: ``cpu`` (csrc/cpu/ragged_bmm.cpp)
    where its extension runs, else ``reference`` (a loop of ``@``)."""
    device = torch.device(device)
    return "cpu" if device.type == "cpu" and backends.why_unavailable("cpu", device) is None else "reference"


def ragged_bmm_uses_blas(dtype: torch.dtype, device) -> bool:
    """Whether :func:`ragged_bmm` runs on BLAS for ``dtype`` on ``device`` (CPU
    float32/float64 with the CPU extension and a torch linked to a BLAS)."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64)
            and _backend(device) == "cpu" and _dispatch.kernel("ragged_bmm_blas", "cpu", _CPU)(dtype))


class RaggedGraphOps(NamedTuple):
    """The CPU backend's ragged kernels as the targets of graph nodes (op overloads),
    for the batched engine's passes over its traced graphs (fl/engine/graph_passes.py):
    ``bmm(a, b, lengths, dim, zero_fill)`` (:func:`ragged_bmm`), ``bmm_out`` (the same
    with ``out=``), ``bias_relu_(x, bias, lengths, relu)`` and
    ``relu_backward_(grad, output, lengths)`` (csrc/cpu/ragged_epilogues.cpp)."""

    bmm: object
    bmm_out: object
    bias_relu_: object
    relu_backward_: object


def ragged_graph_ops() -> Optional[RaggedGraphOps]:
    """:class:`RaggedGraphOps`, or None where the CPU extension does not run."""
    if _backend(_CPU) != "cpu":
        return None
    return RaggedGraphOps(*(_dispatch.kernel(op, "cpu", _CPU) for op in
                            ("ragged_bmm", "ragged_bmm_out", "ragged_bias_relu_", "ragged_relu_backward_")))


def ragged_bmm(a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor, dim: int, *,
               zero_fill: bool = True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` batch by batch over the first ``lengths[i]`` entries of the sample
    dimension ``dim`` (see the module docstring).  Returns a new contiguous
    ``[C, M, N]`` tensor, or ``out``: a ``[C, M, N]`` tensor of ``a``'s dtype and
    device whose rows are contiguous and whose matrices do not overlap (e.g. a slice
    of each row of a wider buffer, viewed as a matrix)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            raise TypeError(f"ragged_bmm: {name} must be a 3-D floating point tensor, got "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}")
    if a.dtype != b.dtype or a.device != b.device:
        raise TypeError(f"ragged_bmm: a and b must share dtype and device, got {a.dtype} on {a.device} and "
                        f"{b.dtype} on {b.device}")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"ragged_bmm: a {tuple(a.shape)} and b {tuple(b.shape)} cannot be multiplied batch by batch")
    if dim not in _DIMS:
        raise ValueError(f"ragged_bmm: dim must be 1 (rows), 2 (contraction) or 3 (columns), got {dim!r}")
    if (not isinstance(lengths, torch.Tensor) or lengths.dtype != torch.int64 or lengths.shape != (a.shape[0],)
            or lengths.device.type != "cpu"):
        raise TypeError(f"ragged_bmm: lengths must be a CPU int64 tensor of shape [{a.shape[0]}], got "
                        f"{lengths.dtype if isinstance(lengths, torch.Tensor) else type(lengths).__name__}"
                        f"{'' if not isinstance(lengths, torch.Tensor) else ' ' + str(tuple(lengths.shape))}")
    full = (a.shape[1], a.shape[2], b.shape[2])[dim - 1]
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > full):
        raise ValueError(f"ragged_bmm: lengths must lie in [0, {full}] (the size of dim {dim}), got "
                         f"{lengths.tolist()}")
    C, M, N = a.shape[0], a.shape[1], b.shape[2]
    if out is not None:
        ok = (isinstance(out, torch.Tensor) and out.shape == (C, M, N) and out.dtype == a.dtype
              and out.device == a.device)
        if ok and out.numel():
            s0, s1, s2 = out.stride()
            ok = (s2 == 1 or N == 1) and (s1 >= N or M == 1) and (s0 >= (M - 1) * s1 + N or C == 1)
        if not ok:
            raise ValueError(f"ragged_bmm: out must be a {a.dtype} tensor of shape {(C, M, N)} on {a.device} with "
                             f"contiguous, non-overlapping rows and matrices, got "
                             f"{(out.dtype, tuple(out.shape), out.stride()) if isinstance(out, torch.Tensor) else out}")
    name = _backend(a.device)
    if out is None:
        return _dispatch.kernel("ragged_bmm", name, a.device)(a, b, lengths, dim, bool(zero_fill))
    return _dispatch.kernel("ragged_bmm_out", name, a.device)(a, b, lengths, dim, bool(zero_fill), out=out)
