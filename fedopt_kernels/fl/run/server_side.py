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

A round's clients reach the round only if they took part: a client left out before the
step (``no_data``, ``error``: :mod:`.simulation`) has no row, and is handed to the round
as screened out; the step itself leaves out NaN/Inf updates (``nonfinite``).  ``--max-weight-share`` caps a
client's share of the round's weights (:func:`~fedopt_kernels.server.weighting.cap_weight_shares`).

:class:`ServerSide` is the simulator's server part: it owns the algorithm, its state,
its per-round schedule (:meth:`ServerSide.schedule`), the round's components (the robust
rule, DP-FedAvg) and their pieces of the checkpoint (:meth:`ServerSide.checkpoint`).

The local step is FedNAR in the mode ``--nar`` (``co``: FedNAR; ``grad``: gradient
clipping, the papers' baselines; ``none``: plain SGD), so ``--algo fedadam --nar co``
is "FedNAR + FedAdam" of [FedNAR] Table 1.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ... import server as S
from ...server.compressed import CompressedDecoder
from ...server.robust_aggregation.robust_aggregator import RobustAggregator
from .checkpoint import detached_copy
from .config import SimulationConfig
from .privacy import privacy_of

__all__ = ["ServerSide", "BAD_CLIENT_REASONS"]

# Why a simulated client is left out of its round, in the order the record lists them:
# no samples to train on, its local training raised, its update holds NaN/Inf.
BAD_CLIENT_REASONS = ("no_data", "error", "nonfinite")


class ServerSide:
    """The server of a simulated run: the algorithm of ``config.algo`` over ``model``
    (the global model, whose parameters are views of the flat vector ``x_global``) and
    the :class:`~fedopt_kernels.server.ServerRound` that runs it with the run's
    components -- its robust rule (``config.aggregator``), DP-FedAvg
    (``config.dp_clip``), the per-client state ``client_state`` (SCAFFOLD's
    :class:`~fedopt_kernels.fl.ScaffoldState`) and the model's floating buffers.

    :attr:`server` is the algorithm (from :data:`fedopt_kernels.server.ALGORITHMS`, with
    the hyperparameters :attr:`hyper`: the class's defaults and what ``config`` sets);
    :attr:`round` the round, weighting the clients by ``config.resolved_weighting``
    (capped under ``config.max_weight_share``); :attr:`robust` and :attr:`privacy` its
    components (None when off).
    """

    def __init__(self, config: SimulationConfig, model: nn.Module, x_global, *, proxy_loader=None, loss_fn=None,
                 client_state=None):
        self.config = config
        self.algo = config.algo
        self.x_global = x_global
        algo = S.algorithm(self.algo)
        self.hyper = algo.hyperparameters(config)
        self.weighting = config.resolved_weighting
        if algo.cls.takes == "models":  # FedLAW: built over the model, learns on a proxy set
            if proxy_loader is None or loss_fn is None:
                raise ValueError(f"{self.algo} needs a proxy loader and a loss function")
            server = algo.cls(model, proxy_loader, loss_fn, backend=config.backend, **self.hyper)
        else:
            server = algo.cls([p for _, p in model.named_parameters()], backend=config.backend, **self.hyper)
        # the config refuses a robust rule with DP and with the algorithms it cannot serve
        self.robust: Optional[RobustAggregator] = (RobustAggregator(config.aggregator, **config.aggregator_params)
                                                   if config.aggregator != "mean" else None)
        self.privacy = privacy_of(config)
        # compressed replies (--compress) are decoded inside the aggregation, or into rows for a robust rule / DP
        decoder = (CompressedDecoder(rows=self.robust is not None or self.privacy is not None)
                   if config.compress != "none" else None)
        self.round = S.ServerRound(server, self.weighting, config.max_weight_share, aggregator=self.robust,
                                   privacy=self.privacy, client_state=client_state, model=model, decoder=decoder)

    @property
    def server(self):
        """The server algorithm (a :class:`~fedopt_kernels.server.ServerOptimizer`, a
        :class:`~fedopt_kernels.server.FedLAW`, or a wrapper of one such as
        :class:`~fedopt_kernels.distributed.DistributedServerOptimizer`)."""
        return self.round.server

    @server.setter
    def server(self, server) -> None:
        self.round.server = server

    @property
    def optimizer(self) -> Optional[S.ServerOptimizer]:
        """:attr:`server` where it is a server optimizer (or a wrapper of one), else None."""
        return self.server if self.server.takes == "updates" else None

    @property
    def fedlaw(self) -> Optional[S.FedLAW]:
        """:attr:`server` where it learns on the client models (FedLAW), else None."""
        return self.server if self.server.takes == "models" else None

    @property
    def max_weight_share(self) -> Optional[float]:
        return self.round.max_weight_share

    @property
    def averages_buffers(self) -> bool:
        """Whether the round averages the clients' floating buffers (False where the
        server keeps its own: FedLAW's proxy-trained statistics)."""
        return not self.server.keeps_buffers

    def schedule(self, round_number: int) -> None:
        """The algorithm's per-round settings before round ``round_number``'s step.
        FedExP's as its authors run it: ``eps * fedexp_eps_decay^(t)`` in round ``t + 1``
        (released main.py:308 decays eps by 0.998^2 per round) and ``M * eps`` when
        ``fedexp_scale_eps`` (main.py:404), written into the optimizer's param groups --
        a closed form of the round number, so a resumed run agrees."""
        cfg = self.config
        if cfg.algo != "fedexp" or self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            group["eps"] = cfg.fedexp_eps * cfg.fedexp_eps_decay ** (round_number - 1)
            group["scale_eps_by_clients"] = cfg.fedexp_scale_eps

    def meta(self) -> dict:
        """What the results record of the round's components: DP-FedAvg (``dp``) and the
        robust rule (``aggregator``), those that are on."""
        out = {}
        if self.privacy is not None:
            out["dp"] = self.privacy.meta()
        if self.robust is not None:
            out["aggregator"] = self.robust.to_dict()
        return out

    def state_dict(self) -> dict:
        """The server's state (tensors and plain values only: ``torch.load(weights_only=True)``)."""
        if self.optimizer is None:
            return {}
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    def checkpoint(self) -> dict:
        """The server part's pieces of a simulation checkpoint, keyed as there: the
        algorithm's state (``server``; copies, not the live optimizer state), DP-FedAvg's
        clip and rounds so far (``dp``), the robust rule's rounds and centered clipping's
        reference point (``robust``)."""
        return {"server": detached_copy(self.state_dict()),
                "dp": self.privacy.state_dict() if self.privacy is not None else None,
                "robust": self.robust.state_dict() if self.robust is not None else None}

    def load_checkpoint(self, state: dict) -> None:
        """Continue from :meth:`checkpoint`'s pieces of a simulation checkpoint."""
        self.load_state_dict(state["server"])
        if self.privacy is not None and state.get("dp") is not None:
            self.privacy.load_state_dict(state["dp"])
        if self.robust is not None and state.get("robust") is not None:
            self.robust.load_state_dict(state["robust"])
