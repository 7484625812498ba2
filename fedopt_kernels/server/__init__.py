"""Server side of a federated round: server optimizers and FedLAW.

Every optimizer here is a ``torch.optim.Optimizer`` over the GLOBAL model's parameters
whose ``step(updates, weights=None)`` takes the clients' updates
``D_i = x_start - x_end_i`` (a ``[C, N]`` tensor or ``C`` flat vectors in
:func:`fedopt_kernels.utils.module_to_vector` order), averages them with ONE fused
aggregation (which also yields every norm the adaptive methods need, excludes NaN/Inf
clients and optionally bounds client norms), applies its formula and returns a
:class:`ServerStats` of tensors.  :class:`FedLAW` instead learns the aggregation
weights and the shrinking factor on a proxy dataset.

==============  ==========================================================
``FedAvg``      ``x <- gamma (x - lr D)`` (server lr, global weight shrinking)
``FedAvgM``     server heavy-ball / Nesterov momentum
``FedAdagrad``  Reddi et al. 2021, Algorithm 2
``FedAdam``     Reddi et al. 2021, Algorithm 2
``FedYogi``     Reddi et al. 2021, Algorithm 2
``FedExP``      adaptive extrapolated step size (Jhunjhunwala et al. 2023)
``ASNES``       AdaScale gain ratio + Nesterov momentum ([ASNES] eq. 3, 4)
``FedLAW``      learned gamma and lambda on a proxy set ([FedLAW] eq. 3, 8)
==============  ==========================================================

Every algorithm, FedLAW included, runs a round through one interface
(:mod:`.round`: ``takes``, ``keeps_buffers``, ``round(results, weights) ->
ServerRoundStats``); :class:`ServerRound` is the whole round around it -- the weights,
the aggregation pipeline (a robust rule, :class:`RoundPrivacy`), the step, the
per-client state, the buffers, the record -- and the simulator, the Flower strategies
and ``torch.distributed`` all hand it their replies (:class:`RoundReplies`).  :mod:`.registry` names the
algorithms: class, ``weighting="auto"`` rule with its source, defaults read from the
class.  Shared too: :mod:`.weighting` (client weights, the averaging of floating
buffers) and :func:`scaffold_control_update_` (SCAFFOLD's control variates).
"""

from ._base import RoundInfo, ServerOptimizer, ServerStats
from .aggregation import Aggregator, LocalAggregator, RoundAggregate, RunningAggregate, normalize_weights
from .asnes import ASNES
from .fedadagrad import FedAdagrad
from .fedadam import FedAdam
from .fedavg import FedAvg
from .fedavgm import FedAvgM
from .fedexp import FedExP
from .fedlaw import FedLAW, FedLAWRound
from .fedyogi import FedYogi
from .registry import ALGORITHM_WEIGHTING, ALGORITHMS, WEIGHTINGS, Algorithm, algorithm, resolve_weighting
from .differential_privacy.privacy import RoundPrivacy
from .robust_aggregation.robust_aggregator import AGGREGATOR_PARAMS, AGGREGATORS, RobustAggregator, robust_rule
from .round import ClientStateRule, RoundOutcome, RoundReplies, ServerRound, ServerRoundStats, read_metrics, round_weights
from .scaffold import ScaffoldControl, ScaffoldReplies, scaffold_control_update_
from .secure_sum import SecureSumAggregator
from .weighting import average_buffers, client_weights

__all__ = [
    "SecureSumAggregator",
    "ServerOptimizer", "ServerStats", "RoundInfo", "FedAvg", "FedAvgM", "FedAdagrad", "FedAdam", "FedYogi",
    "FedExP", "ASNES", "FedLAW", "FedLAWRound", "scaffold_control_update_", "WEIGHTINGS", "ALGORITHM_WEIGHTING",
    "resolve_weighting", "client_weights", "average_buffers", "Aggregator", "LocalAggregator", "RoundAggregate",
    "normalize_weights", "ALGORITHMS", "Algorithm", "algorithm", "ServerRound", "ServerRoundStats", "round_weights",
    "read_metrics", "RobustAggregator", "robust_rule", "AGGREGATORS", "AGGREGATOR_PARAMS", "RoundPrivacy",
    "RoundReplies", "RoundOutcome", "ClientStateRule", "RunningAggregate", "ScaffoldControl", "ScaffoldReplies",
]
