"""``DistributedServerOptimizer``: one server step over the client updates of every rank."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ..server import ServerOptimizer, ServerRoundStats, ServerStats
from .aggregate import expand_rows
from .aggregator import DistributedAggregator

__all__ = ["DistributedServerOptimizer", "distributed_form"]


def distributed_form(aggregator, group=None, *, mode: str = "ordered", on_bad_client: str = "exclude",
                     max_weight_share: Optional[float] = None) -> DistributedAggregator:
    """The collective that does over every rank's clients what ``aggregator`` (a server
    optimizer's :attr:`~fedopt_kernels.server.ServerOptimizer.aggregator`) does over one
    process's: the weighted mean (:class:`~fedopt_kernels.server.aggregation.LocalAggregator`,
    or the rule ``"mean"``) -> :class:`DistributedAggregator`; a robust rule
    (:class:`~fedopt_kernels.server.robust_aggregation.robust_aggregator.RobustAggregator`) ->
    :class:`~fedopt_kernels.distributed.robust.DistributedRobustAggregator` (rows
    gathered on rank 0, the result broadcast; ``mode`` does not apply); DP-FedAvg
    (:class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator`) ->
    :class:`~fedopt_kernels.distributed.dp.DistributedDPAggregator`.  Anything else has
    no distributed form: refused (it would be silently replaced by the mean)."""
    from ..server.aggregation import LocalAggregator
    from ..server.differential_privacy.dp import DPAggregator
    from ..server.robust_aggregation.robust_aggregator import RobustAggregator
    from .dp import DistributedDPAggregator
    from .robust import DistributedRobustAggregator

    if isinstance(aggregator, RobustAggregator) and aggregator.rule != "mean":
        return DistributedRobustAggregator(aggregator, group, on_bad_client=on_bad_client,
                                           max_weight_share=max_weight_share)
    if isinstance(aggregator, DPAggregator):
        return DistributedDPAggregator(aggregator, group, mode=mode, on_bad_client=on_bad_client,
                                       max_weight_share=max_weight_share)
    if isinstance(aggregator, (LocalAggregator, RobustAggregator)):
        return DistributedAggregator(group, mode=mode, on_bad_client=on_bad_client, max_weight_share=max_weight_share)
    raise TypeError(f"the optimizer's aggregator {type(aggregator).__name__} has no distributed form (the weighted "
                    "mean, a RobustAggregator and a DPAggregator have one): a distributed step would replace it")


class DistributedServerOptimizer:
    """Wraps a :class:`~fedopt_kernels.server.ServerOptimizer` (FedAvg, FedAdam, ASNES,
    ...) whose parameters are EVERY rank's copy of the global model, so that

    ``step(local_updates, local_weights)`` -- called on every rank of ``group`` with that
    rank's clients (a ``[C_r, N]`` tensor or ``C_r`` flat vectors, ``C_r >= 0``, and their
    ``C_r`` weights or None) -- takes the step one process would take with all the
    clients (rank 0's first): the weights are normalised over all ranks, the mean update,
    every statistic, exclusion and skip decision are global
    (:func:`~fedopt_kernels.distributed.all_aggregate`), and every rank applies the same
    step to its parameters and state.  With ``mode="ordered"`` (default) parameters,
    state and :class:`~fedopt_kernels.server.ServerStats` are bitwise those of the
    single-process ``optimizer.step`` on the union, for any number of ranks; with
    ``"all_reduce"`` they follow the mean update's tolerance (``all_aggregate``).

    Weights must be of one kind on every rank: all None (uniform over ALL clients), all
    numbers / CPU tensors (their values travel with the host-side exchange and are
    checked and normalised exactly as one process would), or all device tensors
    (gathered on the device; a bad total skips the round as in one process).

    Bad weights (host weights only; device weights are not read): with
    ``on_bad_client="exclude"`` (default, as the Flower strategies' ``on_bad_reply``) a
    client whose weight is negative, NaN, infinite or not a number is left out on every
    rank -- its rank drops its update before anything is summed, the reason travels in
    the host-side exchange the step makes anyway -- and the step is the single-process
    step over the good clients alone (bitwise, ``mode="ordered"``).  The returned
    statistics still name all ``C`` clients: a left-out one is ``excluded``, has weight
    0 and ``client_sq_norms`` NaN (not read); :attr:`last_left_out` lists
    ``(global index, "bad_weight", detail)``, the same on every rank.  No usable client
    left: ``ValueError`` on every rank, nothing changed.  ``"raise"``: as before, a bad
    weight raises ``ValueError`` on every rank before anything changes.

    The optimizer's own :attr:`~fedopt_kernels.server.ServerOptimizer.aggregator` (as
    set when the wrapper is made) decides the collective (:func:`distributed_form`):
    the weighted mean, a :class:`~fedopt_kernels.server.robust_aggregation.robust_aggregator.RobustAggregator`
    (gathered on rank 0, broadcast) or a :class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator`
    (local clipping, one distributed sum, the noise drawn once), each bitwise the
    single-process round; any other aggregator is refused.

    ``max_weight_share`` (None: no cap) caps each client's share of the round's total
    weight over ALL ranks (:func:`~fedopt_kernels.server.weighting.cap_weight_shares`:
    the same shares one process computes); it needs host weights.

    Everything else (``param_groups``, ``state``, ``state_dict()``,
    ``load_state_dict()``, hyperparameters) is the wrapped optimizer's; give LR
    schedulers the wrapped optimizer (:attr:`optimizer`).  Its own ``step`` stays a
    single-process step.
    """

    def __init__(self, optimizer: ServerOptimizer, group=None, *, mode: str = "ordered",
                 on_bad_client: str = "exclude", max_weight_share: Optional[float] = None):
        if not isinstance(optimizer, ServerOptimizer):
            raise TypeError(f"optimizer must be a fedopt_kernels.server.ServerOptimizer, got "
                            f"{type(optimizer).__name__} (FedLAW learns its weights on a proxy set and has no "
                            "distributed form)")
        self._aggregator = distributed_form(optimizer.aggregator, group, mode=mode, on_bad_client=on_bad_client,
                                            max_weight_share=max_weight_share)
        self.optimizer = optimizer
        self.group = group
        self.mode = mode
        self.on_bad_client = on_bad_client
        self.max_weight_share = self._aggregator.max_weight_share
        self.last_left_out: Tuple[Tuple[int, str, str], ...] = ()

    def __getattr__(self, name):
        # only called for what this wrapper does not define itself
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedServerOptimizer({self.optimizer!r}, mode={self.mode!r})"

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    # A server of fedopt_kernels.server.round: it takes the updates, the caller averages
    # the buffers, and its round is the wrapped optimizer's on every rank's clients.
    takes = "updates"
    keeps_buffers = False
    weights_are_a_share = True  # this rank's clients' weights: "not all zero" holds for the union

    def round(self, updates, weights=None) -> ServerRoundStats:
        """One round of :mod:`fedopt_kernels.server.round` over every rank's clients
        (collective): :meth:`step`, and its statistics by their record names."""
        return self.optimizer.round_stats(self.step(updates, weights))

    @torch.no_grad()
    def step(self, updates, weights=None) -> ServerStats:
        """Collective: this rank's updates and weights; returns the global
        :class:`~fedopt_kernels.server.ServerStats` (identical on every rank)."""
        self.last_left_out = ()
        st = self.optimizer.step(updates, weights, aggregator=self._aggregator)
        self.last_left_out = self._aggregator.last_left_out
        if self._aggregator.last_kept is None:
            return st
        C, kept = self._aggregator.last_kept  # the step saw the good clients alone: name all C again
        q, excluded, w = expand_rows(C, kept, st.client_sq_norms, st.excluded, st.weights)
        return dataclasses.replace(st, client_sq_norms=q, excluded=excluded, weights=w)
