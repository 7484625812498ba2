"""The ``cuda`` backend: the C++ CUDA extension (csrc/cuda)."""

from ._extensions import load as _load

_reason = _load("_C_cuda")
if _reason is not None:
    raise ImportError(_reason)

from .library import register_cpp_fakes  # noqa: E402

register_cpp_fakes()  # the ops are _C's (loaded first), their CUDA kernels _C_cuda's

from ._cpp_ops import (  # noqa: E402,F401
    add_noise_, aggregate, client_dots, coordinate_select, nar_apply_, nar_sq_norm, nar_step_, nar_step_batched_,
    server_update_)
from .gram import client_gram  # noqa: E402,F401 - torch's batched products on the device (no C++ kernel)
