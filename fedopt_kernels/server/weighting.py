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
Flower strategies; :class:`BufferAverage` is its running form, for a round folded chunk
by chunk, to the same bits), except for FedLAW, whose global model keeps the statistics of its
proxy training ([FedLAW] section 6 and the released code; see
:class:`~fedopt_kernels.server.FedLAW`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .aggregation import CheckedWeights

__all__ = ["client_weights", "average_buffers", "BufferAverage", "cap_weight_shares", "check_max_weight_share"]


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

    With ``w_i`` the weights over the clients kept, ``(sum_i w_i rows_i) / sum_i w_i``:
    the weights are divided by their largest (so that the sum cannot overflow), the
    sum is taken row after row in round order in the accumulation dtype and divided by
    the total of the kept weights at the end -- renormalised here because a client's
    buffers can be left out (non-finite) where its update was not.  It is
    :class:`BufferAverage` fed all the rows at once, so a round folded chunk by chunk
    gets the same bits.

    Runs on the rows' device without a host synchronisation.
    """
    C = rows.shape[0]
    avg = BufferAverage(_weight_values(weights), C, rows.shape[1], rows.device, rows.dtype)
    avg.add(rows, torch.arange(C, device=rows.device), excluded)
    return avg.finish(current)


def _weight_values(weights) -> Optional[torch.Tensor]:
    return weights.values if isinstance(weights, CheckedWeights) else weights


class BufferAverage:
    """:func:`average_buffers` as a running sum: the round's buffer rows added in any
    number of pieces, in round order, then :meth:`finish`.

    Every row enters the same chain of roundings whatever the pieces:
    ``t = 0; t = t + w_i rows_i`` for ``i = 0 .. C-1`` (fp32 for fp16/bf16 buffers, else
    their dtype), ``w_i`` the weights divided by their largest, 0 for a client left out
    (its row zeroed, so a NaN cannot leak); :meth:`finish` divides by the kept weights'
    total, summed over the same ``[C]`` vector.  So a round whose clients' buffers are
    folded chunk by chunk (:mod:`fedopt_kernels.fl.engine.chunked`) gets exactly the bits of
    :func:`average_buffers` on all of them.

    Args:
        weights: the round's raw weights in round order (the values of
            :meth:`~fedopt_kernels.server.ServerRound.weights`, capped under
            ``max_weight_share``; None: uniform).
        num_clients: ``C``; numel, device, dtype: the buffer rows' length, device and dtype.
    """

    def __init__(self, weights: Optional[torch.Tensor], num_clients: int, numel: int, device, dtype):
        C = int(num_clients)
        if weights is None:
            w = torch.ones(C, dtype=torch.float64)
        else:
            w = weights.to(torch.float64)
            if w.numel() != C:
                raise ValueError(f"weights has {w.numel()} entries but there are {C} rows of buffers")
        self.dtype = dtype
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        self.w = (w / w.max().clamp(min=1e-300)).to(device=device, dtype=acc) if C else w.to(device, acc)
        self.keep = torch.zeros(C, dtype=torch.bool, device=device)
        self.t = torch.zeros(int(numel), dtype=acc, device=device)

    def add(self, rows: torch.Tensor, positions, excluded: Optional[torch.Tensor] = None) -> None:
        """Add ``rows`` (``[k, M]``), the buffers of the clients at ``positions``
        (ascending, after those added before); ``excluded`` (``[k]`` bool): the ones
        the aggregation left out."""
        k = rows.shape[0]
        if k == 0:
            return
        index = torch.as_tensor(positions, device=self.w.device)
        w = self.w.index_select(0, index)
        keep = torch.isfinite(rows).all(dim=1) & (w > 0)
        if excluded is not None:
            keep = keep & ~excluded.to(device=w.device, dtype=torch.bool)
        self.keep.index_copy_(0, index, keep)
        terms = torch.where(keep[:, None], w[:, None] * rows.to(w.dtype), torch.zeros((), dtype=w.dtype,
                                                                                          device=w.device))
        for j in range(k):  # one row at a time: the order, and so the bits, of any chunking
            self.t.add_(terms[j])

    def finish(self, current: torch.Tensor) -> torch.Tensor:
        """The mean of the rows kept, in the buffers' dtype; ``current`` if none was kept."""
        total = torch.where(self.keep, self.w, torch.zeros_like(self.w)).sum()
        mean = self.t / torch.where(total > 0, total, torch.ones_like(total))
        return torch.where(total > 0, mean, current.to(device=mean.device, dtype=mean.dtype)).to(self.dtype)
