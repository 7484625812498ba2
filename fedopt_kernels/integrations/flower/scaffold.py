"""SCAFFOLD on Flower: the server's control variate ``c`` and the messages that carry it.

The server's ``c`` (flat, zeros at first) travels to the clients as a second
``ArrayRecord`` under ``"scaffold-c"``; a client reports ``lr_sum`` (the sum of its
local learning rates) and the server applies option II after the step, without the
clients it excluded: ``c <- c + (1/M) sum_i (D_i / lr_sum_i - c)``, ``M`` the clients
of the federation (``num_clients``, default: the nodes connected to the grid) --
:class:`fedopt_kernels.server.ScaffoldControl`, the round's client-state rule, the
update the simulator runs too.  The client side is
:class:`~fedopt_kernels.integrations.flower.FedNARClient`'s ``scaffold``.
"""

from __future__ import annotations

from typing import List, Optional

from flwr.app import Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError

from ...ops import ClientPieces
from ...server import ScaffoldControl, ScaffoldReplies
from .concern import Concern, ConcernWrapper
from .records import tensors_to_arrayrecord

__all__ = ["Scaffold", "ScaffoldConcern", "SCAFFOLD_KEY", "LR_SUM_KEY"]

SCAFFOLD_KEY = "scaffold-c"  # ArrayRecord of the server control variate in train messages
LR_SUM_KEY = "lr_sum"  # a reply's MetricRecord entry: sum of the local lrs


class ScaffoldConcern(Concern):
    """SCAFFOLD's control variate as a concern of a fused strategy (module docstring)."""

    order = 0
    state_key = "scaffold_c"
    lr_sum_key = LR_SUM_KEY

    def __init__(self, num_clients: Optional[int] = None):
        if num_clients is not None and (isinstance(num_clients, bool) or not isinstance(num_clients, int)
                                        or num_clients < 1):
            raise ValueError(f"scaffold_num_clients must be a positive int, got {num_clients!r}")
        self.num_clients = num_clients
        self.control: Optional[ScaffoldControl] = None
        self.m: Optional[int] = None  # M of the round configure_train sent

    def bind(self, strategy) -> None:
        self.control = ScaffoldControl(strategy.x_global)
        strategy.reader.keep_base = True  # the updates are read again after the step

    def round_parts(self) -> dict:
        return {"client_state": self.control}

    def configure(self, strategy, messages: List[Message], grid: Grid) -> None:
        if not messages:
            return
        self.m = self.num_clients if self.num_clients is not None else len(list(grid.get_node_ids()))
        c = self.control.c
        record = tensors_to_arrayrecord((s.name, c[s.offset:s.offset + s.numel].view(s.shape))
                                        for s in strategy.layout.slots)
        for msg in messages:
            msg.content[SCAFFOLD_KEY] = record

    def client_state(self, strategy, results, metrics: List[MetricRecord]) -> ScaffoldReplies:
        """Each reply's ``D_i`` (read again after the step: from a snapshot of
        ``x_global`` where the replies are read in place), ``lr_sum`` (screened) and ``M``."""
        m = self.m if self.m is not None else self.num_clients
        if m is None:
            raise AggregationError(reason="scaffold=True: the number of clients M is unknown (aggregate_train "
                                          "before configure_train): pass scaffold_num_clients")
        D = results
        if strategy.round.takes == "models":  # D_i = x_global - x_i before the step moves x_global
            D = (ClientPieces(results.pieces, subtract_from=strategy.reader.base()) if isinstance(results, ClientPieces)
                 else strategy.x_global - results)
        return ScaffoldReplies(D, [float(r[LR_SUM_KEY]) for r in metrics], m)

    def state(self):
        return self.control.c.clone()

    def load_state(self, state) -> None:
        self.control.c.copy_(state)

    def describe(self):
        return "SCAFFOLD control variates", "on"


class Scaffold(ConcernWrapper):
    """SCAFFOLD around a fused strategy (its server step is the wrapped one's; with
    :class:`~.strategy.FedAvg` it is Karimireddy et al.'s SCAFFOLD).  ``num_clients``:
    ``M``, default the nodes connected to the grid."""

    def __init__(self, strategy, num_clients: Optional[int] = None):
        super().__init__(strategy, ScaffoldConcern(num_clients))
