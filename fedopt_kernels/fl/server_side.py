"""The server side of a simulated round: one interface over every server algorithm.

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

from .. import defaults as D
from .. import server as S
from ..server.weighting import cap_weight_shares
from .config import SimulationConfig

__all__ = ["SERVER_DEFAULTS", "ServerSide", "BAD_CLIENT_REASONS"]

# Why a simulated client is left out of its round, in the order the record lists them:
# no samples to train on, its local training raised, its update holds NaN/Inf.
BAD_CLIENT_REASONS = ("no_data", "error", "nonfinite")

# Server hyperparameters used when the config leaves them unset (server_lr=None ...):
# fedopt_kernels.defaults.SERVER, which the classes of fedopt_kernels.server and the
# Flower strategies read too (each value's source is written there).
SERVER_DEFAULTS: Dict[str, dict] = {algo: dict(values) for algo, values in D.SERVER.items()}


class ServerSide:
    """Builds the server algorithm of ``config.algo`` over ``model`` (the global model,
    whose parameters are views of the flat vector ``x_global``) and runs its round.

    :meth:`step` takes the round's ``[C, N]`` updates ``D_i = x_global - x_end_i`` and
    the clients' data sizes, weights the clients by ``config.resolved_weighting``
    (:mod:`fedopt_kernels.server.weighting`), updates the global model in place and
    returns its statistics as device tensors (read them once per round).
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
        defaults = dict(SERVER_DEFAULTS[self.algo])
        if config.server_lr is not None:
            defaults["lr"] = config.server_lr
        if config.server_momentum is not None and "momentum" in defaults:
            defaults["momentum"] = config.server_momentum
        self.hyper = defaults
        self.weighting = config.resolved_weighting
        self.max_weight_share = config.max_weight_share if self.weighting == "size" else None
        self.last_excluded: Optional[torch.Tensor] = None
        params = [p for _, p in model.named_parameters()]
        b = config.backend
        algo = self.algo
        self.fedlaw: Optional[S.FedLAW] = None
        self.optimizer: Optional[S.ServerOptimizer] = None
        if algo in ("fedavg", "fedprox", "scaffold"):
            self.optimizer = S.FedAvg(params, lr=defaults["lr"], backend=b)
        elif algo == "fedavgm":
            self.optimizer = S.FedAvgM(params, lr=defaults["lr"], momentum=defaults["momentum"], backend=b)
        elif algo == "fedadam":
            self.optimizer = S.FedAdam(params, lr=defaults["lr"], betas=config.server_betas, tau=config.server_tau,
                                       backend=b)
        elif algo == "fedyogi":
            self.optimizer = S.FedYogi(params, lr=defaults["lr"], betas=config.server_betas, tau=config.server_tau,
                                       backend=b)
        elif algo == "fedadagrad":
            self.optimizer = S.FedAdagrad(params, lr=defaults["lr"], momentum=defaults["momentum"],
                                          tau=config.server_tau, backend=b)
        elif algo == "fedexp":
            self.optimizer = S.FedExP(params, lr=defaults["lr"], eps=config.fedexp_eps, backend=b)
        elif algo == "asnes":
            self.optimizer = S.ASNES(params, lr=defaults["lr"], momentum=defaults["momentum"], backend=b)
        elif algo == "fedlaw":
            if proxy_loader is None or loss_fn is None:
                raise ValueError("fedlaw needs a proxy loader and a loss function")
            self.fedlaw = S.FedLAW(model, proxy_loader, loss_fn, learn=config.fedlaw_learn,
                                   server_epochs=config.fedlaw_epochs, lr=config.fedlaw_lr, backend=b)
            self.hyper = dict(learn=config.fedlaw_learn, server_epochs=config.fedlaw_epochs, lr=config.fedlaw_lr)
        else:  # pragma: no cover - the config validates algo
            raise ValueError(f"unknown algorithm {algo!r}")

    @torch.no_grad()
    def step(self, updates: torch.Tensor, data_sizes: torch.Tensor) -> Dict[str, Optional[torch.Tensor]]:
        """One server round.  ``updates`` ``[C, N]`` may be overwritten (FedLAW turns
        it into the client models ``x_global - D_i`` in place, without a copy)."""
        weights = S.client_weights(self.weighting, data_sizes)
        if weights is not None and self.max_weight_share is not None:
            weights = cap_weight_shares(weights, self.max_weight_share)  # shares: what a size can buy
        if self.fedlaw is not None:
            updates.neg_().add_(self.x_global)  # client models w_i = x - D_i, in place
            # lambda starts from the data-size weights ([FedLAW] Algorithm 1 line 10),
            # or from 1/C under weighting="uniform"
            lam0 = weights.tolist() if weights is not None else [1.0] * updates.shape[0]
            gamma, lam = self.fedlaw.step(updates, lam0)
            self.last_excluded = self.fedlaw.last_round.excluded
            losses = self.fedlaw.last_round.losses
            return {"gamma": gamma, "lambda": lam,
                    "proxy_loss": losses[-1] if losses.numel() else None,
                    "excluded_clients": self.fedlaw.last_round.excluded.sum()}
        st = self.optimizer.step(updates, weights)
        self.last_excluded = st.excluded
        lr = self.optimizer.param_groups[0]["lr"]
        out = {
            "server_lr": st.lr_scale * lr,
            "lr_scale": st.lr_scale,
            "update_norm": st.update_sq_norm.sqrt(),
            "excluded_clients": st.excluded.sum(),
            "server_skipped": st.skipped,
        }
        if st.gain_ratio is not None:
            out.update(gain_ratio=st.gain_ratio, sigma2=st.sigma2, nu2=st.nu2)
        return out

    def state_dict(self) -> dict:
        """The server's state (tensors and plain values only: ``torch.load(weights_only=True)``)."""
        if self.optimizer is None:
            return {}
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
