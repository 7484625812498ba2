"""The named fused strategies: one per server algorithm of :mod:`fedopt_kernels.server`.

:class:`FedAvg`, :class:`FedAvgM`, :class:`FedAdam`, :class:`FedYogi`,
:class:`FedAdagrad`, :class:`FedExP`, :class:`ASNES` and :class:`FedLAW` take their
server optimizer's hyperparameters (defaults from :mod:`fedopt_kernels.defaults`), then
:class:`~.strategy.FusedStrategy`'s and Flower ``FedAvg``'s keyword arguments;
:func:`make_strategy` builds one by ``fedopt simulate``'s algorithm names (``fedprox``
is ``FedAvg`` on the server -- its proximal term is client-side; ``scaffold`` is
``FedAvg(scaffold=True)``).
"""

from __future__ import annotations

import inspect
from typing import Callable, Tuple

from torch import nn

from ... import defaults as D
from ... import server as S
from .strategy import FusedStrategy

__all__ = ["FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedExP", "ASNES", "FedLAW", "make_strategy",
           "STRATEGIES"]


def _common(kwargs: dict) -> dict:
    return {k: kwargs.pop(k) for k in ("nonfinite", "max_client_norm", "backend") if k in kwargs}


class FedAvg(FusedStrategy):
    """FedAvg with a server lr and global weight shrinking (:class:`fedopt_kernels.server.FedAvg`):
    ``x <- gamma (x - lr D)``; ``lr = gamma = 1`` is McMahan et al.'s FedAvg (clients
    weighted by ``num-examples`` by default).  With ``scaffold=True`` (and
    :class:`~.client.FedNARClient`'s ``scaffold``) it is SCAFFOLD (clients averaged
    uniformly by default: Karimireddy et al. 2020, Algorithm 1)."""

    def __init__(self, model: nn.Module, *, lr: float = D.SERVER["fedavg"]["lr"], gamma: float = 1.0, **kwargs):
        opt = _common(kwargs)
        super().__init__(model, lambda p: S.FedAvg(p, lr=lr, gamma=gamma, **opt), **kwargs)


class FedAvgM(FusedStrategy):
    """FedAvg with server momentum (:class:`fedopt_kernels.server.FedAvgM`)."""

    def __init__(self, model: nn.Module, *, lr: float = D.SERVER["fedavgm"]["lr"],
                 momentum: float = D.SERVER["fedavgm"]["momentum"], nesterov: bool = False, **kwargs):
        opt = _common(kwargs)
        super().__init__(model, lambda p: S.FedAvgM(p, lr=lr, momentum=momentum, nesterov=nesterov, **opt),
                         **kwargs)


class FedAdam(FusedStrategy):
    """FedAdam (:class:`fedopt_kernels.server.FedAdam`, Reddi et al. 2021, no bias
    correction -- Flower's ``FedAdam`` adds one)."""

    def __init__(self, model: nn.Module, *, lr: float = D.SERVER["fedadam"]["lr"],
                 betas: Tuple[float, float] = D.ADAPTIVE["betas"], tau: float = D.ADAPTIVE["tau"], **kwargs):
        opt = _common(kwargs)
        super().__init__(model, lambda p: S.FedAdam(p, lr=lr, betas=betas, tau=tau, **opt), **kwargs)


class FedYogi(FusedStrategy):
    """FedYogi (:class:`fedopt_kernels.server.FedYogi`)."""

    def __init__(self, model: nn.Module, *, lr: float = D.SERVER["fedyogi"]["lr"],
                 betas: Tuple[float, float] = D.ADAPTIVE["betas"], tau: float = D.ADAPTIVE["tau"], **kwargs):
        opt = _common(kwargs)
        super().__init__(model, lambda p: S.FedYogi(p, lr=lr, betas=betas, tau=tau, **opt), **kwargs)


class FedAdagrad(FusedStrategy):
    """FedAdagrad (:class:`fedopt_kernels.server.FedAdagrad`; the class's defaults and
    their sources: ``lr`` 0.1, ``beta1 = momentum`` 0, ``tau`` 1e-3)."""

    def __init__(self, model: nn.Module, *, lr: float = D.SERVER["fedadagrad"]["lr"],
                 momentum: float = D.SERVER["fedadagrad"]["momentum"], tau: float = D.ADAPTIVE["tau"], **kwargs):
        opt = _common(kwargs)
        super().__init__(model, lambda p: S.FedAdagrad(p, lr=lr, momentum=momentum, tau=tau, **opt), **kwargs)


class FedExP(FusedStrategy):
    """FedExP's extrapolated server step (:class:`fedopt_kernels.server.FedExP`); clients
    averaged uniformly by default (Jhunjhunwala et al. 2023, Algorithm 1)."""

    def __init__(self, model: nn.Module, *, lr: float = D.SERVER["fedexp"]["lr"], eps: float = D.FEDEXP_EPS,
                 scale_eps_by_clients: bool = False, **kwargs):
        opt = _common(kwargs)
        super().__init__(model, lambda p: S.FedExP(p, lr=lr, eps=eps, scale_eps_by_clients=scale_eps_by_clients,
                                                   **opt), **kwargs)


class ASNES(FusedStrategy):
    """ASNES: AdaScale gain ratio + Nesterov momentum (:class:`fedopt_kernels.server.ASNES`):
    ``lr`` 1 ([ASNES] eq. 3-4c: the step is ``eta_t = r``), ``momentum`` 0.9
    (section 5.1), clients averaged uniformly by default (eq. 2)."""

    def __init__(self, model: nn.Module, *, lr: float = D.SERVER["asnes"]["lr"],
                 momentum: float = D.SERVER["asnes"]["momentum"], smoothing: float = D.ASNES_SMOOTHING, **kwargs):
        opt = _common(kwargs)
        super().__init__(model, lambda p: S.ASNES(p, lr=lr, momentum=momentum, smoothing=smoothing, **opt),
                         **kwargs)


class FedLAW(FusedStrategy):
    """FedLAW (:class:`fedopt_kernels.server.FedLAW`): learns ``gamma`` and ``lambda``
    on a server-side proxy set every round, from the clients' full models.

    ``proxy_loader``: a re-iterable of ``(input, target)`` batches (a ``DataLoader`` or
    a list), or a callable ``server_round -> loader`` called every round (round 1 once
    more at construction).  ``loss_fn(output, target) -> scalar``.  The keyword
    arguments are :class:`fedopt_kernels.server.FedLAW`'s (``learn``,
    ``server_epochs``, ``lr``, ``betas``, ``swa``, ``swa_start``, ``swa_lr``,
    ``lr_step``, ``train_mode``, ``backend``; its defaults), then
    :class:`~.strategy.FusedStrategy`'s and Flower ``FedAvg``'s.
    """

    def __init__(self, model: nn.Module, proxy_loader, loss_fn: Callable, **kwargs):
        self._proxy_fn = None
        loader = proxy_loader
        if callable(proxy_loader) and not hasattr(proxy_loader, "__iter__"):
            self._proxy_fn = proxy_loader
            loader = proxy_loader(1)
        options = {k: kwargs.pop(k) for k in _FEDLAW_OPTIONS if k in kwargs}
        fedlaw = S.FedLAW(model, loader, loss_fn, **options)
        user_hook = kwargs.pop("on_round", None)

        def on_round(server_round: int) -> None:
            if self._proxy_fn is not None:
                self.server.proxy_loader = self._proxy_fn(server_round)
            if user_hook is not None:
                user_hook(server_round)

        super().__init__(model, fedlaw, on_round=on_round, **kwargs)


# the keyword arguments of fedopt_kernels.server.FedLAW (after model, proxy_loader, loss_fn)
_FEDLAW_OPTIONS = tuple(p.name for p in inspect.signature(S.FedLAW.__init__).parameters.values()
                        if p.kind is inspect.Parameter.KEYWORD_ONLY)


STRATEGIES = {
    "fedavg": FedAvg, "fedprox": FedAvg, "scaffold": FedAvg, "fedavgm": FedAvgM, "fedadam": FedAdam,
    "fedyogi": FedYogi, "fedadagrad": FedAdagrad, "fedexp": FedExP, "asnes": ASNES, "fedlaw": FedLAW,
}


def make_strategy(algo: str, model: nn.Module, **kwargs) -> FusedStrategy:
    """The strategy of one of ``fedopt simulate``'s algorithm names (``fedprox`` is
    ``FedAvg`` on the server -- its proximal term is client-side; ``scaffold`` is
    ``FedAvg(scaffold=True)``; ``fedlaw`` needs ``proxy_loader`` and ``loss_fn``)."""
    if algo not in STRATEGIES:
        raise ValueError(f"unknown algorithm {algo!r}; choose one of {', '.join(STRATEGIES)}")
    if algo == "scaffold":
        kwargs.setdefault("scaffold", True)
    if algo == "fedlaw":
        try:
            proxy_loader, loss_fn = kwargs.pop("proxy_loader"), kwargs.pop("loss_fn")
        except KeyError:
            raise ValueError("fedlaw needs proxy_loader= and loss_fn=") from None
        return FedLAW(model, proxy_loader, loss_fn, **kwargs)
    return STRATEGIES[algo](model, **kwargs)
