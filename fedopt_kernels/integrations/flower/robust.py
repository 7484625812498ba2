"""A Byzantine-robust aggregation rule on Flower.

The rule (``fedopt simulate --aggregator``'s names: median, trimmed-mean, krum,
multi-krum, bulyan, geomed, centered-clip, norm-bound; docs/robustness.md) with its
parameters by the names of the flags (``trim_beta``, ``byzantine_f``, ``krum_m``,
``geomed_iters``, ``geomed_tol``, ``cclip_tau``, ``cclip_iters``,
``norm_bound_radius``) becomes the aggregation of the round
(:class:`~fedopt_kernels.server.RobustAggregator`); Krum, Multi-Krum and Bulyan report
the node ids they selected in the round's metrics (``robust_selected``, and
``robust_bound_met``).  Refused with FedLAW and SCAFFOLD, and by the round with FedExP,
ASNES and ``max_client_norm`` (their steps need the weighted mean).
"""

from __future__ import annotations

from ...server import RobustAggregator, robust_rule
from .concern import Concern, ConcernWrapper

__all__ = ["RobustAggregation", "RobustConcern"]


class RobustConcern(Concern):
    """A robust rule as a concern of a fused strategy (module docstring)."""

    order = 1
    state_key = "robust"

    def __init__(self, aggregator: RobustAggregator):
        self.aggregator = self.stateful = aggregator  # centered clipping's reference, the rounds

    def bind(self, strategy) -> None:
        rule = self.aggregator.rule
        if strategy.optimizer is None:
            raise ValueError(f"aggregator {rule!r} needs a server optimizer that takes the clients' updates; FedLAW "
                             "learns its own aggregation weights from the client models")
        if strategy.scaffold:
            raise ValueError(f"aggregator {rule!r} cannot be used with scaffold=True: SCAFFOLD's control variate "
                             "averages every client's correction, poisoned ones included")

    def round_parts(self) -> dict:
        return {"aggregator": self.aggregator}

    def describe(self):
        return "robust aggregation", str(self.aggregator.to_dict())


class RobustAggregation(ConcernWrapper):
    """The robust ``rule`` around a fused strategy, its parameters by the flags' names
    (module docstring)."""

    def __init__(self, strategy, rule: str, **params):
        aggregator = robust_rule(rule, **params)
        if aggregator is None:
            raise ValueError("RobustAggregation needs a robust rule; 'mean' is the fused strategy's own")
        super().__init__(strategy, RobustConcern(aggregator))
