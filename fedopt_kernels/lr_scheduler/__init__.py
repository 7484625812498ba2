"""Learning-rate schedulers for federated local training.

* :class:`FedDecay` -- within-round decay ``lr_t = alpha_j * beta_k`` ([FedDecay]).
* :class:`RoundAnnealing` -- FedNAR's per-round annealing ``lr_t = lr_0 * 0.998^t``
  with an optional extra per-round weight-decay factor.

Both are ``torch.optim.lr_scheduler.LRScheduler`` subclasses with closed forms, so
``state_dict()``/``load_state_dict()`` restore them exactly, and they chain: on one
optimizer the lr is ``initial_lr`` times both factors (``lr_0 * 0.998^t * beta_k``),
whatever the order in which they were built or stepped.
"""

from .feddecay import KINDS, PER, FedDecay, within_round_factor
from .round_annealing import RoundAnnealing, annealing_factor

__all__ = ["FedDecay", "RoundAnnealing", "within_round_factor", "annealing_factor", "KINDS", "PER"]
