"""A robust aggregator by name: the entry point a server round plugs in.

:func:`robust_aggregate` runs one rule of :mod:`fedopt_kernels.ops.robust_aggregate` on
a round's updates and returns the aggregate with which clients were kept, selected and
left out -- what a round records (``results.json``) and what the server step needs
(``all_excluded``: skip the step).  The names are the command line's
(``--aggregator``, issue 31)::

    rule            parameters (defaults)                        source
    mean            weights                                      FedAvg (ops.aggregate)
    median          --                                           Yin et al. 2018
    trimmed-mean    beta                                         Yin et al. 2018
    krum            f                                            Blanchard et al. 2017
    multi-krum      f, m (C - f), weights                        Blanchard et al. 2017
    bulyan          f                                            El Mhamdi et al. 2018
    geomed          weights, nu (1e-6), tol (1e-5), max_iter (4) Pillutla et al. (RFA)
    centered-clip   tau, iterations (1), reference               Karimireddy et al. 2021
    norm-bound      weights, radius | median_factor              Sun et al. 2019

This module does not change the server optimizers' round (server/aggregation.py): the
round's refactor plugs it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...ops import aggregate as _aggregate
from ...ops import robust_aggregate as R

__all__ = ["RULES", "RobustResult", "robust_aggregate"]

_FUNCS = {
    "median": R.coordinate_median,
    "trimmed-mean": R.trimmed_mean,
    "krum": R.krum,
    "multi-krum": R.multi_krum,
    "bulyan": R.bulyan,
    "geomed": R.geometric_median,
    "centered-clip": R.centered_clip,
    "norm-bound": R.norm_bounded_mean,
}
# the parameters each rule takes (beyond the updates, out and backend)
_PARAMS = {
    "mean": {"weights"},
    "median": set(),
    "trimmed-mean": {"beta"},
    "krum": {"f"},
    "multi-krum": {"f", "m", "weights"},
    "bulyan": {"f"},
    "geomed": {"weights", "nu", "tol", "max_iter"},
    "centered-clip": {"tau", "iterations", "reference"},
    "norm-bound": {"weights", "radius", "median_factor"},
}
RULES = tuple(_PARAMS)


@dataclass(frozen=True)
class RobustResult:
    """One robust aggregation.

    * ``aggregate`` ``[N]``: the result (the updates' dtype unless ``out`` was given);
    * ``selected`` ``[C]`` bool: the clients whose values entered it;
    * ``excluded`` ``[C]`` bool: the clients left out for holding NaN/Inf;
    * ``weights`` ``[C]`` or None: the clients' weights in the result where it is a
      weighted sum (None for the coordinate-wise rules);
    * ``bound_met`` 0-d bool: the rule's bound held after the exclusions;
    * ``iterations`` 0-d int64 (geomed, centered-clip);
    * ``all_excluded`` 0-d bool: no client was usable -- a server step must be skipped;
    * ``client_sq_norms`` ``[C]`` float64 or None: every ``||x_i||^2`` where the rule
      computed them on its way (:class:`~fedopt_kernels.ops.robust_aggregate.RobustStats`).

    All tensors stay on the updates' device (nothing here synchronises).
    """

    rule: str
    aggregate: torch.Tensor
    selected: torch.Tensor
    excluded: torch.Tensor
    weights: Optional[torch.Tensor]
    bound_met: torch.Tensor
    iterations: torch.Tensor
    all_excluded: torch.Tensor
    client_sq_norms: Optional[torch.Tensor] = None


def robust_aggregate(updates, rule: str = "mean", *, out: Optional[torch.Tensor] = None,
                     backend: Optional[str] = None, **params) -> RobustResult:
    """Aggregate ``updates`` (a ``[C, N]`` tensor, a list of ``C`` 1-D tensors or
    :class:`~fedopt_kernels.ops.ClientPieces`) with ``rule`` (one of :data:`RULES`) and
    its ``params``; an unknown rule or a parameter the rule does not take is refused by
    name before anything is read."""
    if rule not in _PARAMS:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    unknown = sorted(set(params) - _PARAMS[rule])
    if unknown:
        takes = ", ".join(sorted(_PARAMS[rule])) or "no parameters"
        raise TypeError(f"rule {rule!r} does not take {', '.join(unknown)} (it takes {takes})")
    if rule == "mean":
        weights = params.get("weights")
        if weights is None:
            C = updates.shape[0] if isinstance(updates, torch.Tensor) else len(updates)
            weights = [1.0 / C] * C
        res, st = _aggregate(updates, weights, out=out, backend=backend)
        device = res.device
        zero = torch.zeros((), dtype=torch.long, device=device)
        return RobustResult(rule, res, ~st.excluded, st.excluded, st.weights, ~st.all_excluded, zero,
                            st.all_excluded, st.client_sq_norms)
    res, st = _FUNCS[rule](updates, out=out, backend=backend, **params)
    return RobustResult(rule, res, st.selected, st.excluded, st.weights, st.bound_met, st.iterations,
                        st.all_excluded, st.client_sq_norms)
