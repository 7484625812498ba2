"""The ``cpu`` backend: the C++ CPU extension (csrc/cpu), OpenMP + at::vec."""

from ._extensions import load as _load

_reason = _load("_C")
if _reason is not None:
    raise ImportError(_reason)

from ._cpp_ops import (  # noqa: E402,F401
    add_noise_, aggregate, aggregate_pieces, client_dots, client_dots_pieces, nar_apply_, nar_sq_norm, nar_step_, nar_step_batched_, server_update_)
