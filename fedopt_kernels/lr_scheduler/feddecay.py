"""``FedDecay``: within-round learning-rate decay ([FedDecay] eq. 7 and appendix B.2).

[FedDecay] is an anonymous submission (``papers/feddecay.txt``: "Anonymous authors,
Paper under double-blind review"); its released code is github.com/JoeLavond/FedDecay.
"""

from __future__ import annotations

from typing import Optional

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..ops.validation import check_real

KINDS = ("exponential", "linear")
PER = ("step", "epoch")


def within_round_factor(k: int, beta: float, kind: str = "exponential") -> float:
    """``beta_k`` of FedDecay for the ``k``-th local step (or epoch) of a round, ``k >= 0``.

    * ``exponential`` (eq. 7): ``beta_k = beta ** k`` (``beta ** 0 = 1``, also for beta = 0);
    * ``linear`` (appendix B.2): ``beta_k = max(1 - k (1 - beta), 0)``.

    ``beta = 1`` gives 1 for every k (FedAvg); ``beta = 0`` gives 1 for ``k = 0`` and 0
    afterwards (FedSGD: only the first local gradient moves the model).
    """
    if kind == "exponential":
        return 1.0 if k == 0 else float(beta) ** k
    if kind == "linear":
        return max(1.0 - k * (1.0 - float(beta)), 0.0)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


FACTORS_KEY = "lr_factors"  # param-group entry: {scheduler kind: its current factor}


def composed_lrs(scheduler: LRScheduler, factor: float) -> list:
    """The lrs of ``scheduler``'s param groups when its own factor is ``factor``:
    ``initial_lr`` times the product of the current factors of EVERY fedopt scheduler on
    the optimizer (each records its factor in ``group["lr_factors"]`` under its class
    name), so :class:`FedDecay` and :class:`RoundAnnealing` on one optimizer multiply
    instead of overwriting each other, whatever their order of construction or
    stepping.  A closed form (no ratio of successive factors), so a factor of 0 --
    FedDecay with ``beta = 0`` -- is fine; the factors live in the param groups, so the
    optimizer's ``state_dict`` carries them."""
    key = type(scheduler).__name__
    lrs = []
    for base, group in zip(scheduler.base_lrs, scheduler.optimizer.param_groups):
        factors = group.setdefault(FACTORS_KEY, {})
        factors[key] = float(factor)
        product = 1.0
        for name in sorted(factors):  # a fixed order: the same bits whatever the construction order
            product *= factors[name]
        lrs.append(base * product)
    return lrs


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class FedDecay(LRScheduler):
    r"""Within-round learning-rate decay ([FedDecay]: "Balancing Model Performance and Rapid
    Personalization in Federated Learning with Learning Rate Scheduling", an anonymous
    submission -- the paper names no authors; its code, github.com/JoeLavond/FedDecay, is J.
    Lavond's).

    Call :meth:`step` after every local optimizer step.  Scheduler step ``t`` belongs to
    round ``j = t // local_steps`` at position ``i = t % local_steps`` of the round, and::

        lr_t = base_lr * alpha_j * beta_k  (* the factor of a RoundAnnealing on the optimizer)
        alpha_j = round_decay ** j                      # across-round decay (1: none)
        k = i                       (per="step")        # counts local SGD steps
        k = i // steps_per_epoch    (per="epoch")       # counts local epochs
        beta_k = beta ** k                              (kind="exponential", eq. 7)
        beta_k = max(1 - k (1 - beta), 0)               (kind="linear", appendix B.2)

    ``beta = 1`` is FedAvg (constant lr within a round), ``beta = 0`` is FedSGD (only the
    first local step of a round has a non-zero lr).  ``per="epoch"`` decays once per
    local epoch, by running epoch ``j`` at ``lr * beta_j``.  The authors' released code
    (``federatedscope/core/trainers/trainer_decay.py:42-54, 117-145``) instead runs the
    epoch at the full lr and then scales its parameter change, ``x <- x_start + beta_j
    (x_end - x_start)``: the same to first order in the lr, not beyond (one step equal,
    several not).  A scheduler cannot rescale parameters; the simulator does it with
    ``decay_scales_change=True`` (:class:`~fedopt_kernels.fl.LocalConfig`, recipe
    ``feddecay``).  ``per="epoch"`` needs ``steps_per_epoch``: the
    number of batches per epoch when the scheduler is stepped once per batch, or ``1``
    when it is stepped once per epoch (``local_steps`` then counts local epochs).  There
    is no default: a scheduler stepped per batch with an assumed 1 would silently decay
    every step.

    The schedule is a closed form of ``last_epoch`` (the scheduler's step counter), so
    ``state_dict()``/``load_state_dict()`` restore it exactly.  It chains with
    :class:`~fedopt_kernels.lr_scheduler.RoundAnnealing` on the same optimizer: both
    start from the shared ``initial_lr`` and the lr is the product of their factors
    (:func:`composed_lrs`), so FedNAR's per-round annealing times FedDecay's
    within-round decay is ``FedDecay(opt, K, beta)`` + ``RoundAnnealing(opt, 0.998)``
    in either order (use ``round_decay`` OR a RoundAnnealing, not both, unless you
    want the two across-round decays multiplied).  A simulator that trains
    several clients in turn on ONE optimizer rewinds to the start of a round with
    :meth:`start_round` before each client.

    Args:
        optimizer: the local optimizer (e.g. :class:`~fedopt_kernels.optim.FedNAR`).
        local_steps: scheduler steps per round ``K >= 1`` (local SGD steps, or local
            epochs when ``per="epoch"`` and the scheduler is stepped once per epoch).
        beta: the decay ``beta`` in ``[0, 1]``.
        kind: ``"exponential"`` (default) or ``"linear"``.
        round_decay: ``alpha_j = round_decay ** j``, in ``(0, 1]`` (default 1).
        per: ``"step"`` (default) or ``"epoch"``.
        steps_per_epoch: with ``per="epoch"`` (required there), scheduler steps per local
            epoch.
        last_epoch: index of the last scheduler step (``-1`` to start).
    """

    def __init__(self, optimizer: Optimizer, local_steps: int, beta: float, kind: str = "exponential",
                 round_decay: float = 1.0, per: str = "step", steps_per_epoch: Optional[int] = None,
                 last_epoch: int = -1):
        self.local_steps = _check_positive_int(local_steps, "local_steps")
        self.beta = check_real(beta, "beta", low=0.0, high=1.0)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.round_decay = check_real(round_decay, "round_decay", low=0.0, high=1.0)
        if self.round_decay == 0.0:
            raise ValueError("round_decay must be > 0 (alpha_j = round_decay ** j)")
        if per not in PER:
            raise ValueError(f"per must be one of {PER}, got {per!r}")
        self.per = per
        if per == "step":
            if steps_per_epoch not in (None, 1):
                raise ValueError("steps_per_epoch only applies with per='epoch'")
            self.steps_per_epoch = 1
        elif steps_per_epoch is None:
            raise ValueError("per='epoch' needs steps_per_epoch: the batches per local epoch if the scheduler is "
                             "stepped once per batch, or 1 if it is stepped once per epoch")
        else:
            self.steps_per_epoch = _check_positive_int(steps_per_epoch, "steps_per_epoch")
        super().__init__(optimizer, last_epoch)

    # ------------------------------------------------------------------ schedule
    def position(self, t: Optional[int] = None) -> tuple:
        """``(j, k)``: the round and the decay index ``k`` of scheduler step ``t``
        (default: the current one)."""
        t = self.last_epoch if t is None else t
        j, i = divmod(max(t, 0), self.local_steps)
        return j, i // self.steps_per_epoch

    def factor(self, t: Optional[int] = None) -> float:
        """``alpha_j * beta_k`` at scheduler step ``t`` (default: the current one)."""
        j, k = self.position(t)
        return self.round_decay ** j * within_round_factor(k, self.beta, self.kind)

    def get_lr(self):
        return composed_lrs(self, self.factor())

    def _get_closed_form_lr(self):
        return self.get_lr()

    def start_round(self, round_index: int) -> None:
        """Jump to the first local step of round ``round_index`` and set the lrs (for a
        simulator that trains the round's clients one after another on one optimizer)."""
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            raise ValueError(f"round_index must be a non-negative integer, got {round_index!r}")
        self.last_epoch = round_index * self.local_steps
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if hasattr(group["lr"], "fill_"):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"].clone() if hasattr(g["lr"], "clone") else g["lr"]
                         for g in self.optimizer.param_groups]


__all__ = ["FedDecay", "within_round_factor", "composed_lrs", "KINDS", "PER"]
