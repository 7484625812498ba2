"""fedopt_kernels: fused kernels and optimizers for federated learning on PyTorch.

* :mod:`fedopt_kernels.ops` -- functional fused ops (``nar_step_``,
  ``nar_step_batched_``, ``aggregate``, ``weighted_sum``, ``client_dots``).
* :mod:`fedopt_kernels.optim` -- ``FedNAR``, the local optimizer.
* :mod:`fedopt_kernels.server` -- server optimizers (FedAvg, FedAvgM, FedAdam, FedYogi,
  FedAdagrad, FedExP, ASNES) and FedLAW.
* :mod:`fedopt_kernels.lr_scheduler` -- ``FedDecay`` and FedNAR's ``RoundAnnealing``.
* :mod:`fedopt_kernels.utils` -- model <-> flat vector helpers.
* :mod:`fedopt_kernels.fl` -- the simulator (imported on demand; the ``sim`` extra:
  :mod:`fedopt_kernels.extras`), and the ``fedopt`` command line.
"""

__version__ = "0.1.0"

from . import backends, lr_scheduler, ops, optim, server, utils  # noqa: E402,F401
