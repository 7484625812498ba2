"""The aggregation seam of the server optimizers.

A server optimizer's round has two halves: *aggregation* -- validate the clients'
updates and weights, normalise the weights, average the updates into ``D`` with every
``||D_i||^2`` and the robustness decisions (NaN/Inf clients excluded, norm bounds) --
and the *step* its subclass applies to ``D``.  The first half is an
:class:`Aggregator`: a callable that fills ``D`` and returns a
:class:`RoundAggregate`.  :class:`LocalAggregator` (the default) averages this
process's clients with one fused :func:`fedopt_kernels.ops.aggregate`;
:class:`fedopt_kernels.distributed.DistributedAggregator` averages the union of every
rank's clients.  Both normalise the weights with :func:`normalize_weights` and describe
the round with :meth:`RoundAggregate.of`, so a step cannot tell which one ran.  This is
the one place where another aggregation rule (a robust one, say) plugs in: an
:class:`Aggregator` reads from the optimizer only what :class:`AggregatingOptimizer`
names, so this module does not import the optimizers.

Client weights are checked once, where they enter: a user's ``step(updates, weights)``
by :func:`normalize_weights`; a round's data sizes (the simulator, the Flower
strategies: :func:`fedopt_kernels.server.round.round_weights`) by
:func:`check_round_weights`, whose :class:`CheckedWeights` the layers below trust and
only normalise.  The normalised weights go on to the ops as :class:`CheckedWeights`
too (the weighted robust rules, DP's clipped sum, the compressed decode-aggregate), so
no op reads them again; an op called with a raw tensor or list keeps its own guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch

from ..ops.aggregate import AggregateStats, aggregate_bounded, check_weight_values, host_to_device, norm_bound_factors
from ..ops.checked_weights import CheckedWeights  # defined where the ops trust it; public here too
from ..ops import validation as V

__all__ = ["Aggregator", "AggregatingOptimizer", "LocalAggregator", "RoundAggregate", "CheckedWeights", "RunningAggregate",
           "check_round_weights", "normalize_weights", "check_weight_tensor", "weight_numbers", "refuse_dtensor"]


class AggregatingOptimizer(Protocol):
    """What an :class:`Aggregator` reads from the server optimizer it aggregates for
    (a :class:`~fedopt_kernels.server.ServerOptimizer` is one): the round's options and
    the check of its updates."""

    nonfinite: str
    max_client_norm: Optional[float]
    backend: Optional[str]

    @property
    def param_dtype(self) -> torch.dtype:
        ...

    def check_updates(self, updates, *, allow_empty: bool = False):
        ...


def check_round_weights(weights: torch.Tensor, *, share: bool = False) -> CheckedWeights:
    """``weights`` (``[C]`` numbers, a tensor) checked by value, once: finite, ``>= 0``
    and not all zero (``share``: one rank's share of a distributed round, where "not all
    zero" is a property of the union and is checked there)."""
    w = weights.detach().to("cpu", torch.float64)
    check_weight_values(w, "weights", allow_all_zero=share)
    return CheckedWeights(w)


@dataclass(frozen=True)
class RoundAggregate:
    """What an aggregator hands the server step (the mean update ``D`` is in its ``out``).

    * ``stats``: the :class:`~fedopt_kernels.ops.AggregateStats` of the round's clients
      (``client_sq_norms``, ``sq_norm = ||D||^2``, ``excluded``, the effective
      ``weights`` of the mean, ``all_excluded``);
    * ``p`` ``[C]``: the normalised weights of the clients that entered the mean (0 for
      an excluded one; they sum to 1, or are all 0);
    * ``bound`` ``[C]`` or None: each client's norm-bound factor ``min(1, M / (||D_i||
      + 1e-6))`` (None without ``max_client_norm``); the mean is ``sum_i p_i s_i D_i``;
    * ``skip``: 0-d bool, apply nothing (every client excluded, or device-resident
      weights whose total is not a positive finite number);
    * ``mean_sq``: ``sum_i p_i ||D_i||^2`` when it was computed elsewhere and the
      clients' own norms are not known here (secure aggregation,
      :class:`~fedopt_kernels.server.SecureSumAggregator`); None: from ``stats``.
    """

    stats: AggregateStats
    p: torch.Tensor
    bound: Optional[torch.Tensor]
    skip: torch.Tensor
    mean_sq: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, weights: torch.Tensor, stats: AggregateStats, valid: Optional[torch.Tensor],
           max_client_norm: Optional[float], factors: Optional[torch.Tensor] = None) -> "RoundAggregate":
        """The round described from the normalised ``weights`` the clients were averaged
        with, the aggregation's ``stats`` and the validity flag of
        :func:`normalize_weights`: the excluded clients' weights dropped and the rest
        renormalised to sum 1 over the clients kept (the op rescales them to the weights'
        own total instead, for the mean; ``p`` is what the step's statistics sum over),
        and the bound factors of the clients kept -- ``factors``, those the aggregation
        applied (:func:`~fedopt_kernels.ops.aggregate.aggregate_bounded`), derived here
        only for an aggregation that does not hand them on."""
        zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
        kept = torch.where(stats.excluded, zero, weights)
        total = kept.sum()
        p = torch.where(total > 0, kept / torch.where(total > 0, total, torch.ones_like(total)), zero)
        bound = None
        if max_client_norm is not None:
            if factors is None:
                factors = norm_bound_factors(stats.client_sq_norms.to(p.dtype), stats.excluded, max_client_norm)
            bound = torch.where(p > 0, factors.to(p.dtype), zero)
        skip = stats.all_excluded if valid is None else (stats.all_excluded | ~valid)
        return cls(stats=stats, p=p, bound=bound, skip=skip)


class Aggregator(Protocol):
    """``aggregator(optimizer, updates, weights, out) -> RoundAggregate``: validate
    ``updates`` and ``weights`` as :meth:`ServerOptimizer.step` documents (through
    ``optimizer.check_updates`` and :func:`normalize_weights`), write the mean update into
    ``out`` (``[N]``, the accumulation dtype, on the parameters' device) and describe the
    round.  Nothing may be written before every check passed."""

    def __call__(self, optimizer: AggregatingOptimizer, updates, weights, out: torch.Tensor) -> RoundAggregate:
        ...


class LocalAggregator:
    """This process's clients: one fused :func:`~fedopt_kernels.ops.aggregate` pass (and
    its exclusion / norm-bound pass, decided on the device)."""

    def __call__(self, optimizer: AggregatingOptimizer, updates, weights, out: torch.Tensor) -> RoundAggregate:
        rows, C = optimizer.check_updates(updates)
        p, valid = normalize_weights(weights, C, out.device, out.dtype)
        # p comes from normalize_weights, which checked the values (or they were checked where
        # they entered: CheckedWeights) -- on the CPU the op would read them a second time.
        _, stats, factors = aggregate_bounded(rows, p, out=out, nonfinite=optimizer.nonfinite,
                                              max_client_norm=optimizer.max_client_norm, backend=optimizer.backend,
                                              weights_checked=True)
        return RoundAggregate.of(p, stats, valid, optimizer.max_client_norm, factors)

    def __repr__(self) -> str:
        return "LocalAggregator()"


class RunningAggregate:
    """A round's replies aggregated as they arrived, instead of rows held until the
    step: a folded round's running weighted sum (:class:`fedopt_kernels.fl.engine.chunked.RoundFold`);
    the form an asynchronous buffer (FedBuff) or a secure-aggregation sum (where the
    server only ever sees the sum) takes too.  :class:`~fedopt_kernels.server.ServerRound`
    hands it to the step as it is, through :meth:`aggregator`."""

    def aggregator(self) -> Aggregator:
        """The :class:`Aggregator` that hands the server step this sum (the updates it is
        called with are None)."""
        raise NotImplementedError


def refuse_dtensor(t, name: str, what: str = "pass {name}.full_tensor() instead") -> None:
    """A server optimizer works on the full, unsharded state
    (:func:`fedopt_kernels.ops.validation.refuse_dtensor`)."""
    V.refuse_dtensor(t, name, who="the server", what=what)


def check_weight_tensor(weights: torch.Tensor, C: int, device: torch.device, *,
                        clients: str = "there are {C} clients") -> None:
    """The shape, dtype and device of client weights given as a tensor (one real number
    per client, on the CPU or the parameters' device); ``clients`` says whose ``C``
    clients they are (a rank of a distributed round: ``"this rank has {C} clients"``)."""
    if weights.is_complex() or weights.dtype == torch.bool:
        raise TypeError(f"weights must be real numbers, got dtype {weights.dtype}")
    if weights.dim() != 1 or weights.numel() != C:
        raise ValueError(f"weights has shape {tuple(weights.shape)} but {clients.format(C=C)} "
                         "(one weight per client)")
    if weights.device.type != "cpu" and weights.device != device:
        raise ValueError(f"weights is on {weights.device} but the parameters are on {device}")


def weight_numbers(weights, C: int, *, clients: str = "there are {C} clients", lenient: bool = False) -> list:
    """Client weights given as a sequence, as a list of ``C`` floats (``lenient``: an
    entry that is not a number is kept as it is, for the caller to leave that client
    out, instead of refusing the whole sequence)."""
    if lenient and hasattr(weights, "__len__") and not isinstance(weights, (str, bytes)):
        values = []
        for v in weights:
            try:
                values.append(float(v))
            except (TypeError, ValueError):
                values.append(v)
    else:
        try:
            values = [float(v) for v in weights]
        except (TypeError, ValueError):
            raise TypeError(f"weights must be a tensor or a sequence of numbers, got {weights!r}") from None
    if len(values) != C:
        raise ValueError(f"weights has {len(values)} entries but {clients.format(C=C)}")
    return values


def normalize_weights(weights, C: int, device: torch.device, acc: torch.dtype
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The one weights normaliser of the server side: ``(p, valid)`` for ``C`` clients,
    ``p`` ``[C]`` in ``acc`` on ``device`` summing to 1.

    ``weights``: None (uniform), a sequence of numbers or a CPU tensor (checked by value:
    finite, ``>= 0``, not all zero -- free for host data -- then normalised in float64
    and copied without waiting; ``valid`` None), :class:`CheckedWeights` (checked where
    they entered: normalised only), or a tensor on ``device`` (its values cannot be read
    without a sync: a total that is not a positive finite number gives ``p = 0`` and
    ``valid`` False, which skips the round instead of producing NaNs)."""
    if weights is None:
        return torch.full((C,), 1.0 / C, dtype=acc, device=device), None
    if isinstance(weights, CheckedWeights):
        if len(weights) != C:
            raise ValueError(f"weights has {len(weights)} entries but there are {C} clients")
        return _normalize_host(weights.values, device, acc), None
    refuse_dtensor(weights, "weights")
    if isinstance(weights, torch.Tensor):
        check_weight_tensor(weights, C, device)
        host = weights.device.type == "cpu"
        w = weights.detach()
    else:
        w, host = torch.tensor(weight_numbers(weights, C), dtype=torch.float64), True
    if host:
        check_weight_values(w, "weights")  # reads values: free for host data
        return _normalize_host(w, device, acc), None
    w = w.to(acc)
    total = w.sum()
    valid = torch.isfinite(total) & (total > 0)
    return torch.where(valid, w / total, torch.zeros_like(w)), valid


def _normalize_host(w: torch.Tensor, device: torch.device, acc: torch.dtype) -> torch.Tensor:
    """Checked host weights ``w`` normalised to sum 1 in float64, then in ``acc`` on
    ``device`` (a queued copy, from pinned memory)."""
    w = w.to(dtype=torch.float64)
    w = w / w.max()  # so that the sum cannot overflow
    return host_to_device((w / w.sum()).to(acc), device, "weights")
