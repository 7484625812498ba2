"""One server round, whatever the algorithm: the client weighting, the step, its statistics.

Every server algorithm of this package -- the :class:`ServerOptimizer` subclasses and
:class:`~fedopt_kernels.server.FedLAW` -- answers the same three things, which is all a
caller needs to run a round:

* ``takes``: what a round hands it for each client, ``"updates"`` (``D_i = x_global -
  x_i``) or ``"models"`` (the client parameters ``x_i`` themselves: FedLAW);
* ``keeps_buffers``: True when the global model's floating buffers (BatchNorm
  statistics) are the algorithm's own (FedLAW's proxy training), False when the caller
  averages the clients' buffers with the round's weights;
* ``round(results, weights) -> ServerRoundStats``: one round on ``C`` clients' results
  (a ``[C, N]`` tensor, ``C`` flat vectors or :class:`~fedopt_kernels.ops.ClientPieces`)
  with the normalisable weights of :func:`round_weights` (None: uniform).

:class:`ServerRound` is that round with its client weighting attached: the simulator
(:class:`fedopt_kernels.fl.ServerSide`), the Flower strategies
(:class:`fedopt_kernels.integrations.flower.FusedStrategy`) and the distributed
simulator (through :class:`~fedopt_kernels.distributed.DistributedServerOptimizer`,
which is a server of this kind too) all call it, and read its :class:`ServerRoundStats` with
:meth:`ServerRoundStats.read` (one host synchronisation).  The names of
:attr:`ServerRoundStats.metrics` are those of ``fedopt simulate``'s records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .aggregation import CheckedWeights, check_round_weights
from .weighting import average_buffers, cap_weight_shares, client_weights

__all__ = ["ServerRoundStats", "ServerRound", "round_weights", "read_metrics", "ROUND_INPUTS"]

ROUND_INPUTS = ("updates", "models")


@dataclass(frozen=True)
class ServerRoundStats:
    """What one server round did (device tensors; nothing read on the host yet).

    * ``excluded`` ``[C]`` bool: the clients the round left out (NaN/Inf results);
    * ``skipped`` 0-d bool: nothing was applied;
    * ``metrics``: the round's statistics by their record names, 0-d or ``[C]`` tensors
      (None where the round has no value): a server optimizer's ``server_lr``,
      ``lr_scale``, ``update_norm``, ``excluded_clients``, ``server_skipped`` (ASNES
      adds ``gain_ratio``, ``sigma2``, ``nu2``); FedLAW's ``gamma``, ``lambda``,
      ``proxy_loss``, ``excluded_clients``, ``server_skipped``;
    * ``stats``: the algorithm's own record of the round (a
      :class:`~fedopt_kernels.server.ServerStats` or a
      :class:`~fedopt_kernels.server.FedLAWRound`).
    """

    excluded: torch.Tensor
    skipped: torch.Tensor
    metrics: Dict[str, Optional[torch.Tensor]]
    stats: object

    def read(self) -> dict:
        """:attr:`metrics` as Python values, with one host synchronisation for the scalars
        (bool, int or float by the tensor's dtype; a ``[C]`` tensor as a list; None
        values left out)."""
        return read_metrics(self.metrics)


def read_metrics(metrics: dict) -> dict:
    """Device tensors -> Python numbers, with one host sync for the scalars (a value that
    is not a tensor is kept, None left out)."""
    out, scalars = {}, []
    for key, value in metrics.items():
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            scalars.append((key, value))
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu().tolist()
        else:
            out[key] = value
    if scalars:
        values = torch.stack([v.detach().to(torch.float64).cpu() for _, v in scalars]).tolist()
        for (key, t), v in zip(scalars, values):
            out[key] = bool(v) if t.dtype == torch.bool else (int(v) if not t.is_floating_point() else v)
    return out


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


class ServerRound:
    """A server algorithm and its client weighting: ``round_(results, sizes)`` runs one
    round (see the module docstring).

    Args:
        server: a :class:`~fedopt_kernels.server.ServerOptimizer`, a
            :class:`~fedopt_kernels.server.FedLAW`, or anything with ``takes``,
            ``keeps_buffers`` and ``round(results, weights)``.
        weighting: the resolved rule, ``"size"`` or ``"uniform"``
            (:func:`~.weighting.resolve_weighting`).
        max_weight_share: the largest share of the round's weight one client may get
            under ``"size"`` (None: no cap).
    """

    def __init__(self, server, weighting: str, max_weight_share: Optional[float] = None):
        if getattr(server, "takes", None) not in ROUND_INPUTS or not callable(getattr(server, "round", None)):
            raise TypeError(f"server must be a fedopt_kernels.server algorithm (a ServerOptimizer or FedLAW), got "
                            f"{type(server).__name__}")
        self.server = server
        self.weighting = weighting
        self.max_weight_share = max_weight_share if weighting == "size" else None

    @property
    def takes(self) -> str:
        """``"updates"`` or ``"models"``: what :meth:`__call__` wants for each client."""
        return self.server.takes

    def __call__(self, results, sizes) -> ServerRoundStats:
        """One round on the clients' ``results`` (what :attr:`takes` says), weighted by
        their data ``sizes`` under :attr:`weighting`."""
        return self.step(results, self.weights(sizes))

    def weights(self, sizes) -> Optional[CheckedWeights]:
        """The round's weights from the clients' data ``sizes`` (:func:`round_weights`
        under :attr:`weighting` and :attr:`max_weight_share`), checked once: what
        :meth:`step` takes.  A server whose weights are one rank's share of a round
        (``weights_are_a_share``: :class:`~fedopt_kernels.distributed.DistributedServerOptimizer`)
        has "not all zero" checked on the union of the ranks' instead."""
        return round_weights(self.weighting, sizes, self.max_weight_share,
                             share=getattr(self.server, "weights_are_a_share", False))

    def step(self, results, weights: Optional[CheckedWeights]) -> ServerRoundStats:
        """One round on the clients' ``results`` with the ``weights`` of :meth:`weights`
        (for a caller that uses them again, e.g. for the buffers)."""
        return self.server.round(results, weights)

    def buffers(self, rows: torch.Tensor, weights: Optional[CheckedWeights], current: torch.Tensor,
                excluded: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The new global floating buffers from the clients' ``rows`` (``[C, M]``), weighted
        with the round's ``weights`` -- those of :meth:`weights` that :meth:`step` took,
        ``max_weight_share`` included -- without the clients the step ``excluded``
        (:func:`~.weighting.average_buffers`); None where the server keeps its own (FedLAW)."""
        if self.server.keeps_buffers:
            return None
        if weights is not None and not isinstance(weights, CheckedWeights):  # raw sizes would skip the rule
            raise TypeError(f"weights must be the round's weights (ServerRound.weights(sizes), None for uniform), "
                            f"got {type(weights).__name__}")
        return average_buffers(rows, weights, current, excluded)
