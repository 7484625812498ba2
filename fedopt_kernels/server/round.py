"""One server round, whatever the algorithm: everything between receiving a round's
replies and the next global model.

Every server algorithm of this package -- the :class:`ServerOptimizer` subclasses and
:class:`~fedopt_kernels.server.FedLAW` -- answers the same three things, which is all a
round needs of it:

* ``takes``: what a round hands it for each client, ``"updates"`` (``D_i = x_global -
  x_i``) or ``"models"`` (the client parameters ``x_i`` themselves: FedLAW);
* ``keeps_buffers``: True when the global model's floating buffers (BatchNorm
  statistics) are the algorithm's own (FedLAW's proxy training), False when the round
  averages the clients' buffers with its weights;
* ``round(results, weights) -> ServerRoundStats``: the step on ``C`` clients' results
  (a ``[C, N]`` tensor, ``C`` flat vectors or :class:`~fedopt_kernels.ops.ClientPieces`)
  with the weights of :func:`round_weights` (None: uniform).

:class:`ServerRound` is the round around that step, written once: the simulator (every
engine, folded or not, and over ``torch.distributed`` ranks) and the Flower strategies
hand it a :class:`RoundReplies` and read a :class:`RoundOutcome`; none of them
re-implements a part of it.  In order, a round:

1. takes the replies as the caller screened them (``left_out``: ``(client, reason,
   detail)`` of the replies that have no row -- a client without data, a failed node;
   screening what arrives is the caller's, as only it knows its messages);
2. forms the weights ONCE (:meth:`ServerRound.weights`: the algorithm's rule, checked
   by value, capped under ``max_weight_share``); the step, the buffers and every layer
   below take them as :class:`~.aggregation.CheckedWeights` and only normalise;
3. aggregates through one composed pipeline: *decode* (the ``decoder`` slot: compressed
   replies, :class:`~.compressed.CompressedReplies`, are aggregated by the fused
   decode-aggregate or decoded into rows for a robust rule or DP: :mod:`.compressed`),
   then the *rule* -- the optimizer's
   weighted mean, a robust ``aggregator`` (:class:`~.robust_aggregator.RobustAggregator`)
   or, with ``privacy`` (:class:`~.privacy.RoundPrivacy`), DP-FedAvg's clipped noisy
   mean -- made the server optimizer's aggregation seam (:mod:`.aggregation`); replies
   already summed as they arrived (:class:`~.aggregation.RunningAggregate`: a folded
   round's running sum; later a FedBuff buffer or a secure-aggregation sum, where the
   server sees only the sum) enter the step as they are;
4. steps the server algorithm;
5. updates the per-client state (``client_state``, a :class:`ClientStateRule`:
   SCAFFOLD's control variates) without the clients the step excluded;
6. averages the floating buffers into ``model`` with the round's weights (FedLAW keeps
   its own);
7. records: :meth:`RoundOutcome.record` reads the step's statistics with one host
   synchronisation and adds the exclusions by reason (``excluded_clients``,
   ``excluded_<reason>``), the privacy record (``dp_*``) and the robust rule's
   (``robust_selected``).  The names are ``fedopt simulate``'s records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch

from ..utils.flat import buffers_to_vector, vector_to_buffers
from .aggregation import CheckedWeights, RunningAggregate, check_round_weights
from .compressed import DecodeAggregate
from .robust_aggregation.robust_aggregator import refuse_robust_statistics
from .round_stats import ServerRoundStats, read_metrics
from .weighting import BufferAverage, average_buffers, cap_weight_shares, client_weights

__all__ = ["ServerRoundStats", "ServerRound", "RoundReplies", "RoundOutcome", "ClientStateRule", "round_weights",
           "read_metrics", "ROUND_INPUTS"]

ROUND_INPUTS = ("updates", "models")


def round_weights(weighting: str, sizes, max_weight_share: Optional[float] = None, *,
                  share: bool = False) -> Optional[CheckedWeights]:
    """The ``weights`` of a round from the clients' data ``sizes`` under a resolved
    ``weighting`` (:mod:`.weighting`), checked here, once
    (:func:`~.aggregation.check_round_weights`; ``share``: one rank's share of a
    distributed round): None (uniform) for ``"uniform"``; for ``"size"`` the sizes as a
    float64 CPU tensor, or, with ``max_weight_share``, their shares capped at it
    (:func:`~.weighting.cap_weight_shares`).  The server only normalises them
    (:func:`~.aggregation.normalize_weights`)."""
    weights = client_weights(weighting, sizes)
    if weights is None:
        return None
    weights = check_round_weights(weights, share=share)
    if max_weight_share is not None:  # shares: what a claimed size can buy (finite, >= 0 by construction)
        weights = CheckedWeights(cap_weight_shares(weights.values, max_weight_share))
    return weights


class ClientStateRule(Protocol):
    """Per-client state a round updates after its step (SCAFFOLD's control variates:
    :class:`~fedopt_kernels.fl.ScaffoldState` in the simulator, where the server keeps
    every ``c_i``; :class:`~fedopt_kernels.server.scaffold.ScaffoldControl` where the
    clients keep theirs)."""

    def commit(self, replies: "RoundReplies", excluded: Optional[torch.Tensor]) -> None:
        """Apply the round: the clients of ``replies`` (``replies.client_state``: what
        the rule reads from them), without those the step ``excluded`` (``[C]`` bool)."""

    def discard(self) -> None:
        """Forget the round: it applied nothing."""


@dataclass
class RoundReplies:
    """One round's replies as the server receives them, in the round's order.

    * ``results``: what the server ``takes`` for each client -- a ``[C, N]`` tensor,
      ``C`` flat vectors, :class:`~fedopt_kernels.ops.ClientPieces` -- or a
      :class:`~.aggregation.RunningAggregate` (summed as they arrived); None: no client
      is left, the round applies nothing;
    * ``sizes``: the clients' data sizes, the weights' source under ``"size"``;
      ``weights``: instead, the round's weights already formed by
      :meth:`ServerRound.weights` (a folded round forms them before its clients train);
    * ``clients``: the client (node) ids of the rows, for the records;
    * ``left_out``: ``(client, reason, detail)`` of the replies screened out before the
      round (they have no row); ``reasons``: every reason the record counts (zeros
      included; ``"nonfinite"``, the step's own, last);
    * ``buffers``: the clients' floating buffers, ``[C, M]`` rows or a running
      :class:`~.weighting.BufferAverage` (None: the model keeps its buffers);
    * ``client_state``: what the round's :class:`ClientStateRule` reads from the replies;
    * ``share``: the rows this process holds when the step spreads over ranks (a
      server with ``weights_are_a_share``): ``results`` are rows ``share`` of the round,
      everything else is the whole round's;
    * ``order``: the round's clients in the order the record lists ``left_out`` (None:
      screened first, then the rows').
    """

    results: Any
    sizes: Any = None
    weights: Optional[CheckedWeights] = None
    clients: Sequence = ()
    left_out: Sequence[Tuple[Any, str, str]] = ()
    reasons: Sequence[str] = ("nonfinite",)
    buffers: Any = None
    client_state: Any = None
    share: Optional[slice] = None
    order: Optional[Sequence] = None


class RoundOutcome:
    """What a round did: :attr:`stats` (the step's :class:`ServerRoundStats`, device
    tensors; None when no client was left) and the components' records, read by
    :meth:`record`."""

    def __init__(self, stats: Optional[ServerRoundStats], replies: RoundReplies, records: List[Callable[[], dict]]):
        self.stats = stats
        self.replies = replies
        self._records = records
        self.left_out: List[Tuple[Any, str, str]] = list(replies.left_out)

    @property
    def excluded(self) -> Optional[torch.Tensor]:
        """``[C]`` bool: the rows the step left out (NaN/Inf); None without a step."""
        return None if self.stats is None else self.stats.excluded

    def record(self, extra: Optional[dict] = None) -> dict:
        """The round's record (one host synchronisation for the step's statistics, one
        more only when it excluded a client): the step's metrics, ``extra`` (the
        caller's, e.g. the attacked clients of a simulated attack), the privacy and
        robust records, then ``excluded_clients`` over every reason and
        ``excluded_<reason>``.  Sets :attr:`left_out` (``(client, reason, detail)``,
        screened and ``"nonfinite"``, in the round's ``order``)."""
        if self.stats is None:
            out = {"server_skipped": True}
        else:  # one read of the device values (the records' plain values keep their place ahead of them)
            metrics = dict(self.stats.metrics)
            metrics.update(extra or {})
            for rec in self._records:
                metrics.update(rec())
            out = read_metrics(metrics)
        bad = list(self.replies.left_out)
        if out.get("excluded_clients"):  # the step's NaN/Inf exclusions (read only then)
            mask = self.stats.excluded.detach().cpu().tolist()
            bad += [(cid, "nonfinite", "NaN/Inf update") for cid, e in zip(self.replies.clients, mask) if e]
        counts = {reason: 0 for reason in self.replies.reasons}
        for _, reason, _ in bad:
            counts[reason] = counts.get(reason, 0) + 1
        out["excluded_clients"] = sum(counts.values())
        for reason in counts:
            out[f"excluded_{reason}"] = counts[reason]
        if self.replies.order is not None and bad:
            position = {cid: i for i, cid in enumerate(self.replies.order)}
            bad.sort(key=lambda b: position[b[0]])
        self.left_out = bad
        return out


class ServerRound:
    """The whole server round (see the module docstring): ``round_(replies)`` takes a
    :class:`RoundReplies` and returns its :class:`RoundOutcome`.

    Args:
        server: a :class:`~fedopt_kernels.server.ServerOptimizer`, a
            :class:`~fedopt_kernels.server.FedLAW`, or anything with ``takes``,
            ``keeps_buffers`` and ``round(results, weights)``.
        weighting: the resolved rule, ``"size"`` or ``"uniform"``
            (:func:`~.weighting.resolve_weighting`).
        max_weight_share: the largest share of the round's weight one client may get
            under ``"size"`` (None: no cap).
        aggregator: the aggregation rule (None: the optimizer's weighted mean; a
            :class:`~.robust_aggregator.RobustAggregator`), made the optimizer's.
        privacy: DP-FedAvg (:class:`~.privacy.RoundPrivacy`), whose clipped noisy mean
            becomes the optimizer's aggregation; not with a robust ``aggregator``.
        client_state: the per-client state the round updates (a :class:`ClientStateRule`).
        model: the global model whose floating buffers the round averages (None: the
            caller keeps them).
        decoder: the decoding stage of the pipeline, ``results -> results`` (None:
            the replies are the updates; the slot where compressed replies are decoded);
            a decoder with a ``record()`` method adds its entries to the round's record.
    """

    def __init__(self, server, weighting: str, max_weight_share: Optional[float] = None, *, aggregator=None,
                 privacy=None, client_state: Optional[ClientStateRule] = None, model=None,
                 decoder: Optional[Callable[[Any], Any]] = None):
        _check_server(server)
        if aggregator is not None and privacy is not None:
            raise ValueError("a robust aggregator and differential privacy do not compose: DP-FedAvg's sensitivity "
                             "is that of the clipped weighted sum, which a robust rule does not compute")
        for name, part in (("aggregator", aggregator), ("privacy", privacy)):
            if part is not None and (server.takes != "updates" or not hasattr(server, "aggregator")):
                raise ValueError(f"{name} needs a server optimizer that takes the clients' updates; "
                                 f"{type(server).__name__} aggregates on its own")
        if decoder is not None and not callable(decoder):
            raise TypeError(f"decoder must be callable (results -> results), got {type(decoder).__name__}")
        self._server = server
        self.weighting = weighting
        self.max_weight_share = max_weight_share if weighting == "size" else None
        self.aggregator = aggregator
        self.privacy = privacy
        self.client_state = client_state
        self.model = model
        self.decoder = decoder
        rule = privacy.aggregator if privacy is not None else aggregator
        if rule is not None:
            if aggregator is not None:
                refuse_robust_statistics(server, aggregator.rule)
            server.aggregator = rule

    @property
    def server(self):
        """The server algorithm; setting it (a wrapper of the same optimizer, such as
        :class:`~fedopt_kernels.distributed.DistributedServerOptimizer`) keeps the
        round's components."""
        return self._server

    @server.setter
    def server(self, server) -> None:
        _check_server(server)
        self._server = server

    @property
    def takes(self) -> str:
        """``"updates"`` or ``"models"``: what the replies' ``results`` hold for each client."""
        return self._server.takes

    # ------------------------------------------------------------------ the round
    @torch.no_grad()
    def __call__(self, replies: RoundReplies) -> RoundOutcome:
        """One round on ``replies`` (see the module docstring for its steps).  Nothing is
        changed before the weights and the step's own checks passed."""
        if not isinstance(replies, RoundReplies):
            raise TypeError(f"a round takes RoundReplies, got {type(replies).__name__} (ServerRound.step(results, "
                            "weights) is the server step alone)")
        results = replies.results
        if results is None:  # no client left: nothing is applied, as when every update is NaN/Inf
            if self.client_state is not None:
                self.client_state.discard()
            return RoundOutcome(None, replies, [])
        weights = replies.weights
        if isinstance(results, RunningAggregate):  # summed with the round's weights as the clients came in
            stats = self._server.round(None, None, aggregator=results.aggregator())
        else:
            if weights is None:
                weights = self.weights(replies.sizes)  # the one place a round's weights are formed
            if self.decoder is not None:
                results = self.decoder(results)
            stats = self.step(results, self._share(weights, replies.share))
        if self.client_state is not None:
            self.client_state.commit(replies, stats.excluded)
        self._average_buffers(replies.buffers, weights, stats.excluded)
        records = []
        if callable(getattr(self.decoder, "record", None)):  # what the decoder reports (the Flower codec: bytes up)
            records.append(self.decoder.record)
        if self.privacy is not None:
            records.append(self.privacy.record)
        if self.aggregator is not None:
            records.append(lambda: self.aggregator.record(list(replies.clients)))
        return RoundOutcome(stats, replies, records)

    def weights(self, sizes) -> Optional[CheckedWeights]:
        """The round's weights from the clients' data ``sizes``: :func:`round_weights`
        under :attr:`weighting` and :attr:`max_weight_share`, checked by value once --
        what the step, the buffers and a folded round take."""
        return round_weights(self.weighting, sizes, self.max_weight_share)

    def step(self, results, weights: Optional[CheckedWeights]) -> ServerRoundStats:
        """The server step alone on the clients' ``results`` with the round's ``weights``
        (decoded compressed replies, :class:`~.compressed.DecodeAggregate`: aggregated by
        their fused decode-aggregate)."""
        if isinstance(results, DecodeAggregate):
            return self._server.round(results.replies, weights, aggregator=results)
        return self._server.round(results, weights)

    def buffers(self, rows: torch.Tensor, weights: Optional[CheckedWeights], current: torch.Tensor,
                excluded: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The new global floating buffers from the clients' ``rows`` (``[C, M]``), weighted
        with the round's ``weights`` -- those of :meth:`weights` that the step took,
        ``max_weight_share`` included -- without the clients the step ``excluded``
        (:func:`~.weighting.average_buffers`); None where the server keeps its own (FedLAW)."""
        if self._server.keeps_buffers:
            return None
        if weights is not None and not isinstance(weights, CheckedWeights):  # raw sizes would skip the rule
            raise TypeError(f"weights must be the round's weights (ServerRound.weights(sizes), None for uniform), "
                            f"got {type(weights).__name__}")
        return average_buffers(rows, weights, current, excluded)

    def _share(self, weights: Optional[CheckedWeights], share: Optional[slice]) -> Optional[CheckedWeights]:
        """The step's weights: the round's, or this process's rows of them when the step
        spreads over ranks (it normalises the union, which is the round's)."""
        if share is None or weights is None:
            return weights
        if not getattr(self._server, "weights_are_a_share", False):
            raise ValueError(f"replies with a share are for a server whose step spreads over ranks, not "
                             f"{type(self._server).__name__}")
        return CheckedWeights(weights.values[share])

    def _average_buffers(self, buffers, weights: Optional[CheckedWeights], excluded: Optional[torch.Tensor]) -> None:
        if buffers is None or self.model is None or self._server.keeps_buffers:
            return
        current = buffers_to_vector(self.model)
        if isinstance(buffers, BufferAverage):  # summed as the round's clients trained
            new = buffers.finish(current)
        else:
            new = self.buffers(buffers, weights, current.to(buffers.device), excluded)
        vector_to_buffers(new, self.model)


def _check_server(server) -> None:
    if getattr(server, "takes", None) not in ROUND_INPUTS or not callable(getattr(server, "round", None)):
        raise TypeError(f"server must be a fedopt_kernels.server algorithm (a ServerOptimizer or FedLAW), got "
                        f"{type(server).__name__}")
