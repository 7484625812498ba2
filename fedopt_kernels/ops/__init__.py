"""Public functional ops: validate input, pick a backend, call it.

See :func:`nar_step_`, :func:`nar_step_groups_`, :func:`nar_step_batched_`, :func:`aggregate`,
:func:`weighted_sum`, :func:`client_dots` and :func:`server_update_`.  Every op
reaches its backend's kernel through one dispatcher (``_dispatch.kernel``); under
``torch.compile`` each is one opaque ``torch.library`` op (``torch.ops.fedopt_C.routed_*``,
registered with the C++ ops' fakes in :mod:`fedopt_kernels.backends.library`).
:func:`ragged_bmm` is the batched simulator's matrix product over ragged batches (CPU;
it runs inside the engine's traced graphs).
"""

from .aggregate import AggregateStats, aggregate, client_dots
from .checked_weights import CheckedWeights
from .client_pieces import ClientPieces
from .nar_step import MODES, NarStats, nar_step_, nar_step_batched_
from .nar_step_groups import NarGroup, nar_step_groups_
from .ragged_bmm import ragged_bmm, ragged_bmm_uses_blas
from . import robust_aggregate  # robust aggregators: ops.robust_aggregate.{coordinate_median, krum, ...}
from . import compressed  # compressed replies: ops.compressed.{encode, check_reply, decode_aggregate, ...}
from .server_update import RULES, server_update_
from .weighted_sum import weighted_sum

__all__ = [
    "MODES", "NarStats", "NarGroup", "AggregateStats", "nar_step_", "nar_step_groups_", "nar_step_batched_",
    "aggregate", "ClientPieces", "CheckedWeights",
    "client_dots", "weighted_sum", "RULES", "server_update_", "ragged_bmm", "ragged_bmm_uses_blas",
]
