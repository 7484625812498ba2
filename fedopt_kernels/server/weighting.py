"""How the participating clients are weighted, and the floating buffers.

Each algorithm's own rule (``weighting="auto"``, with its source) is in
:mod:`fedopt_kernels.server.registry`; ``"uniform"`` and ``"size"`` force one.  The
simulator (``fedopt_kernels.fl``) and the Flower strategies
(``fedopt_kernels.integrations.flower``) turn a round's data sizes into weights with
:func:`client_weights` and :func:`cap_weight_shares`, through
:func:`fedopt_kernels.server.round.round_weights`.

``--nar co`` (FedNAR's local step under any server algorithm, [FedNAR] Table 1)
does NOT change the rule: [FedNAR] Algorithm 2 line 11 averages uniformly, but
FedNAR's contribution is the local update (its section 4.4: "we only need to change
line 6"), and keeping the server algorithm's own weighting makes ``fedavg:grad``
versus ``fedavg:co`` differ in the local step alone.  To reproduce FedNAR's tables
exactly, pass ``weighting="uniform"``.

What a claimed size can buy: :func:`cap_weight_shares` caps one client's share of the
round's total weight (``max_weight_share`` of the Flower strategies, the simulator and
:class:`~fedopt_kernels.distributed.DistributedServerOptimizer`; this is the one
implementation).  Off by default: a cap changes the estimator honest federations use.

Floating buffers (BatchNorm running statistics) are averaged with the SAME weights as
the parameters -- the round's weights of :meth:`fedopt_kernels.server.ServerRound.weights`,
checked once and capped under ``max_weight_share`` -- with the clients the aggregation
excluded left out (:func:`average_buffers`, through
:meth:`~fedopt_kernels.server.ServerRound.buffers`: one rule for the simulator and the
Flower strategies), except for FedLAW, whose global model keeps the statistics of its
proxy training ([FedLAW] section 6 and the released code; see
:class:`~fedopt_kernels.server.FedLAW`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .aggregation import CheckedWeights

__all__ = ["client_weights", "average_buffers", "cap_weight_shares", "check_max_weight_share"]


def client_weights(weighting: str, sizes: Union[torch.Tensor, Sequence[float]]) -> Optional[torch.Tensor]:
    """The ``weights`` argument of a server optimizer's ``step`` under a resolved
    ``weighting``: the data sizes (float64, on the CPU) for ``"size"``, None (uniform)
    for ``"uniform"``."""
    if weighting == "uniform":
        return None
    if weighting != "size":
        raise ValueError(f"weighting must be resolved to 'size' or 'uniform' first, got {weighting!r}")
    if isinstance(sizes, torch.Tensor):
        return sizes.detach().to("cpu", torch.float64)
    return torch.tensor([float(s) for s in sizes], dtype=torch.float64)


def check_max_weight_share(value, name: str = "max_weight_share") -> Optional[float]:
    """``value`` as a float in ``(0, 1]``, or None (no cap); anything else raises ``ValueError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be None or a number in (0, 1], got {value!r}")
    return float(value)


def cap_weight_shares(weights: torch.Tensor, max_share: Optional[float]) -> torch.Tensor:
    """``weights`` (``[C]``, >= 0, not all 0) as shares capped at ``max_share``: no
    client gets more than ``max_share`` of the total, the others keep their proportions
    (water-filling: the capped clients hold ``max_share`` each, the rest share what is
    left as before).  ``None``: ``weights / weights.sum()``.  A cap below ``1 / (number
    of clients with a positive weight)`` cannot be met and is raised to it (equal shares).

    Reads the values (host tensors; a device tensor would synchronise).  Clients of
    weight 0 keep share 0, so capping the weights of a round with left-out clients
    (weight 0) gives the good clients exactly the shares of capping them alone."""
    w = weights.to(torch.float64)
    p = w / w.sum()
    if max_share is None:
        return p
    positive = int((w > 0).sum())
    cap = max(float(max_share), 1.0 / positive)
    capped = torch.zeros_like(p, dtype=torch.bool)
    for _ in range(len(p)):  # each pass caps at least one more client, or stops
        over = (p > cap) & ~capped
        if not bool(over.any()):
            break
        capped |= over
        free = w.masked_fill(capped, 0.0)
        if not bool(free.sum() > 0):
            break
        p = torch.where(capped, torch.full_like(p, cap), free / free.sum() * (1.0 - cap * int(capped.sum())))
    return p


@torch.no_grad()
def average_buffers(rows: torch.Tensor, weights, current: torch.Tensor,
                    excluded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The new global floating buffers: the mean of the clients' ``rows`` (``[C, M]``)
    under the round's ``weights`` -- the very weights its parameters were averaged
    with (:meth:`fedopt_kernels.server.ServerRound.weights`: None for uniform, else the
    checked ``[C]`` float64 weights, capped under ``max_weight_share``) -- leaving out
    the clients the aggregation ``excluded`` (``[C]`` bool, on any device) and rows that
    are not finite; ``current`` (``[M]``, the global buffers) if no client is left.

    With ``p_i`` the weights over the clients kept, ``sum_i p_i rows_i``: the weights are
    divided by their largest (so that the sum cannot overflow), cast to the rows' dtype
    and divided by the total of the kept ones -- renormalised here because a client's
    buffers can be left out (non-finite) where its update was not.

    Runs on the rows' device without a host synchronisation.
    """
    C = rows.shape[0]
    device, dtype = rows.device, rows.dtype
    if weights is None:
        w = torch.ones(C, dtype=torch.float64)
    else:
        w = (weights.values if isinstance(weights, CheckedWeights) else weights).to(torch.float64)
        if w.numel() != C:
            raise ValueError(f"weights has {w.numel()} entries but there are {C} rows of buffers")
    w = (w / w.max().clamp(min=1e-300)).to(device=device, dtype=dtype)
    keep = torch.isfinite(rows).all(dim=1) & (w > 0)
    if excluded is not None:
        keep = keep & ~excluded.to(device=device, dtype=torch.bool)
    w = torch.where(keep, w, torch.zeros_like(w))
    total = w.sum()
    p = w / torch.where(total > 0, total, torch.ones_like(total))
    mean = p @ torch.where(keep[:, None], rows, torch.zeros_like(rows))
    return torch.where(total > 0, mean, current.to(device=device, dtype=dtype))
