"""SCAFFOLD's server-side control-variate update, shared by the simulator and Flower, and
the client-state rule of a round whose clients keep their ``c_i`` (:class:`ScaffoldControl`)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

__all__ = ["scaffold_control_update_", "ScaffoldControl", "ScaffoldReplies"]


@torch.no_grad()
def scaffold_control_update_(c: torch.Tensor, updates, lr_sums: Sequence[float], *, num_clients: int,
                             excluded: Optional[torch.Tensor] = None,
                             client_controls: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    r"""SCAFFOLD option II (Karimireddy et al. 2020, Algorithm 1 lines 12-17), in place::

        dc_i = c_i^+ - c_i = D_i / lr_sum_i - c        # D_i = x - y_i,  lr_sum_i = K eta_l
        c_i <- c_i + dc_i                              # client_controls, when given
        c   <- c + (1 / num_clients) sum_{i counted} dc_i

    A client counts when its ``lr_sum`` is ``> 0`` and finite, the aggregation did not
    exclude it (``excluded[i]``, the mask a server optimizer's
    :class:`~fedopt_kernels.server.ServerStats` or FedLAW's round reports) and its
    ``dc_i`` is finite: a NaN/Inf update never reaches ``c`` nor its ``c_i``.  The
    finiteness test runs on the device (no host synchronisation).

    Args:
        c: the server control variate ``[N]`` (updated in place).
        updates: the clients' ``D_i`` (``[C, N]`` or ``C`` flat vectors), in the order
            of ``lr_sums`` and ``excluded``.
        lr_sums: each client's sum of local learning rates (Python numbers).
        num_clients: ``N`` of Algorithm 1 (every client of the federation).
        excluded: ``[C]`` bool, or None.
        client_controls: the clients' ``c_i`` (``C`` tensors ``[N]``, updated in place),
            or None when the clients keep them (Flower).

    Returns:
        ``[C]`` bool on ``c``'s device: which clients counted.
    """
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive int, got {num_clients!r}")
    C = len(updates)
    if len(lr_sums) != C:
        raise ValueError(f"lr_sums has {len(lr_sums)} entries but there are {C} updates")
    if excluded is not None and excluded.numel() != C:
        raise ValueError(f"excluded has {excluded.numel()} entries but there are {C} updates")
    if client_controls is not None and len(client_controls) != C:
        raise ValueError(f"client_controls has {len(client_controls)} entries but there are {C} updates")
    total = torch.zeros_like(c)
    counted = []
    for i in range(C):
        lr_sum = float(lr_sums[i])
        if not (lr_sum > 0 and lr_sum != float("inf")):
            counted.append(torch.zeros((), dtype=torch.bool, device=c.device))
            continue
        delta = updates[i].to(c.dtype) / lr_sum - c
        ok = torch.isfinite(delta).all()
        if excluded is not None:
            ok = ok & ~excluded[i].to(device=c.device, dtype=torch.bool)
        delta = torch.where(ok, delta, torch.zeros_like(delta))
        total += delta
        if client_controls is not None:
            client_controls[i].add_(delta)
        counted.append(ok)
    c.add_(total, alpha=1.0 / num_clients)
    return torch.stack(counted) if counted else torch.zeros(0, dtype=torch.bool, device=c.device)


class ScaffoldReplies(NamedTuple):
    """What SCAFFOLD reads from a round's replies when the clients keep their ``c_i``
    (Flower): each reply's update ``D_i = x - y_i`` (as the aggregation read it, before
    the step moved ``x``), its ``lr_sum`` and ``M``, the clients of the federation."""

    updates: object
    lr_sums: Sequence[float]
    num_clients: int


class ScaffoldControl:
    """SCAFFOLD's server control variate ``c`` (flat, zeros at first) as the client-state
    rule of a :class:`~fedopt_kernels.server.ServerRound` whose clients keep their own
    ``c_i`` (Flower): after the step, :func:`scaffold_control_update_` from the
    :class:`ScaffoldReplies` the round's replies carry as their ``client_state``,
    without the clients the step excluded."""

    def __init__(self, like: torch.Tensor):
        self.c = torch.zeros_like(like)

    def commit(self, replies, excluded: Optional[torch.Tensor]) -> None:
        state: ScaffoldReplies = replies.client_state
        scaffold_control_update_(self.c, state.updates, state.lr_sums, num_clients=state.num_clients,
                                 excluded=excluded)

    def discard(self) -> None:
        """A round that applied nothing: ``c`` stays."""
