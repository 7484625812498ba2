"""Federated aggregation across processes with ``torch.distributed``.

Each rank holds some of a round's clients; these collectives give every rank the
result one process would compute from all of them (global client order: rank 0's
clients, then rank 1's, ...):

* :func:`all_aggregate` -- :func:`fedopt_kernels.ops.aggregate` over the union of the
  ranks' clients (weighted sum, ``gamma``, every statistic, NaN exclusion and norm
  bounding decided globally).  ``mode="ordered"`` (default) is bitwise identical to the
  single-process result for any number of ranks; ``mode="all_reduce"`` does one packed
  ``all_reduce`` of partial sums and statistics, within a stated tolerance.
* :class:`DistributedServerOptimizer` -- wraps a server optimizer (FedAvg, FedAdam,
  ASNES, ...) so ``step(local_updates, local_weights)`` on every rank applies the
  global step to every rank's copy of the global model, with the optimizer's own
  aggregation in its distributed form (:func:`distributed_form`): the weighted mean,
  a Byzantine-robust rule (:class:`DistributedRobustAggregator`: rows gathered on rank
  0, result broadcast) or DP-FedAvg (:class:`DistributedDPAggregator`: local
  clipping, one distributed sum, noise drawn once) -- each the single-process result,
  bitwise.

* :class:`DiLoCo` -- DiLoCo's training loop (Douillard et al. 2023): ``H`` inner
  steps alone, then the workers' outer gradients averaged and a server optimizer's
  outer step (Nesterov SGD 0.7 / 0.9 by default); :class:`StreamingDiLoCo` syncs it by
  fragments at staggered steps, each exchange overlapped with the next inner steps.

gloo carries CPU tensors, NCCL CUDA tensors; the small host-side metadata exchange
uses gloo (a gloo group over the same ranks is made for an NCCL-only group).  The
simulator runs over ranks with ``torchrun ... -m fedopt_kernels simulate --distributed``
(:mod:`fedopt_kernels.fl.run.distributed_simulation`).  See ``docs/distributed.md``.
"""

from .comm import RankInputError
from .aggregate import MODES, all_aggregate
from .aggregator import DistributedAggregator
from .dp import DistributedDPAggregator
from .robust import DistributedRobustAggregator
from .server_optimizer import DistributedServerOptimizer, distributed_form
from .compressed_exchange import all_gather_replies
from .diloco import DiLoCo, SyncRecord
from .streaming import StreamingDiLoCo, StreamRecord

__all__ = ["all_gather_replies", "all_aggregate", "DistributedAggregator", "DistributedServerOptimizer", "DistributedRobustAggregator",
           "DistributedDPAggregator", "distributed_form", "RankInputError", "MODES", "DiLoCo", "SyncRecord",
           "StreamingDiLoCo", "StreamRecord"]
