r"""``all_aggregate``: :func:`fedopt_kernels.ops.aggregate` over the clients of every rank.

Each rank holds some clients (``[C_r, N]``, any ``C_r >= 0``); the result is the
aggregation of the UNION, in the global client order -- rank 0's clients, then rank
1's, ... (each rank's in its own order) -- with every statistic over all the clients,
the same on every rank.  Robustness is global: a NaN client on rank 1 is excluded and
the others are renormalised with the global weight total, exactly as one process would.

Two modes:

``"ordered"`` (default) -- bitwise identical to the single-process ``ops.aggregate`` of
    the union, for ANY number of ranks and any split.  Every backend computes, per
    element, ``t = 0; t = t + w_i x_i`` for ``i = 0 .. C-1`` in the acc dtype (python_ref's
    order), a sequence of roundings that cannot be regrouped.  So the ranks continue ONE
    running sum: rank ``r`` receives the running sum ``t`` of the clients before it,
    runs the SAME fused kernel on ``[t] + its rows`` with weights ``[1] + its weights``
    (``0 + 1 * t == t`` exactly, then the very additions one process makes) and sends
    the result on; the last rank applies ``gamma`` and broadcasts.  ``||X_i||^2`` is a
    function of row ``i`` alone and ``||sum||^2`` of the final sum alone, so the
    statistics match too.  The price: the ranks aggregate one after another (the
    aggregation takes as long as in one process; client training, the expensive part,
    still runs in parallel).

``"all_reduce"`` -- each rank aggregates its own clients with the fused kernel, then
    ONE ``all_reduce`` of a packed buffer ``[partial sum (N) | ||X_i||^2 (C) | w_i (C)]``
    combines the partial sums and the per-client statistics (every slot of the
    statistics is written by one rank, the others add exact zeros).  The per-client
    statistics, exclusions and weights are bitwise those of one process; the sum is
    regrouped (``C_r`` fp32 additions per rank, then the reduction's own order), so
    elementwise ``|out - out_1| <= gamma * 2 (C + W) u sum_i |w_i x_i|`` with ``u`` the
    unit roundoff of the acc dtype (``2^-24`` for fp32/fp16/bf16 data, ``2^-53`` for fp64)
    plus one rounding to ``out``'s dtype; ``||sum||^2`` follows from that sum.  It is
    deterministic for a fixed world size and collective algorithm (gloo; NCCL with a
    fixed ``NCCL_ALGO``/topology).

Collective traffic per call (``W`` ranks, ``N`` elements, acc words; ``C`` clients):

============  ==========================================================================
ordered       W-1 point-to-point sends of N (rank r -> r+1), one gather of 2 * max(C_r)
              per rank, one broadcast of N (+ 1) from the last rank; with
              ``nonfinite="exclude"`` or ``max_client_norm`` a second chain of W-1 sends
              when a weight changed (on CUDA always: the decision stays on the device
              and the disabled kernels leave the first chain's sums in place)
all_reduce    one all_reduce of N + 2C; a second all_reduce of N under the same
              condition as ``ordered``'s second chain
both          one host-side ``all_gather_object`` of a few integers per rank (counts,
              shapes, errors: see ``comm.exchange``)
============  ==========================================================================

No host sync on CUDA: counts and shapes travel on the host, every decision (exclusion,
renormalisation, whether a second pass writes) is a device tensor, as in ``ops.aggregate``.

Bad weights (``on_bad_client``): by default (``"raise"``, as ``ops.aggregate``) a
negative or non-finite host weight on one rank raises there and every other rank raises
:class:`~fedopt_kernels.distributed.RankInputError`.  ``"exclude"`` leaves such a client
out instead: its rank drops its row before anything is summed, the other ranks learn
which client and why in the host-side exchange that happens anyway, and the result is
the aggregation of the good clients alone (bitwise, in ``"ordered"`` mode), with
statistics of ALL the clients in the global order -- a left-out client is
``excluded``, has weight 0 and ``client_sq_norms`` NaN (not read) -- and
``stats.left_out`` lists ``(global index, "bad_weight", detail)``, the same on every
rank.  Device weights are not read (that would sync) and are not screened.  No usable
weight left on any rank: ``ValueError`` on every rank.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..ops import validation as V
from ..ops.aggregate import (NONFINITE, AggregateStats, ClientPieces, aggregate_runner, as_weight_tensor,
                             check_clients, check_gamma, check_weight_values, host_to_device, norm_bound_factors,
                             robust_weights)
from ..ops.validation import acc_dtype
from . import comm
from .comm import Plan

__all__ = ["all_aggregate", "MODES", "BAD_CLIENT_POLICIES", "AllAggregateStats"]

MODES = ("ordered", "all_reduce")
BAD_CLIENT_POLICIES = ("raise", "exclude")


class AllAggregateStats(AggregateStats):
    """:class:`~fedopt_kernels.ops.AggregateStats` of :func:`all_aggregate`, plus
    ``left_out``: ``(global index, reason, detail)`` of the clients left out for a bad
    weight (``on_bad_client="exclude"``), the same list on every rank."""

    left_out: Tuple[Tuple[int, str, str], ...] = ()


def screen_weights(values: Sequence) -> Tuple[list, List[Tuple[int, str]]]:
    """``(good, bad)`` of host client weights (a list of floats, or entries that did not
    convert to one): the finite numbers ``>= 0`` in order, and ``(index, detail)`` of
    the rest -- the clients ``on_bad_client="exclude"`` leaves out."""
    good, bad = [], []
    for i, v in enumerate(values):
        if isinstance(v, float) and math.isfinite(v) and v >= 0:
            good.append(v)
        else:
            bad.append((i, f"weight {v!r}"))
    return good, bad


def good_plan(plan: Plan, bad: Sequence[Sequence]) -> Plan:
    """``plan`` without the clients each rank left out (``bad[r]``: rank r's list)."""
    counts = tuple(c - len(b) for c, b in zip(plan.counts, bad))
    return Plan(rank=plan.rank, world=plan.world, counts=counts, N=plan.N, extras=plan.extras)


def left_out_list(plan: Plan, bad: Sequence[Sequence], reason: str = "bad_weight") -> List[Tuple[int, str, str]]:
    """``(global index, reason, detail)`` of every rank's left-out clients, in the global order."""
    out = []
    for r, entries in enumerate(bad):
        offset = sum(plan.counts[:r])
        out += [(offset + int(i), reason, f"{detail} (rank {r}, local client {int(i)})") for i, detail in entries]
    return out


def kept_index(plan: Plan, left_out) -> List[int]:
    """Global indices of the clients that were kept (ascending)."""
    gone = {i for i, _, _ in left_out}
    return [i for i in range(plan.C) if i not in gone]
Clients = Union[torch.Tensor, Sequence[torch.Tensor]]


def drop_clients(rows, gone) -> Union[list, ClientPieces]:
    """``rows`` (a list of client vectors or :class:`ClientPieces`) without the clients
    ``gone``; pieces stay pieces (no copy), or ``[]`` when none is left."""
    if isinstance(rows, ClientPieces):
        keep = [i for i in range(len(rows)) if i not in gone]
        return rows.select(keep) if keep else []
    return [row for i, row in enumerate(rows) if i not in gone]


def _local_clients(clients: Clients, out: Optional[torch.Tensor]):
    """``(rows, C_r, N, dtype, device)``; a rank may hold no client: a ``[0, N]`` tensor,
    or an empty list when ``out`` gives ``N``, the dtype and the device."""
    if isinstance(clients, torch.Tensor) and clients.dim() == 2 and clients.shape[0] == 0:
        V.check_tensor(clients, "local_clients", dims=2)
        return [], 0, clients.shape[1], clients.dtype, clients.device
    if isinstance(clients, (list, tuple)) and not clients:
        if out is None:
            raise ValueError("a rank without clients must pass a [0, N] tensor as local_clients (or give out=), so "
                             "that N, the dtype and the device are known")
        V.check_tensor(out, "out", dims=1)
        return [], 0, out.shape[0], out.dtype, out.device
    rows, C, N, dtype, device = check_clients(clients, "local_clients")
    return (list(rows.unbind(0)) if isinstance(rows, torch.Tensor) else rows), C, N, dtype, device


# Tests only: make CPU runs take the path CUDA takes (decisions read on the device).
_DEVICE_DECISIONS_ON_CPU = False


def _local_weights(weights, C: int, device, acc, exclude: bool = False):
    """``(weights on device in acc, positive, bad)``: any form ``ops.aggregate`` takes (a
    tensor, integer tensors and lists of numbers included); host weights are checked by
    value (finite, ``>= 0``) and ``positive`` says whether any is ``> 0`` ("not all zero"
    is a property of the union, checked after the exchange); device weights are not
    read (``positive`` None).  ``exclude``: a bad host weight does not raise but is
    listed in ``bad`` (``(local index, detail)``) and left out of the returned weights."""
    weights = as_weight_tensor(weights, C, "local_weights")
    if weights.device.type != "cpu":
        if weights.device != device:
            raise ValueError(f"local_weights is on {weights.device} but the clients are on {device}")
        return weights.detach().to(acc).contiguous(), None, []
    w = weights.detach().double()
    bad = screen_weights(w.tolist())[1] if exclude else []
    if bad:
        keep = sorted(set(range(C)) - {i for i, _ in bad})
        weights, w = weights[keep], w[keep]
    check_weight_values(w, "local_weights", allow_all_zero=True)  # what is left passes the screen
    return host_to_device(weights.detach().to(acc).contiguous(), device, "local_weights"), bool((w > 0).any()), bad


def _check_out(out, N, dtype, acc, device):
    if out is None:
        return torch.empty(N, dtype=dtype, device=device)
    V.check_tensor(out, "out", dims=1)
    if out.shape[0] != N or out.device != device or out.dtype not in (dtype, acc) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{N}] tensor on {device} with dtype {dtype} or {acc}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def all_aggregate(
    local_clients: Clients,
    local_weights: torch.Tensor,
    *,
    gamma=1.0,
    group=None,
    out: Optional[torch.Tensor] = None,
    nonfinite: str = "exclude",
    max_client_norm: Optional[float] = None,
    backend: Optional[str] = None,
    mode: str = "ordered",
    on_bad_client: str = "raise",
):
    r"""Collective: :func:`fedopt_kernels.ops.aggregate` over the union of every rank's
    clients.  Call it on every rank of ``group`` (None: the default group).

    ``local_clients`` is this rank's ``[C_r, N]`` tensor or list of ``C_r`` vectors
    (``C_r`` may differ between ranks and be 0: pass a ``[0, N]`` tensor), and
    ``local_weights`` their ``[C_r]`` weights; ``gamma``, ``out``, ``nonfinite``,
    ``max_client_norm`` and ``backend`` mean what they mean for ``ops.aggregate``.

    Returns ``(out, AggregateStats)`` on EVERY rank: ``out = gamma * sum_i w_i X_i`` over
    all clients and statistics of all ``C = sum_r C_r`` clients in the global order
    (rank 0's clients first).  ``mode="ordered"`` (default) is bitwise identical to one
    process calling ``ops.aggregate`` on the union; ``"all_reduce"`` does one collective
    and is exact except for the regrouped sum (see the module docstring for both, the
    tolerance and the traffic).

    Every rank validates its inputs before any collective on the data; if one rank's
    inputs are wrong, that rank raises its error and every other rank raises
    :class:`RankInputError` (nobody hangs).  ``on_bad_client="exclude"`` instead
    leaves a client with a negative or non-finite (host) weight out on every rank and
    lists it in ``stats.left_out`` (see the module docstring).
    """
    error = None
    rows, C_r, N, dtype, device, acc, positive, bad = [], 0, None, None, None, None, None, []
    try:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if on_bad_client not in BAD_CLIENT_POLICIES:
            raise ValueError(f"on_bad_client must be one of {BAD_CLIENT_POLICIES}, got {on_bad_client!r}")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        if max_client_norm is not None:
            max_client_norm = V.check_real(max_client_norm, "max_client_norm", low=0.0, low_open=True)
        rows, C_r, N, dtype, device = _local_clients(local_clients, out)
        acc = acc_dtype(dtype)
        w_local, positive, bad = _local_weights(local_weights, C_r, device, acc, on_bad_client == "exclude")
        if bad:
            rows = drop_clients(rows, {i for i, _ in bad})
        gamma = check_gamma(gamma, device, acc)
        out = _check_out(out, N, dtype, acc, device)
        run = aggregate_runner(backend, device)  # raises here if the backend cannot run
    except Exception as exc:  # noqa: BLE001 - shared with the group, then re-raised
        error = exc
    # Host weights: whether any is positive ("not all zero" holds for the union, or fails
    # on every rank before any data moves); device weights are not read (no sync).
    if error is not None:
        positive, bad = None, []
    plan = comm.exchange(group, what="all_aggregate", count=C_r, N=N, dtype=dtype,
                         device_type=None if device is None else device.type, error=error,
                         extra=(positive, bad))
    bad_all = [b for _, b in plan.extras]
    left_out = left_out_list(plan, bad_all)
    if left_out and len(left_out) == plan.C:
        raise ValueError(f"all_aggregate: no client of any rank has a usable weight ({len(left_out)} left out: "
                         + "; ".join(f"client {i}: {d}" for i, _, d in left_out) + ")")
    if positive is not None and not any(p for p, _ in plan.extras):
        raise ValueError("all_aggregate: the weights of the clients of all ranks must not all be zero"
                         + (f" (after leaving out {len(left_out)} with a bad weight)" if left_out else ""))
    if not left_out:
        out, st, _ = _aggregate_planned(rows, w_local, gamma, out, plan, group, run=run, nonfinite=nonfinite,
                                     max_client_norm=max_client_norm, mode=mode, dtype=dtype, device=device)
        return out, AllAggregateStats(*st)
    # the good clients alone, in the global order; the statistics then name every client
    out, st, _ = _aggregate_planned(rows, w_local, gamma, out, good_plan(plan, bad_all), group, run=run,
                                 nonfinite=nonfinite, max_client_norm=max_client_norm, mode=mode, dtype=dtype,
                                 device=device)
    full = expand_stats(st, plan.C, kept_index(plan, left_out))
    result = AllAggregateStats(*full)
    result.left_out = tuple(left_out)
    return out, result


def expand_rows(C: int, kept: List[int], sq_norms: torch.Tensor, excluded: torch.Tensor, weights: torch.Tensor):
    """Per-client statistics of the ``kept`` clients as ``[C]`` tensors of all the
    clients (the others: ``sq_norms`` NaN -- their rows were not read --, excluded,
    weight 0)."""
    device = weights.device
    index = torch.tensor(kept, dtype=torch.int64).to(device, non_blocking=True)
    q = torch.full((C,), float("nan"), dtype=sq_norms.dtype, device=device).index_copy_(0, index, sq_norms)
    ex = torch.ones(C, dtype=torch.bool, device=device).index_copy_(0, index, excluded)
    w = torch.zeros(C, dtype=weights.dtype, device=device).index_copy_(0, index, weights)
    return q, ex, w


def expand_stats(st: AggregateStats, C: int, kept: List[int]) -> AggregateStats:
    """``st`` of the kept clients as statistics of all ``C`` (:func:`expand_rows`)."""
    q, excluded, weights = expand_rows(C, kept, st.client_sq_norms, st.excluded, st.weights)
    return AggregateStats(q, st.sq_norm, excluded, weights, st.all_excluded)


def _aggregate_planned(rows, w_local, gamma, out, plan: Plan, group, *, run, nonfinite, max_client_norm, mode,
                       dtype, device):
    """The aggregation once every rank has agreed on ``plan`` (inputs already checked):
    ``(out, AggregateStats, bound)``, ``bound`` the ``[C]`` norm-bound factors it applied
    (None without ``max_client_norm``), as :func:`~fedopt_kernels.ops.aggregate.aggregate_bounded`
    returns them, for the round's description to read instead of computing them again."""
    acc = acc_dtype(dtype)
    robust = nonfinite == "exclude" or max_client_norm is not None
    # Reading a CPU flag is free; on CUDA it would sync, so there the second pass always
    # runs and decides on the device.  The tests take the device path on the CPU too.
    host_decides = device.type == "cpu" and not _DEVICE_DECISIONS_ON_CPU
    if mode == "ordered":
        result = _Ordered(rows, plan, group, run, acc, dtype, device, gamma, out)
    else:
        result = _AllReduce(rows, plan, group, run, acc, device, gamma)

    q_local = result.first_pass(w_local)
    # [C, 2]: (||X_i||^2, w_i) of every client, in the global order
    qw = comm.gather_rows(torch.stack([q_local, w_local], dim=1), plan, group) if mode == "ordered" \
        else result.gathered
    q, w = qw[:, 0].contiguous(), qw[:, 1].contiguous()
    bound = None
    if robust:
        eff, excluded = robust_weights(w, q, nonfinite == "exclude", None)
        if max_client_norm is not None:  # the factors, once (aggregate_bounded's split: the same bits)
            bound = norm_bound_factors(q, excluded, max_client_norm)
            eff = eff * bound
        redo = (eff != w).any()
        if not host_decides or bool(redo):
            result.second_pass(eff[plan.start:plan.stop].contiguous(), None if host_decides else ~redo)
        else:
            redo = None
    else:
        eff, excluded, redo = w, torch.zeros(plan.C, dtype=torch.bool, device=device), None
    Q = result.finish(out, redo)
    return out, AggregateStats(q, Q, excluded, eff, excluded.all()), bound


class _Ordered:
    """The running sum passed along the ranks (see the module docstring)."""

    def __init__(self, rows, plan: Plan, group, run, acc, dtype, device, gamma, out):
        self.plan, self.group, self.run, self.acc, self.device = plan, group, run, acc, device
        # The running sum enters the kernel as a client, so it must share the rows'
        # dtype: fp16/bf16 rows are widened (exactly) for the chain; their ||X_i||^2
        # still comes from the rows as given (the kernels' tiles depend on the dtype).
        self.half = dtype != acc
        if isinstance(rows, ClientPieces) and (self.half or rows.subtract_from is not None):
            rows = list(rows)  # widened, or the sum would be subtracted too: rows of their own
        self.rows = rows
        self.chain_rows = [r.to(acc) for r in rows] if self.half else rows
        N = plan.N
        self.first = plan.rank == 0
        self.last = plan.rank == plan.world - 1
        self.prev = None if self.first else torch.empty(N, dtype=acc, device=device)
        if self.last:
            # The last kernel writes gamma * sum, as the single-process kernel does; into
            # an acc buffer when out is fp16/bf16 (rounded by finish(), also to nearest).
            self.target = out if out.dtype == acc else torch.empty(N, dtype=acc, device=device)
            self.gamma = gamma
        else:
            self.target = torch.empty(N, dtype=acc, device=device)
            self.gamma = 1.0
        self.one = torch.ones(1, dtype=acc, device=device)
        self.Q = [None, None]

    def _pass(self, weights, skip, index: int):
        plan, group = self.plan, self.group
        if not self.first:
            comm.recv(self.prev, plan.rank - 1, group)
            chain = self.chain_rows
            rows = chain.prepend(self.prev) if isinstance(chain, ClientPieces) else [self.prev] + chain
            w = torch.cat([self.one, weights])
        else:
            rows, w = self.chain_rows, weights
        q = None
        if rows:
            q, self.Q[index] = self.run(rows, w, self.gamma, self.target, skip)
            if not self.first:
                q = q[1:]
        elif index == 0:  # rank 0 without clients: the running sum starts at +0
            self.target.zero_()
        if not self.last:
            comm.send(self.target, plan.rank + 1, group)
        return q

    def first_pass(self, w_local):
        q = self._pass(w_local, None, 0)
        if self.half and self.rows:
            scratch = torch.empty(self.plan.N, dtype=self.acc, device=self.device)
            q, _ = self.run(self.rows, torch.zeros_like(w_local), 1.0, scratch, None)
        if q is None:
            q = torch.zeros(0, dtype=self.acc, device=self.device)
        return q

    def second_pass(self, eff_local, skip):
        self._pass(eff_local, skip, 1)

    def finish(self, out, redo):
        src = self.plan.world - 1
        Q = torch.empty(1, dtype=self.acc, device=self.device)
        if self.last:
            Q.copy_(self.Q[0] if redo is None else torch.where(redo, self.Q[1], self.Q[0]))
            if self.target is not out:
                out.copy_(self.target)
        comm.broadcast(out, src, self.group)
        comm.broadcast(Q, src, self.group)
        return Q.reshape(())


class _AllReduce:
    """Partial sums per rank, one packed all_reduce (see the module docstring)."""

    def __init__(self, rows, plan: Plan, group, run, acc, device, gamma):
        self.rows, self.plan, self.group, self.run, self.acc, self.device = rows, plan, group, run, acc, device
        self.gamma = gamma
        N, C = plan.N, plan.C
        self.buf = torch.empty(N + 2 * C, dtype=acc, device=device)
        self.partial = self.buf[:N]

    def _local_sum(self, weights, target, skip):
        if self.rows:
            q, _ = self.run(self.rows, weights, 1.0, target, skip)
            return q
        if skip is None:
            target.zero_()
        return torch.zeros(0, dtype=self.acc, device=self.device)

    def first_pass(self, w_local):
        plan, N, C = self.plan, self.plan.N, self.plan.C
        q = self._local_sum(w_local, self.partial, None)
        stats = self.buf[N:]
        stats.zero_()
        stats[plan.start:plan.stop] = q
        stats[C + plan.start:C + plan.stop] = w_local
        comm.all_reduce(self.buf, self.group)  # partial sums + every rank's slots (x + 0 == x exactly)
        self.gathered = torch.stack([self.buf[N:N + C], self.buf[N + C:]], dim=1)
        return q

    def second_pass(self, eff_local, skip):
        if skip is None:
            self._local_sum(eff_local, self.partial, None)
            comm.all_reduce(self.partial, self.group)
            return
        tmp = torch.zeros_like(self.partial) if not self.rows else torch.empty_like(self.partial)
        self._local_sum(eff_local, tmp, skip)
        comm.all_reduce(tmp, self.group)
        torch.where(skip, self.partial, tmp, out=self.partial)

    def finish(self, out, redo):
        gamma = self.gamma
        total = self.partial
        scaled = out if out.dtype == self.acc else torch.empty_like(total)
        one = torch.ones(1, dtype=self.acc, device=self.device)
        _, Q = self.run([total], one, gamma, scaled, None)  # gamma * total and ||total||^2, every rank alike
        if scaled is not out:
            out.copy_(scaled)
        return Q
