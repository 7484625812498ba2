"""Aggregation that happened under secure aggregation: the server holds only the sum.

Under secure aggregation (Flower's SecAgg+, Bonawitz et al. CCS 2017 / Bell et al. CCS
2020) each client masks its update, and the masks cancel only in the sum: the server
learns ``sum_i w_i D_i`` and ``sum_i w_i`` (so the weighted mean ``D``), never one
``D_i``.  :class:`SecureSumAggregator` hands such a mean to a server optimizer's step
(:meth:`~fedopt_kernels.server.ServerOptimizer.step` with ``updates=None``), so the
fused server step (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad) runs on it unchanged.

What the server step can still know, and what it cannot:

* ``||D||^2`` -- from the mean itself;
* ``sum_i p_i ||D_i||^2`` -- only if the clients send it through the same secure sum
  (each client adds its own ``||D_i||^2`` as one more masked value: the sum then holds
  the weighted mean of the squared norms, and no single norm).  FedExP's step size and
  ASNES's gain ratio need exactly this and nothing else; without it they are refused;
* each client's norm, which client sent NaN/Inf, each client's norm bound -- never.  A
  non-finite mean skips the whole round (nobody can tell whose update it was), and
  per-client screening (``nonfinite="exclude"``, ``max_client_norm``), robust
  aggregators and FedLAW cannot run: the Flower strategy refuses them before a run.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops.aggregate import AggregateStats
from .aggregation import AggregatingOptimizer, RoundAggregate, normalize_weights

__all__ = ["SecureSumAggregator"]


class SecureSumAggregator:
    """The round's weighted mean update ``mean`` (``[N]``), already summed securely, for a
    server optimizer's step: ``optimizer.step(None, weights, aggregator=SecureSumAggregator(mean))``.

    ``weights``: the ``C`` clients' weights as the protocol used them (the number of clients
    and their weights are public to the server; uniform if None); they give ``sum_i p_i^2``
    and the client count the steps read.  ``mean_client_sq_norm``: ``sum_i p_i ||D_i||^2``
    from the same secure sum (None: unknown, and a step that needs it refuses the round).

    Recorded per client: ``client_sq_norms`` NaN (unknown), ``excluded`` all False.  A
    ``mean`` with a NaN or Inf skips the round, its parameters and state keep their bits.
    """

    def __init__(self, mean: torch.Tensor, *, mean_client_sq_norm: Optional[torch.Tensor] = None):
        if not isinstance(mean, torch.Tensor) or mean.dim() != 1:
            raise TypeError(f"mean must be a 1-d tensor (the round's mean update), got "
                            f"{type(mean).__name__ if not isinstance(mean, torch.Tensor) else tuple(mean.shape)}")
        if mean_client_sq_norm is not None and not isinstance(mean_client_sq_norm, torch.Tensor):
            mean_client_sq_norm = torch.tensor(float(mean_client_sq_norm), dtype=torch.float64)
        self.mean = mean
        self.mean_client_sq_norm = mean_client_sq_norm

    def __call__(self, optimizer: AggregatingOptimizer, updates, weights, out: torch.Tensor) -> RoundAggregate:
        if updates is not None:
            raise ValueError("under secure aggregation the server holds no client's update: pass updates=None "
                             "and the securely summed mean to SecureSumAggregator")
        if self.mean.numel() != out.numel():
            raise ValueError(f"the secure mean has {self.mean.numel()} elements but the model has {out.numel()}")
        if not (self.mean.is_floating_point()):
            raise TypeError(f"the secure mean must be floating point, got {self.mean.dtype}")
        if self.mean_client_sq_norm is None and getattr(optimizer, "needs_client_sq_norms", False):
            raise ValueError(f"{type(optimizer).__name__} reads sum_i p_i ||D_i||^2, which a secure sum holds only "
                             "if the clients sent it: pass mean_client_sq_norm")
        if weights is None:
            raise ValueError("weights: pass the round's client weights (one per client that entered the secure "
                             "sum; the server knows how many there were)")
        C = len(weights)
        p, valid = normalize_weights(weights, C, out.device, out.dtype)
        out.copy_(self.mean.to(out.device, out.dtype))
        sq = torch.dot(out, out)  # one fixed-order reduction in the accumulation dtype
        finite = torch.isfinite(sq)
        skip = ~finite if valid is None else (~finite | ~valid)
        stats = AggregateStats(client_sq_norms=torch.full((C,), float("nan"), dtype=out.dtype, device=out.device),
                               sq_norm=sq, excluded=torch.zeros(C, dtype=torch.bool, device=out.device),
                               weights=p, all_excluded=skip)
        msq = self.mean_client_sq_norm
        if msq is None:  # unknown: NaN, where no step reads it
            msq = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
        return RoundAggregate(stats=stats, p=p, bound=None, skip=skip, mean_sq=msq.to(out.device, out.dtype))

    def __repr__(self) -> str:
        known = "known" if self.mean_client_sq_norm is not None else "unknown"
        return f"SecureSumAggregator(N={self.mean.numel()}, mean client sq norm {known})"
