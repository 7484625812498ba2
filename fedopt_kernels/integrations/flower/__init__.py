"""Flower integration: fused-aggregation strategies and a FedNAR client for Flower 1.41.

Install with ``pip install fedopt_kernels[flower]`` (``flwr>=1.41,<1.42``; Flower's
simulation runtime additionally needs ``flwr[simulation]``, i.e. Ray).  Built on
Flower's Message API (``flwr.serverapp.strategy``, ``ServerApp`` / ``ClientApp``):

* server: :class:`FusedStrategy` and the named strategies :class:`FedAvg` (server lr,
  global weight shrinking ``gamma``), :class:`FedAvgM`, :class:`FedAdam`,
  :class:`FedYogi`, :class:`FedAdagrad`, :class:`FedExP`, :class:`ASNES`,
  :class:`FedLAW` (server-side proxy set), or :func:`make_strategy` by name; the
  concerns that compose around one, as Flower's DP wrappers do: :class:`Scaffold`,
  :class:`RobustAggregation`, :class:`DifferentialPrivacy`, :class:`Compression`
  (compressed updates, decoded inside the aggregation: :mod:`.compression`).  Their ``aggregate_train``
  hands the clients' ArrayRecords to the server round of :mod:`fedopt_kernels.server`
  (:class:`~fedopt_kernels.server.ServerRound`): on a CPU server it reads
  the replies' arrays in place (``read_in_place=True``, the default:
  :class:`~fedopt_kernels.ops.ClientPieces`, no ``[C, N]`` copy); with
  ``read_in_place=False``, arrays of another dtype or an accelerator it copies them
  into one ``[C, N]`` tensor (one copy per array, :func:`stack_arrayrecords`).
* client: :class:`FedNARClient` builds the ``ClientApp``'s ``train`` / ``evaluate``
  functions: local FedNAR training (with FedProx's and SCAFFOLD's terms), replying with
  the trained arrays and ``num-examples``.
* records: :func:`stack_arrayrecords`, :func:`arrayrecord_to_vector`,
  :func:`model_to_arrayrecord`, :func:`load_arrayrecord_` (ArrayRecord <-> flat tensors).

See ``docs/flower.md`` and ``examples/flower_app``.
"""

from __future__ import annotations

import warnings

from ...extras import require
from .. import INTEGRATIONS, installed_version, parse_version

_SPEC = INTEGRATIONS["flower"]
try:
    import flwr as _flwr
except ImportError as _exc:
    raise ImportError(
        "fedopt_kernels.integrations.flower needs Flower (flwr 1.41), which is not installed: "
        f"{_SPEC['install']}  (add flwr[simulation] to run Flower's simulation runtime)") from _exc
_version = getattr(_flwr, "__version__", None) or installed_version("flwr") or "0"
if parse_version(_version)[:2] < _SPEC["min"]:
    raise ImportError(
        f"fedopt_kernels.integrations.flower needs {_SPEC['requirement']} (Flower's Message API of "
        f"flwr.serverapp.strategy), found flwr {_version}: {_SPEC['install']}")
if parse_version(_version)[:2] >= _SPEC["below"]:
    warnings.warn(f"fedopt_kernels.integrations.flower is tested with {_SPEC['requirement']}, found flwr {_version}",
                  stacklevel=2)
# Its client trains as the simulator's clients do (fedopt_kernels.fl): the flower extra brings sim's.
require("sim", "fedopt_kernels.integrations.flower", install=_SPEC["install"])

from .client import RUN_CONFIG_KEYS, FedNARClient, batch_seed, init_seed, local_config_from_run_config  # noqa: E402
from .records import (arrayrecord_to_vector, load_arrayrecord_, model_to_arrayrecord,  # noqa: E402
                      stack_arrayrecords, tensor_to_array, tensors_to_arrayrecord)
from .compression import Compression  # noqa: E402
from .concern import Concern, ConcernWrapper  # noqa: E402
from .named import (ASNES, STRATEGIES, FedAdagrad, FedAdam, FedAvg, FedAvgM, FedExP, FedLAW,  # noqa: E402
                    FedYogi, make_strategy)
from .privacy import DifferentialPrivacy  # noqa: E402
from .robust import RobustAggregation  # noqa: E402
from .scaffold import Scaffold  # noqa: E402
from .strategy import FusedStrategy  # noqa: E402

__version_flwr__ = _version

__all__ = [
    "FusedStrategy", "FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedExP", "ASNES", "FedLAW",
    "make_strategy", "STRATEGIES", "Scaffold", "RobustAggregation", "DifferentialPrivacy", "Compression", "Concern",
    "ConcernWrapper", "FedNARClient", "local_config_from_run_config", "RUN_CONFIG_KEYS", "batch_seed", "init_seed",
    "stack_arrayrecords", "arrayrecord_to_vector", "model_to_arrayrecord", "load_arrayrecord_",
    "tensor_to_array", "tensors_to_arrayrecord",
]
