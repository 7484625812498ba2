r"""``DistributedRobustAggregator``: a Byzantine-robust rule over every rank's clients.

The robust rules (:mod:`fedopt_kernels.server.robust_aggregation.robust`) are not sums: the coordinate-wise
median and trimmed mean need all ``C`` values of a coordinate, Krum, Multi-Krum and
Bulyan the distances between every pair of clients (the ``[C, C]`` Gram matrix), the
geometric median and centered clipping the distances of every client to an iterate.
So, unlike the weighted mean (one running sum passed along the ranks), a rule needs
the clients' rows in one place.  The design here:

1. **gather to the root** -- rank ``r`` sends its ``[C_r, N]`` rows to rank 0
   (point-to-point, received straight into rank 0's ``[C, N]`` buffer, no padding);
2. rank 0 runs the single-process :class:`~fedopt_kernels.server.robust_aggregation.robust_aggregator.RobustAggregator`
   on the union, in the global client order (rank 0's clients first) -- the very call
   one process makes, so the aggregate and every statistic are bitwise its;
3. **broadcast the result** -- the aggregate ``D`` (``N`` values) and one small packed
   buffer of the round's statistics (``5C + 5`` float64: norms, exclusions, weights,
   selection; exact, every value is an fp32/fp64 number or a flag) from rank 0; every
   rank then hands its optimizer the same :class:`~fedopt_kernels.server.aggregation.RoundAggregate`
   and keeps the same rule state (centered clipping's reference point, the selection
   :meth:`~fedopt_kernels.server.robust_aggregation.robust_aggregator.RobustAggregator.record` reports).

Traffic per round: ``(C - C_0) N`` into rank 0 and ``(W - 1) (N + 5C + 5)`` out of it,
plus the round's host-side exchange (counts, host weights, errors) and one status word
(did rank 0's rule run?).  That is the least a rule that needs every row in one place
can move: an ``all_gather`` of the rows would send ``(W - 1) C N``, ``W - 1`` times
more.  The alternative that spreads the work is to shard the COLUMNS: an
``all_to_all`` gives rank ``r`` every client's slice ``N_r`` of the coordinates
(``C N (W - 1) / W`` in all, about what the gather moves); the coordinate-wise rules
then run on ``[C, N_r]`` slices and an ``all_gather`` of ``N`` assembles the result,
and Krum's Gram matrix becomes an ``all_reduce`` of ``[C, C]`` partial Grams.  It
splits the rule's work ``W`` ways, but the Gram's float64 block sums would be added in
another order than one process adds them (so Krum's ties could break differently)
and a rank holds ``C N / W`` instead of rank 0 holding ``C N``; it is the next step
when the rule, not the client training, bounds a round.

Rank 0 holds the ``[C, N]`` rows one process would hold; the buffer is kept from round
to round (first-touch page faults of a fresh one cost more than the copy).

Errors: every rank checks what it can before the exchange (its updates and weights,
the optimizer -- FedExP and ASNES are refused as in one process); a rule's parameter
that fails only against the round's ``C`` (Krum's ``C > 2f + 2``) raises on rank 0,
which says so in the status word before any data moves back, and every other rank
raises :class:`~fedopt_kernels.distributed.RankInputError`: nobody waits forever.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops import ClientPieces
from ..ops.aggregate import AggregateStats
from ..server.aggregation import RoundAggregate
from ..server.robust_aggregation.robust import RobustResult
from ..server.robust_aggregation.robust_aggregator import RobustAggregator, refuse_robust_statistics
from . import comm
from .aggregator import DistributedAggregator
from .comm import RankInputError

__all__ = ["DistributedRobustAggregator"]

ROOT = 0  # the rank that gathers the rows and runs the rule


class DistributedRobustAggregator(DistributedAggregator):
    """The distributed form of ``rule`` (a
    :class:`~fedopt_kernels.server.robust_aggregation.robust_aggregator.RobustAggregator`,
    whose state -- rounds, centered clipping's reference, the last selection -- it keeps
    up to date on every rank): see the module docstring.  ``group``, ``on_bad_client``
    and ``max_weight_share`` as :class:`~fedopt_kernels.distributed.DistributedAggregator`'s.
    The result does not depend on a ``mode``: it is the single-process rule's, bitwise.
    """

    def __init__(self, rule: RobustAggregator, group=None, *, on_bad_client: str = "exclude",
                 max_weight_share: Optional[float] = None):
        if not isinstance(rule, RobustAggregator):
            raise TypeError(f"rule must be a RobustAggregator, got {type(rule).__name__}")
        if rule.rule == "mean":
            raise ValueError("the rule 'mean' is the weighted mean: use DistributedAggregator (one running sum "
                             "along the ranks, no gather)")
        super().__init__(group, on_bad_client=on_bad_client, max_weight_share=max_weight_share)
        self.rule = rule

    def __repr__(self) -> str:
        return f"DistributedRobustAggregator({self.rule!r})"

    def _check_local(self, opt, rows, C_r: int, kind: str) -> None:
        refuse_robust_statistics(opt, self.rule.rule)

    def __call__(self, opt, updates, weights, out: torch.Tensor) -> RoundAggregate:
        """Collective: this rank's ``updates`` and ``weights``; ``out`` gets the rule's
        aggregate of every rank's clients (the same on every rank)."""
        rnd = self._gather_round(opt, updates, weights, out, f"robust aggregation ({self.rule.rule})")
        plan, group = rnd.plan, self.group
        device, acc, C = out.device, out.dtype, plan.C
        root = plan.rank == ROOT
        error = None
        if root:
            rows = self.rule.kept_rows(C, plan.N, opt.param_dtype, device)  # the rule's buffer, kept between rounds
            for i in range(plan.counts[ROOT]):
                _copy_row(rnd.rows, i, rows[i])
            offset = plan.counts[ROOT]
            for r in range(plan.world):
                if r != ROOT and plan.counts[r]:
                    comm.recv(rows[offset:offset + plan.counts[r]], r, group)
                    offset += plan.counts[r]
            try:
                agg = self.rule(opt, rows, rnd.weights, out)
            except Exception as exc:  # noqa: BLE001 - said to every rank, then re-raised
                error = exc
        elif rnd.rows:
            local = rnd.rows.stack() if isinstance(rnd.rows, ClientPieces) else torch.stack(list(rnd.rows))
            comm.send(local, ROOT, group)
        # one status word from rank 0 (host side, gloo): did the rule run, and the dtype of
        # its own client weights where its result is a weighted sum of the clients (else None)
        rule_w = self.rule.last.weights if root and error is None else None
        status = comm.broadcast_object((None if error is None else f"{type(error).__name__}: {error}",
                                        None if rule_w is None else str(rule_w.dtype).replace("torch.", "")),
                                       ROOT, group)
        if status[0] is not None:
            if error is not None:
                raise error
            raise RankInputError(f"robust aggregation ({self.rule.rule}): rank {ROOT} could not run the rule "
                                 f"({status[0]}); every rank stops")
        packed = torch.empty(_packed_size(C), dtype=torch.float64, device=device)
        if root:
            packed.copy_(_pack(agg, self.rule.last))
        comm.broadcast(out, ROOT, group)
        comm.broadcast(packed, ROOT, group)
        if root:
            return agg
        rule_dtype = None if status[1] is None else getattr(torch, status[1])
        agg, last = _unpack(packed, C, acc, self.rule.rule, out, rule_dtype=rule_dtype)
        self.rule.finish_round(last, agg.skip, out)  # the state rank 0's rule is left in
        return agg


def _copy_row(rows, i: int, dst: torch.Tensor) -> None:
    if isinstance(rows, ClientPieces):
        rows.row(i, out=dst)
    else:
        dst.copy_(rows[i])


def _packed_size(C: int) -> int:
    return 6 * C + 5


def _pack(agg: RoundAggregate, last: RobustResult) -> torch.Tensor:
    """``[client_sq_norms | excluded | weights | p | selected | rule weights (0 when the
    rule has none) | sq_norm, skip, all_excluded, bound_met, iterations]`` in float64:
    exact (fp32/fp64 values, flags and a small count)."""
    st = agg.stats
    f = torch.float64
    rule_w = last.weights if last.weights is not None else torch.zeros_like(st.weights)
    tail = torch.stack([st.sq_norm.to(f).reshape(()), agg.skip.to(f).reshape(()), st.all_excluded.to(f).reshape(()),
                        last.bound_met.to(f).reshape(()), last.iterations.to(f).reshape(())])
    return torch.cat([st.client_sq_norms.to(f), st.excluded.to(f), st.weights.to(f), agg.p.to(f),
                      last.selected.to(f), rule_w.to(f), tail])


def _unpack(packed: torch.Tensor, C: int, acc, rule: str, out: torch.Tensor, *, rule_dtype):
    """:func:`_pack`'s buffer back as the :class:`RoundAggregate` and the
    :class:`RobustResult` rank 0 got (the aggregate is ``out``)."""
    q, ex, w, p, sel, rw = (packed[k * C:(k + 1) * C] for k in range(6))
    sq_norm, skip, all_ex, bound_met, iterations = packed[6 * C:].unbind(0)
    excluded, all_excluded = ex.bool(), all_ex.bool()
    stats = AggregateStats(client_sq_norms=q.to(acc), sq_norm=sq_norm.to(acc), excluded=excluded, weights=w.to(acc),
                           all_excluded=all_excluded)
    agg = RoundAggregate(stats=stats, p=p.to(acc), bound=None, skip=skip.bool())
    rule_w = rw.to(rule_dtype) if rule_dtype is not None else None
    last = RobustResult(rule, out, sel.bool(), excluded, rule_w, bound_met.bool(), iterations.to(torch.long),
                        all_excluded)
    return agg, last
