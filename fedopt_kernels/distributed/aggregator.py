"""``DistributedAggregator``: a server optimizer's aggregation over every rank's clients."""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import torch

from ..ops import ClientPieces
from ..ops.aggregate import aggregate_runner, check_weight_values
from ..server.aggregation import (CheckedWeights, RoundAggregate, check_weight_tensor, normalize_weights,
                                  weight_numbers)
from ..server.weighting import cap_weight_shares, check_max_weight_share
from . import comm
from .comm import Plan
from .aggregate import (BAD_CLIENT_POLICIES, MODES, _aggregate_planned, drop_clients, good_plan, kept_index,
                        left_out_list, screen_weights)

__all__ = ["DistributedAggregator"]


class DistributedAggregator:
    """The :class:`~fedopt_kernels.server.aggregation.Aggregator` of a server optimizer
    whose parameters are EVERY rank's copy of the global model: ``step(local_updates,
    local_weights)`` -- called on every rank of ``group`` with that rank's clients (a
    ``[C_r, N]`` tensor or ``C_r`` flat vectors, ``C_r >= 0``, and their ``C_r`` weights
    or None) -- averages the union of all ranks' clients (rank 0's first), with the
    weights normalised over all ranks (:func:`~fedopt_kernels.server.aggregation.normalize_weights`
    on the union) and every statistic, exclusion and skip decision global
    (:func:`~fedopt_kernels.distributed.all_aggregate`'s exchange and passes): the same
    ``D`` and :class:`~fedopt_kernels.server.aggregation.RoundAggregate` on every rank,
    bitwise those of one process with all the clients in ``mode="ordered"``.

    Use it as ``FedAdam(params, aggregator=DistributedAggregator(group))``, or through
    :class:`~fedopt_kernels.distributed.DistributedServerOptimizer`, which also restores
    the statistics of clients left out for a bad weight.  ``mode``, ``on_bad_client``
    and ``max_weight_share``: see there.  After each round, :attr:`last_left_out` lists
    ``(global index, "bad_weight", detail)`` of the clients left out (the same on every
    rank) and :attr:`last_kept` is None, or ``(C, global indices of the clients kept)``
    when some were left out (the round's statistics then name the kept clients only).
    """

    def __init__(self, group=None, *, mode: str = "ordered", on_bad_client: str = "exclude",
                 max_weight_share: Optional[float] = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if on_bad_client not in BAD_CLIENT_POLICIES:
            raise ValueError(f"on_bad_client must be one of {BAD_CLIENT_POLICIES}, got {on_bad_client!r}")
        self.group = group
        self.mode = mode
        self.on_bad_client = on_bad_client
        self.max_weight_share = check_max_weight_share(max_weight_share)
        self.last_left_out: Tuple[Tuple[int, str, str], ...] = ()
        self.last_kept: Optional[Tuple[int, List[int]]] = None

    def __repr__(self) -> str:
        return f"DistributedAggregator(mode={self.mode!r}, on_bad_client={self.on_bad_client!r})"

    def __call__(self, opt, updates, weights, out: torch.Tensor) -> RoundAggregate:
        """Collective: this rank's ``updates`` and ``weights`` into the global mean ``out``."""
        rnd = self._gather_round(opt, updates, weights, out, "DistributedAggregator (a server step)")
        C, plan = rnd.plan.C, rnd.plan
        # The single-process normalisation, on the union: same p, same validity flag.
        p, valid = normalize_weights(rnd.weights, C, out.device, out.dtype)
        _, st, factors = _aggregate_planned(rnd.rows, p[plan.start:plan.stop].contiguous(), 1.0, out, plan,
                                            self.group, run=rnd.run, nonfinite=opt.nonfinite,
                                            max_client_norm=opt.max_client_norm, mode=self.mode,
                                            dtype=opt.param_dtype, device=out.device)
        return RoundAggregate.of(p, st, valid, opt.max_client_norm, factors)

    # ------------------------------------------------------------------ shared by every distributed rule
    def _check_local(self, opt, rows, C_r: int, kind: str) -> None:
        """This rank's checks that a subclass adds before the exchange (they raise; the
        exchange then stops every rank)."""

    def _gather_round(self, opt, updates, weights, out: torch.Tensor, what: str) -> "GatheredRound":
        """Check this rank's inputs, run the one host-side exchange of the round (counts,
        weights, errors: :func:`comm.exchange`) and return what every rule needs: this
        rank's rows (without the clients left out for a bad weight), the plan of the
        clients kept, the union's weights (None: uniform; a float64 CPU tensor of host
        weights, capped by :attr:`max_weight_share` -- wrapped in
        :class:`~fedopt_kernels.server.aggregation.CheckedWeights` when every rank passed
        its share of the round's checked weights, so it is not checked again; or the
        gathered device weights) and
        the aggregation kernel's runner.  Sets :attr:`last_left_out` / :attr:`last_kept`.
        Raises on every rank if any rank's inputs are wrong."""
        self.last_left_out, self.last_kept = (), None
        dtype, device = opt.param_dtype, out.device
        N = out.numel()
        error, rows, C_r, kind, values, wdtype, bad, run, checked = None, [], 0, None, None, None, [], None, False
        try:
            rows, C_r = opt.check_updates(updates, allow_empty=True)
            if isinstance(rows, torch.Tensor):
                rows = list(rows.unbind(0))
            elif not isinstance(rows, ClientPieces):  # named updates stay pieces: read in place
                rows = list(rows)
            kind, values, wdtype, bad = _weights_to_exchange(weights, C_r, device, self.on_bad_client == "exclude")
            checked = isinstance(weights, CheckedWeights)
            self._check_local(opt, rows, C_r, kind)
            if bad:  # left out here, before anything is summed
                rows = drop_clients(rows, {i for i, _ in bad})
            run = aggregate_runner(opt.backend, device)  # raises now, before any collective, if it cannot run
        except Exception as exc:  # noqa: BLE001 - shared with the group, then re-raised
            error, bad = exc, []
        plan = comm.exchange(self.group, what=what, count=C_r, N=N, dtype=dtype,
                             device_type=device.type, error=error,
                             extra={"kind": kind, "values": values, "dtype": wdtype, "bad": bad, "checked": checked})
        kinds = [(e["kind"], e["dtype"]) for e in plan.extras]
        if any(k != kinds[0] for k in kinds):
            raise ValueError("distributed server step: the ranks pass different kinds of weights (all None, "
                             "all host numbers, or all device tensors of one dtype): " + ", ".join(
                                 f"rank {r}: {k}" for r, k in enumerate(kinds)))
        if self.max_weight_share is not None and kind == "device":
            raise ValueError("max_weight_share needs host weights (numbers or a CPU "
                             "tensor): capping device weights would read them on the host")
        bad_all = [e["bad"] for e in plan.extras]
        left_out = left_out_list(plan, bad_all)
        if left_out:
            if len(left_out) == plan.C:
                raise ValueError(f"distributed server step: no client of any rank has a usable weight "
                                 f"({len(left_out)} left out: " + "; ".join(
                                     f"client {i}: {d}" for i, _, d in left_out) + ")")
            self.last_left_out = tuple(left_out)
            self.last_kept = (plan.C, kept_index(plan, left_out))
            plan = good_plan(plan, bad_all)  # the step over the good clients alone, in the global order
        if kind == "uniform":
            global_w = None
        elif kind == "host":
            global_w = torch.tensor([v for e in plan.extras for v in e["values"]], dtype=torch.float64)
        else:
            global_w = comm.gather_rows(values.reshape(-1, 1), plan, self.group).reshape(-1)
        # Every rank's share checked where the round's weights entered (CheckedWeights): the union
        # is trusted as they are, only "not all zero" -- the union's own property -- is left to see.
        trusted = kind == "host" and all(e["checked"] for e in plan.extras)
        if trusted:
            if global_w.numel() and not bool((global_w > 0).any()):
                raise ValueError("weights must not all be zero (over every rank's clients)")
        elif self.max_weight_share is not None and global_w is not None:
            check_weight_values(global_w, "weights")  # on_bad_client="raise": a bad weight raises here
        if self.max_weight_share is not None and global_w is not None:
            global_w = cap_weight_shares(global_w, self.max_weight_share)  # shares of the union
        if trusted:
            global_w = CheckedWeights(global_w)  # normalised by the rule without a second check
        return GatheredRound(rows=rows, plan=plan, weights=global_w, run=run)


class GatheredRound(NamedTuple):
    """What :meth:`DistributedAggregator._gather_round` hands a distributed rule."""

    rows: Union[list, ClientPieces]  # this rank's kept clients
    plan: Plan  # every rank's kept clients (global order: rank order)
    weights: Union[None, torch.Tensor, CheckedWeights]  # the union's weights (None: uniform)
    run: Callable  # the fused aggregation kernel of the optimizer's backend


def _screen(values: List, exclude: bool):
    """``(values, bad)``: with ``exclude``, the entries that are not a finite number
    ``>= 0`` move from ``values`` to ``bad`` (``(index, detail)``, :func:`.aggregate.screen_weights`)."""
    return screen_weights(values) if exclude else (values, [])


def _weights_to_exchange(weights, C: int, device: torch.device, exclude: bool = False):
    """What this rank's ``weights`` contribute to the ranks' host-side exchange (the
    union is then normalised once, by :func:`normalize_weights`; ``all_aggregate``'s
    ``_local_weights`` instead keeps a rank's weights as given, a weighted SUM being its
    contract).  ``(kind, values, dtype, bad)``: ``("uniform", None, None, [])``, ``("host",
    [floats], None, bad)`` (numbers or a CPU tensor: exact as float64; ``exclude``: the
    entries that are not a finite number ``>= 0`` are left out of ``values`` and listed in
    ``bad`` as ``(local index, detail)``) or ``("device", tensor, dtype, [])``."""
    if weights is None:
        return "uniform", None, None, []
    if isinstance(weights, CheckedWeights):  # checked where the round's weights entered
        if len(weights) != C:
            raise ValueError(f"weights has {len(weights)} entries but this rank has {C} clients")
        return "host", weights.values.tolist(), None, []
    rank = "this rank has {C} clients"
    if isinstance(weights, torch.Tensor):
        check_weight_tensor(weights, C, device, clients=rank)
        if weights.device.type == "cpu":
            values, bad = _screen(weights.detach().to(torch.float64).tolist(), exclude)
            return "host", values, None, bad
        return "device", weights.detach(), str(weights.dtype), []
    # one client's entry that is not a number is that client's problem (exclude)
    values = weight_numbers(weights, C, clients=rank, lenient=exclude)
    values, bad = _screen(values, exclude)
    return "host", values, None, bad
