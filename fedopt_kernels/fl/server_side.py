"""The server side of a simulated round: the server algorithm of ``config.algo`` and its round.

``--algo`` picks a (client correction, server step) pair:

============  =====================  ==============================================
algo          client                 server
============  =====================  ==============================================
fedavg        FedNAR local steps     :class:`~fedopt_kernels.server.FedAvg`
fedprox       + ``mu (x - x0)``      FedAvg
scaffold      + ``c - c_i``          FedAvg (+ control variates, option II)
fedavgm       FedNAR local steps     :class:`~fedopt_kernels.server.FedAvgM`
fedadam       "                      :class:`~fedopt_kernels.server.FedAdam`
fedyogi       "                      :class:`~fedopt_kernels.server.FedYogi`
fedadagrad    "                      :class:`~fedopt_kernels.server.FedAdagrad`
fedexp        "                      :class:`~fedopt_kernels.server.FedExP`
asnes         "                      :class:`~fedopt_kernels.server.ASNES`
fedlaw        "                      :class:`~fedopt_kernels.server.FedLAW` (proxy set)
============  =====================  ==============================================

The server column is :data:`fedopt_kernels.server.ALGORITHMS` (the registry: class,
weighting rule, defaults read from the class); the round is
:class:`fedopt_kernels.server.ServerRound`, the one the Flower strategies run too.

A round's clients reach :meth:`ServerSide.step` only if they took part: a client left
out before the step (``no_data``, ``error``: :mod:`.simulation`) has no row; the step
itself leaves out NaN/Inf updates (``nonfinite``).  ``--max-weight-share`` caps a
client's share of the round's weights (:func:`~fedopt_kernels.server.weighting.cap_weight_shares`).

The local step is FedNAR in the mode ``--nar`` (``co``: FedNAR; ``grad``: gradient
clipping, the papers' baselines; ``none``: plain SGD), so ``--algo fedadam --nar co``
is "FedNAR + FedAdam" of [FedNAR] Table 1.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from .. import server as S
from .config import SimulationConfig

__all__ = ["ServerSide", "BAD_CLIENT_REASONS"]

# Why a simulated client is left out of its round, in the order the record lists them:
# no samples to train on, its local training raised, its update holds NaN/Inf.
BAD_CLIENT_REASONS = ("no_data", "error", "nonfinite")


class ServerSide:
    """Builds the server algorithm of ``config.algo`` over ``model`` (the global model,
    whose parameters are views of the flat vector ``x_global``) and runs its round.

    :attr:`server` is the algorithm (from :data:`fedopt_kernels.server.ALGORITHMS`, with
    the hyperparameters :attr:`hyper`: the class's defaults and what ``config`` sets);
    :attr:`round` its :class:`~fedopt_kernels.server.ServerRound`, weighting the clients
    by ``config.resolved_weighting``.  :meth:`step` takes the round's ``[C, N]`` updates
    ``D_i = x_global - x_end_i`` and the clients' data sizes, updates the global model in
    place and returns its statistics as device tensors (read them once per round).
    :attr:`last_excluded` is the round's ``[C]`` mask of clients left out (NaN/Inf).
    :attr:`max_weight_share` (``config.max_weight_share`` under ``weighting="size"``,
    else None) caps each client's share of the weights; the distributed simulator
    hands it to the :class:`~fedopt_kernels.distributed.DistributedServerOptimizer`,
    which sees every rank's weights, and sets it to None here.
    """

    def __init__(self, config: SimulationConfig, model: nn.Module, x_global: torch.Tensor, *,
                 proxy_loader=None, loss_fn=None):
        self.config = config
        self.algo = config.algo
        self.x_global = x_global
        algo = S.algorithm(self.algo)
        self.hyper = algo.hyperparameters(config)
        self.weighting = config.resolved_weighting
        self.last_excluded: Optional[torch.Tensor] = None
        self._last_weights = None  # (data sizes, the round's weights) of the last step
        if algo.cls.takes == "models":  # FedLAW: built over the model, learns on a proxy set
            if proxy_loader is None or loss_fn is None:
                raise ValueError(f"{self.algo} needs a proxy loader and a loss function")
            server = algo.cls(model, proxy_loader, loss_fn, backend=config.backend, **self.hyper)
        else:
            server = algo.cls([p for _, p in model.named_parameters()], backend=config.backend, **self.hyper)
        self.round = S.ServerRound(server, self.weighting, config.max_weight_share)

    # ------------------------------------------------------------------ the one server
    @property
    def server(self):
        """The server algorithm (a :class:`~fedopt_kernels.server.ServerOptimizer`, a
        :class:`~fedopt_kernels.server.FedLAW`, or a wrapper of one such as
        :class:`~fedopt_kernels.distributed.DistributedServerOptimizer`)."""
        return self.round.server

    @server.setter
    def server(self, server) -> None:
        self.round = S.ServerRound(server, self.weighting, self.round.max_weight_share)

    @property
    def optimizer(self) -> Optional[S.ServerOptimizer]:
        """:attr:`server` where it is a server optimizer (or a wrapper of one), else None."""
        return self.server if self.server.takes == "updates" else None

    @optimizer.setter
    def optimizer(self, optimizer) -> None:
        self.server = optimizer

    @property
    def fedlaw(self) -> Optional[S.FedLAW]:
        """:attr:`server` where it learns on the client models (FedLAW), else None."""
        return self.server if self.server.takes == "models" else None

    @property
    def max_weight_share(self) -> Optional[float]:
        return self.round.max_weight_share

    @max_weight_share.setter
    def max_weight_share(self, value: Optional[float]) -> None:
        self.round.max_weight_share = value

    # ------------------------------------------------------------------ round
    @torch.no_grad()
    def step(self, updates: torch.Tensor, data_sizes: torch.Tensor) -> Dict[str, Optional[torch.Tensor]]:
        """One server round.  ``updates`` ``[C, N]`` may be overwritten (a server that
        takes the client models gets ``x_global - D_i``, made in place without a copy)."""
        if self.round.takes == "models":
            updates.neg_().add_(self.x_global)  # client models w_i = x - D_i, in place
        weights = self.round.weights(data_sizes)  # checked (and capped) once: the buffers reuse them
        stats = self.round.step(updates, weights)
        self.last_excluded = stats.excluded
        self._last_weights = (data_sizes, weights)
        return stats.metrics

    @property
    def averages_buffers(self) -> bool:
        """Whether the round averages the clients' floating buffers (False where the
        server keeps its own: FedLAW's proxy-trained statistics)."""
        return not self.server.keeps_buffers

    def buffers(self, rows: torch.Tensor, sizes, current: torch.Tensor,
                excluded: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The new global floating buffers of the round's clients (data ``sizes``), with
        the round's weights (:meth:`fedopt_kernels.server.ServerRound.buffers`, the rule
        of the Flower strategies too; None where the server keeps its own): those
        :meth:`step` formed from these very ``sizes``, else the round's rule applied to
        them (a step that saw other sizes: a distributed rank's share -- capped here with
        the cap its server applies to the union of the ranks' weights --, a folded round)."""
        last = self._last_weights
        if last is not None and last[0] is sizes:
            weights = last[1]
        else:
            cap = self.round.max_weight_share
            if cap is None and getattr(self.server, "weights_are_a_share", False):
                cap = getattr(self.server, "max_weight_share", None)  # the distributed server caps the union
            weights = S.round_weights(self.weighting, sizes, cap)
        return self.round.buffers(rows, weights, current, excluded)

    def state_dict(self) -> dict:
        """The server's state (tensors and plain values only: ``torch.load(weights_only=True)``)."""
        if self.optimizer is None:
            return {}
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
