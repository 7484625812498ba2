"""The ``cpu`` backend: the C++ CPU extension (csrc/cpu), OpenMP + at::vec."""

import torch

from ._extensions import load as _load

_reason = _load("_C")
if _reason is not None:
    raise ImportError(_reason)

from .library import register_cpp_fakes  # noqa: E402

register_cpp_fakes()

from ._cpp_ops import (  # noqa: E402,F401
    add_noise_, aggregate, aggregate_pieces, client_dots, client_dots_pieces, client_gram, client_gram_pieces,
    coordinate_select, coordinate_select_pieces, nar_apply_, nar_sq_norm, nar_step_, nar_step_batched_,
    ragged_bmm_blas, server_update_)

# The ragged products and their epilogues are the C++ ops themselves, not wrappers: the
# batched engine's graph passes insert them into traced graphs as nodes
# (ops.ragged_bmm.ragged_graph_ops), whose targets must be the op overloads.
ragged_bmm = torch.ops.fedopt_C.ragged_bmm.default
ragged_bmm_out = torch.ops.fedopt_C.ragged_bmm.out
ragged_bias_relu_ = torch.ops.fedopt_C.ragged_bias_relu_.default
ragged_relu_backward_ = torch.ops.fedopt_C.ragged_relu_backward_.default


def cpu_isa() -> str:
    """The instruction set the CPU kernels were dispatched to (default, avx2, avx512)."""
    return torch.ops.fedopt_C.cpu_isa()
