"""The concerns a fused strategy composes, one at a time, as Flower's DP wrappers compose
around a strategy.

A :class:`~.strategy.FusedStrategy` is the weighted round of one server algorithm.
Each further concern -- SCAFFOLD's control variates (:mod:`.scaffold`), a
Byzantine-robust rule (:mod:`.robust`), DP-FedAvg (:mod:`.privacy`) -- is a
:class:`Concern`: the component it hands the server round
(:class:`~fedopt_kernels.server.ServerRound`: a client-state rule, an aggregator, a
privacy mechanism), what it adds to the train messages, what it reads from the replies,
and its part of the checkpoint.  It comes in by a wrapper, as Flower's
``DifferentialPrivacyServerSideFixedClipping(strategy, ...)`` does::

    strategy = DifferentialPrivacy(FedAvg(model), clip=1.0, num_clients=100, noise_multiplier=1.0,
                                   delta=1e-5)

(:class:`ConcernWrapper`: a ``flwr`` ``Strategy`` that attaches its concern to the
fused strategy it wraps and hands every call on), or by the fused strategy's keyword
arguments that have always named them (``scaffold=True``, ``aggregator="median"``,
``dp_clip=1.0``, ...: :func:`~.strategy.concerns_from_keywords`).  Either way the round is built
once more with the concern's component; the fused strategy itself knows none of them.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

__all__ = ["Concern", "ConcernWrapper"]


class Concern:
    """One concern of a fused strategy (see the module docstring).  Every hook does
    nothing unless a concern says otherwise."""

    order = 0  # where it binds among the others: SCAFFOLD, then a robust rule, then DP
    state_key = ""  # its entry of the strategy's state_dict
    lr_sum_key: Optional[str] = None  # a MetricRecord entry every reply must carry (screened)

    def prepare(self, strategy: "FusedStrategy") -> None:
        """Checks that need Flower's arguments (``fraction_train``, ...), before the
        strategy takes the model over."""

    def bind(self, strategy: "FusedStrategy") -> None:
        """Checks against the strategy's server and weighting; build the component."""

    def round_parts(self) -> dict:
        """The keyword arguments it gives :class:`~fedopt_kernels.server.ServerRound`."""
        return {}

    def configure(self, strategy: "FusedStrategy", messages: List[Message], grid: Grid) -> None:
        """Add its part to the round's train messages."""

    def client_state(self, strategy: "FusedStrategy", results, metrics: List[MetricRecord]):
        """What its client-state rule reads from the replies (before the step moves the
        model); None: nothing."""
        return None

    stateful = None  # what holds its state across rounds (a state_dict / load_state_dict pair), if anything

    def state(self):
        """Its entry of the checkpoint: :attr:`stateful`'s ``state_dict()``."""
        return None if self.stateful is None else self.stateful.state_dict()

    def load_state(self, state) -> None:
        """Continue from :meth:`state`."""
        if self.stateful is not None:
            self.stateful.load_state_dict(state)

    def describe(self) -> Tuple[str, str]:
        """``(what, setting)`` for the strategy's summary."""
        return type(self).__name__, "on"


class ConcernWrapper(Strategy):
    """A ``flwr`` strategy that adds ``concern`` to the fused ``strategy`` it wraps (a
    :class:`~.strategy.FusedStrategy`, or another wrapper of one) and hands every call
    on; attributes it does not have are the wrapped strategy's."""

    def __init__(self, strategy, concern: Concern):
        if not callable(getattr(strategy, "attach", None)):
            raise TypeError(f"{type(self).__name__} wraps a fused strategy (fedopt_kernels.integrations.flower."
                            f"FusedStrategy or a wrapper of one), got {type(strategy).__name__}")
        strategy.attach(concern)
        self.strategy = strategy
        self.concern = concern

    def __getattr__(self, name):
        if name in ("strategy", "concern"):
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()

