"""One table of server-optimizer cases, which every server test draws from (as PyTorch's
``OptimizerInfo`` does for ``torch.optim``).

A :class:`ServerCase` is a server optimizer of :mod:`fedopt_kernels.server` with
hyperparameters chosen so that every term of its formula matters (no default, no 0 or
1 where the formula has a factor), and the name of its plain-PyTorch oracle in
``python_ref``.  The tests parametrize over :data:`SERVER_CASES` (or the one case per
class of :func:`one_per_class`) and build the optimizer with :meth:`ServerCase.make`,
adding the round's options (``nonfinite``, ``max_client_norm``, ``backend``,
``aggregator``) where the test is about them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import pytest

from fedopt_kernels import server as S

__all__ = ["ServerCase", "SERVER_CASES", "CASES", "one_per_class", "params_of"]


@dataclass(frozen=True)
class ServerCase:
    """``name`` (the test id), ``cls``, ``hyper`` (non-default values) and ``oracle``: the
    ``python_ref`` formula it is checked against (``fedavg``, ``fedavgm``, ``fedadam``,
    ``fedyogi``, ``fedadagrad``, ``fedexp``, ``asnes``)."""

    name: str
    cls: type
    hyper: Dict[str, object] = field(default_factory=dict)
    oracle: str = ""

    def make(self, params, **options) -> S.ServerOptimizer:
        """The optimizer of this case over ``params``, with the round's ``options``."""
        return self.cls(params, **self.hyper, **options)


SERVER_CASES = (
    ServerCase("FedAvg", S.FedAvg, dict(lr=0.9, gamma=0.97), "fedavg"),
    ServerCase("FedAvgM", S.FedAvgM, dict(lr=0.7, momentum=0.8), "fedavgm"),
    ServerCase("FedAvgM-nesterov", S.FedAvgM, dict(lr=0.7, momentum=0.8, nesterov=True), "fedavgm"),
    ServerCase("FedAdam", S.FedAdam, dict(lr=0.05, betas=(0.8, 0.95), tau=1e-2), "fedadam"),
    ServerCase("FedYogi", S.FedYogi, dict(lr=0.05, betas=(0.8, 0.95), tau=1e-2), "fedyogi"),
    ServerCase("FedAdagrad", S.FedAdagrad, dict(lr=0.05, momentum=0.5, tau=1e-2), "fedadagrad"),
    ServerCase("FedExP", S.FedExP, dict(lr=1.0, eps=1e-3), "fedexp"),
    ServerCase("FedExP-released-eps", S.FedExP, dict(lr=0.9, eps=0.05, scale_eps_by_clients=True), "fedexp"),
    ServerCase("ASNES", S.ASNES, dict(lr=0.5, momentum=0.85), "asnes"),
    ServerCase("ASNES-smoothed", S.ASNES, dict(lr=0.5, momentum=0.85, smoothing=0.7), "asnes"),
)
CASES: Dict[str, ServerCase] = {c.name: c for c in SERVER_CASES}
assert len(CASES) == len(SERVER_CASES), "case names must be unique"
# every server optimizer of the package has a case
assert {c.cls for c in SERVER_CASES} == {a.cls for a in S.ALGORITHMS.values() if issubclass(a.cls, S.ServerOptimizer)}


def one_per_class(*classes: type) -> List[ServerCase]:
    """The first case of each server optimizer class (of ``classes``, or of all)."""
    seen, out = set(), []
    for c in SERVER_CASES:
        if c.cls not in seen and (not classes or c.cls in classes):
            seen.add(c.cls)
            out.append(c)
    return out


def params_of(cases) -> list:
    """``cases`` as ``pytest.param``s with their names as ids."""
    return [pytest.param(c, id=c.name) for c in cases]
