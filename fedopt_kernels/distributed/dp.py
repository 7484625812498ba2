r"""``DistributedDPAggregator``: DP-FedAvg (fixed or adaptive clipping) over every rank's clients.

DP-FedAvg's aggregate (:mod:`fedopt_kernels.server.differential_privacy.dp`) is a SUM of per-client terms
plus one noise draw::

    D = (1 / m) (sum_i w_i s_i D_i + N(0, (z_Delta C)^2 I)),   s_i = min(1, C / (||D_i|| + 1e-6))

and each clip factor ``s_i`` is a function of client ``i``'s own norm and the round's
clip ``C`` (the same on every rank).  So nothing but the sum crosses ranks:

1. each rank computes its clients' norms (one pass of the fused aggregation kernel over
   its own rows: the ``||D_i||^2`` one process gets, row ``i``'s alone) and their clip
   factors -- clipping is local;
2. the clipped sum is taken over the ranks as :func:`~fedopt_kernels.distributed.all_aggregate`
   takes a weighted sum: ``mode="ordered"`` passes ONE running sum along the ranks
   (rank ``r`` continues the additions of the ranks before it with the same kernel),
   so the sum is bitwise the single-process sum; ``mode="all_reduce"`` adds per-rank
   partial sums in one ``all_reduce`` (within ``all_aggregate``'s stated bound,
   ``2 (C + W) u sum_i |w_i s_i D_i| / m`` elementwise, ``u = 2^-24`` for fp32);
3. the norms (``C`` values) travel with that step (an ``all_gather`` of ``C``, or in the
   ``all_reduce`` buffer), so every rank knows every ``||D_i||``, the exclusions and
   adaptive clipping's bits ``b_i = 1[||D_i|| <= C]``;
4. the noise is added ONCE, on the last rank (the one that finishes the sum), after
   the sum (:func:`~fedopt_kernels.ops.dp_noise.gaussian_noise_`: the counter-based
   noise of round ``t``'s key, :func:`~fedopt_kernels.server.differential_privacy.dp.dp_noise_key`, the very
   values the single-process kernel draws inside its pass), with adaptive clipping's
   count noise from round ``t``'s generator; the noised ``D`` is broadcast with the
   privatised count ``b_bar`` and the next clip, so every rank holds the same ``D`` and
   clip.

With ``mode="ordered"`` the aggregate, ``||D||^2``, the clip trajectory and the
statistics are bitwise those of :class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator` in one
process with all the clients, so the accountant (a function of the noise multiplier,
the sampling and the number of rounds, the same on every rank) records the same
epsilon.

Traffic per round (``W`` ranks, ``N`` values, ``C`` clients): ordered: ``W - 1`` sends
of ``N`` along the chain, one ``all_gather`` of ``C`` norms, broadcasts of ``N`` and 3 values;
all_reduce: one ``all_reduce`` of ``N + 2C``, broadcasts of ``N`` and 3 values (the noise must
come from one rank); both: the round's host-side exchange (counts, host weights).

The privacy mechanism is the single-process one: the guarantee is unchanged by where
the terms of the sum were added.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.aggregate import host_to_device, norm_bound_factors
from ..ops.validation import acc_dtype
from ..server.aggregation import RoundAggregate
from ..server.differential_privacy.dp import DPAggregator, refuse_client_statistics
from . import comm
from .aggregate import _AllReduce, _Ordered
from .aggregator import DistributedAggregator

__all__ = ["DistributedDPAggregator"]


class DistributedDPAggregator(DistributedAggregator):
    """The distributed form of ``mechanism`` (a :class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator`,
    whose state -- rounds, the clip, the last round's :class:`~fedopt_kernels.server.differential_privacy.dp.DPRound`
    -- it advances on every rank, so its ``record()`` and the accountant read the same
    everywhere): see the module docstring.  ``mode``: ``"ordered"`` (bitwise the
    single-process round) or ``"all_reduce"``; ``group``, ``on_bad_client`` and
    ``max_weight_share`` as :class:`~fedopt_kernels.distributed.DistributedAggregator`'s.
    Weights must be host numbers in ``[0, 1]`` (the mechanism checks the union's).
    """

    def __init__(self, mechanism: DPAggregator, group=None, *, mode: str = "ordered", on_bad_client: str = "exclude",
                 max_weight_share: Optional[float] = None):
        if not isinstance(mechanism, DPAggregator):
            raise TypeError(f"mechanism must be a DPAggregator, got {type(mechanism).__name__}")
        super().__init__(group, mode=mode, on_bad_client=on_bad_client, max_weight_share=max_weight_share)
        self.mechanism = mechanism

    def __repr__(self) -> str:
        return f"DistributedDPAggregator({self.mechanism!r}, mode={self.mode!r})"

    def _check_local(self, opt, rows, C_r: int, kind: str) -> None:
        refuse_client_statistics(opt)
        if kind == "device":
            raise ValueError("weights under differential privacy must be host numbers (a list or a CPU tensor): "
                             "their bound in [0, 1] is checked by value, which on a device would synchronise")

    def __call__(self, opt, updates, weights, out: torch.Tensor) -> RoundAggregate:
        """Collective: this rank's ``updates`` and ``weights``; ``out`` gets the noised
        DP-FedAvg aggregate of every rank's clients (the same on every rank)."""
        mech = self.mechanism
        rnd = self._gather_round(opt, updates, weights, out, "DP aggregation")
        plan, group, rows, run = rnd.plan, self.group, rnd.rows, rnd.run
        dtype, device, acc = opt.param_dtype, out.device, out.dtype
        C = plan.C
        w_all = mech.check_weights(rnd.weights, C)  # the union's bound, checked alike on every rank
        m = mech.expected_clients
        clip = mech.clip_on(device)
        clip_acc = clip.reshape(()).to(acc)
        base = (torch.ones(C, dtype=acc, device=device) if w_all is None
                else host_to_device(w_all.to(acc), device, "weights"))
        w_local = base[plan.start:plan.stop].contiguous()

        # 1. this rank's norms and clip factors (the clipping is local)
        if len(rows):
            q_local, _ = run(rows, w_local, 1.0 / m, torch.empty(plan.N, dtype=acc, device=device), None)
        else:
            q_local = torch.zeros(0, dtype=acc, device=device)
        ex_local = ~torch.isfinite(q_local)
        zero = torch.zeros((), dtype=acc, device=device)
        eff_local = torch.where(ex_local, zero, w_local * norm_bound_factors(q_local.to(acc), ex_local, clip_acc))

        # 2.-3. the clipped sum over the ranks, every client's norm on every rank
        last = plan.rank == plan.world - 1
        if self.mode == "ordered":
            chain = _Ordered(rows, plan, group, run, acc_dtype(dtype), dtype, device, 1.0 / m, out)
            chain.first_pass(eff_local)  # the last rank's target (out: acc dtype) holds (1/m) sum_i w_i s_i D_i
            q = comm.gather_rows(q_local.reshape(-1, 1), plan, group).reshape(-1)
        else:
            reduce = _AllReduce(rows, plan, group, run, acc, device, 1.0 / m)
            reduce.first_pass(eff_local)
            q = reduce.gathered[:, 0].contiguous()
            reduce.finish(out, None)
        excluded = ~torch.isfinite(q)
        factors = norm_bound_factors(q.to(acc), excluded, clip_acc)
        eff = torch.where(excluded, zero, base * factors)
        norms = torch.where(excluded, zero, q.to(acc)).sqrt()
        unclipped = ~excluded & (norms <= clip_acc)

        # 4. the noise, once, on the last rank; D, the count and the next clip broadcast from there
        small = torch.zeros(3, dtype=torch.float64, device=device)  # b_bar, next clip, ||D||^2
        if last:
            mech.add_update_noise_(out, clip, backend=opt.backend)
            b_bar, next_clip = mech.privatise_count(unclipped, clip, device)
            small[0] = b_bar if b_bar is not None else 0.0
            small[1] = next_clip
            small[2] = torch.dot(out, out).to(torch.float64)
        src = plan.world - 1
        comm.broadcast(out, src, group)
        comm.broadcast(small, src, group)
        b_bar = small[0] if mech.adaptive else None
        next_clip = small[1].to(clip.dtype)
        sq_norm = small[2].to(acc)
        return mech.close_round(clip, base, excluded=excluded, factors=factors, client_sq_norms=q,
                                weights=eff / m, sq_norm=sq_norm, b_bar=b_bar, next_clip=next_clip)
