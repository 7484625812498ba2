"""A Flower strategy whose ``aggregate_train`` is the server round of :mod:`fedopt_kernels.server`.

:class:`FusedStrategy` is a :class:`flwr.serverapp.strategy.FedAvg` (same sampling,
same messages, same ``fraction_train`` / ``min_*_nodes`` / ``weighted_by_key``
arguments, same federated evaluation) whose aggregation is replaced: it keeps the
global model on the server (``strategy.model``, its parameters moved into ONE flat
vector ``strategy.x_global``) and, per round,

1. ``configure_train``: loads the ``ArrayRecord`` it is asked to send into that model
   (round 1: the ``initial_arrays`` of :meth:`start`; later rounds: what it returned);
2. ``aggregate_train``: screens the replies (:mod:`.screening`: a reply that cannot be
   aggregated is left out with a reason), puts the rest in a fixed order (by the
   ``partition-id`` a client reports, else by node id -- so the result does not depend
   on the order in which messages arrive) and hands them to the round
   (:class:`~fedopt_kernels.server.ServerRound`: the weights from the replies'
   ``num-examples``, formed once; the aggregation; the server optimizer's step on the
   updates ``D_i = x_global - x_i``; the per-client state; the floating buffers; the
   record).  On a CPU server ``D`` is read in place (``read_in_place=True``, the
   default): the replies' arrays, viewed where they lie, with ``x_global`` as
   :class:`~fedopt_kernels.ops.ClientPieces` -- the kernel subtracts as it reads, so a
   round adds ``O(N)`` memory on top of the replies, and gives bit for bit what the
   copy would (FedLAW reads the client models themselves in place, in every pass of
   its learning).  Otherwise (``read_in_place=False``, an array of another dtype, or
   an accelerator, where the models are copied over and subtracted there) the replies
   are copied into ONE ``[C, N]`` tensor (:func:`~.records.stack_arrayrecords`: one
   pass per array, the subtraction folded into the copy).  One fused pass computes
   the weighted mean and every norm the adaptive methods need, and excludes clients
   whose arrays hold NaN/Inf.  FedLAW gets the client models themselves.  Floating
   buffers (BatchNorm statistics) become the round's weighted mean of the clients';
   integer buffers keep the server's values.  It returns the new global
   ``ArrayRecord`` (the keys, in the order, of the one it sent) and a ``MetricRecord``
   with Flower's weighted mean of the clients' metrics plus the round's record
   (``server_lr``, ``lr_scale``, ``update_norm``, ``excluded_clients`` and
   ``excluded_<reason>``, ``server_skipped``; ASNES adds ``gain_ratio``, ``sigma2``,
   ``nu2``; FedLAW reports ``gamma``, ``lambda`` and ``proxy_loss``) -- the names of
   ``fedopt simulate``'s records.

The other concerns compose around it (:mod:`.concern`), each in its own module, as
Flower's DP wrappers do: :class:`~.scaffold.Scaffold`,
:class:`~.robust.RobustAggregation`, :class:`~.privacy.DifferentialPrivacy` -- or by the
keyword arguments that have always named them (``scaffold=True``,
``aggregator="median"``, ``dp_clip=1.0``, ...).  The named strategies (:class:`FedAvg`,
..., :func:`make_strategy`) are in :mod:`.named`.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import FedAvg as _FlowerFedAvg
from flwr.supercore import log
from torch import nn

from ... import server as S
from ...server.weighting import check_max_weight_share
from ...utils.flat import buffers_layout, flatten_parameters_, parameters_layout
from ...server.differential_privacy.dp_settings import PYTHON_NAMES, robust_with_dp_error
from .compression import CompressionConcern
from .concern import Concern
from .privacy import DP_CLIP_KEY, PrivacyConcern  # noqa: F401 - DP_CLIP_KEY: importable here, as always
from .robust import RobustConcern
from .records import load_arrayrecord_, tensors_to_arrayrecord
from .replies import ReplyReader
from .scaffold import LR_SUM_KEY, SCAFFOLD_KEY, ScaffoldConcern  # noqa: F401 - as DP_CLIP_KEY
from .screening import BAD_REPLY_POLICIES, REASONS, screen_train_replies

__all__ = ["FusedStrategy", "ORDER_KEY", "concerns_from_keywords"]

ORDER_KEY = "partition-id"  # a reply's ConfigRecord entry that fixes the aggregation order

ServerFactory = Callable[[List[nn.Parameter]], S.ServerOptimizer]


class FusedStrategy(_FlowerFedAvg):
    """A Flower strategy around one server algorithm of :mod:`fedopt_kernels.server`; see
    the module docstring.

    Args:
        model: the global model, taken over: its parameters are moved into one flat
            vector (``x_global``) updated in place every round, so ``strategy.model`` is
            always the current global model.  All parameters must share one dtype and
            device (the aggregation runs on that device).
        server: a ``ServerOptimizer`` built over ``model.parameters()``, a callable
            ``params -> ServerOptimizer``, or a ``FedLAW`` over ``model``.
        weighting: ``"auto"`` (default: the algorithm's own), ``"size"`` (the replies'
            ``weighted_by_key``, ``num-examples`` by default) or ``"uniform"``;
            :attr:`weighting` is the resolved rule.
        max_weight_share: the largest share of the round's total weight one client may
            get (None, the default: no cap, the estimator honest federations use); with
            0.25 a client that claims ``num-examples = 10^12`` gets at most a quarter.
        on_bad_reply: ``"exclude"`` (default): a reply that cannot be aggregated is left
            out and counted in the round's metrics (``excluded_<reason>``), the round
            goes on with the rest and fails (``AggregationError``) only when no usable
            reply remains; ``"raise"``: any such reply fails the round, naming it.
        read_in_place: aggregate a CPU server's replies where they lie (``False``: copy
            them into a ``[C, N]`` tensor first, the same result).
        on_round: optional ``callback(server_round)`` called at the start of every
            ``aggregate_train`` (e.g. to reseed a data loader).
        **kwargs: Flower ``FedAvg``'s (``fraction_train``, ``min_train_nodes``,
            ``weighted_by_key``, ...), and the concerns' keywords
            (:func:`concerns_from_keywords`): ``scaffold``,
            ``scaffold_num_clients``; ``aggregator`` with ``trim_beta``, ``byzantine_f``,
            ...; ``dp_clip``, ``dp_num_clients`` and the other ``dp_*``.
    """

    def __init__(self, model: nn.Module, server: Union[S.ServerOptimizer, S.FedLAW, ServerFactory], *,
                 weighting: str = "auto", max_weight_share: Optional[float] = None, on_bad_reply: str = "exclude",
                 read_in_place: bool = True, on_round: Optional[Callable[[int], None]] = None, **kwargs):
        concerns = concerns_from_keywords(kwargs)
        _check_flower_arguments(kwargs)  # Flower's FedAvg takes them as given
        super().__init__(**kwargs)
        for concern in concerns:
            concern.prepare(self)
        if on_bad_reply not in BAD_REPLY_POLICIES:
            raise ValueError(f"on_bad_reply must be one of {BAD_REPLY_POLICIES}, got {on_bad_reply!r}")
        self.on_bad_reply, self.on_round = on_bad_reply, on_round
        self.max_weight_share = check_max_weight_share(max_weight_share)
        self.weighting_rule = weighting  # as given; self.weighting: resolved
        self._take_over(model)
        self.reader = ReplyReader(self.x_global, self.layout, self.buffers_layout, read_in_place)
        self.concerns: List[Concern] = []
        self.round = S.ServerRound(_own_server(server, model), "uniform")
        self._build_round()
        for concern in sorted(concerns, key=lambda c: c.order):
            self._attach(concern)
        self._sent: Optional[ArrayRecord] = None  # the record this strategy produced last
        self._keys: Optional[List[str]] = None  # keys (and order) of the global ArrayRecord
        self.last_stats = None  # ServerStats (or FedLAWRound) of the last round
        self.last_aggregation_time: Optional[float] = None

    def _take_over(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not any(True for _ in model.parameters()):
            raise ValueError("the model has no parameters")
        self.model = model
        self.x_global = flatten_parameters_(model)  # Parameter objects are kept: optimizers stay valid
        self.layout, self.buffers_layout = parameters_layout(model), buffers_layout(model)
        self.device = self.x_global.device

    # ------------------------------------------------------------------ concerns
    def attach(self, concern: Concern) -> None:
        """Add ``concern`` (what a :class:`~.concern.ConcernWrapper` does)."""
        concern.prepare(self)
        self._attach(concern)

    def _attach(self, concern: Concern) -> None:
        self.concerns.append(concern)
        self.weighting = S.resolve_weighting(self.weighting_rule, self.algorithm)
        concern.bind(self)
        self._build_round()

    def _build_round(self) -> None:
        parts = {}
        for concern in self.concerns:
            parts.update(concern.round_parts())
        self.weighting = S.resolve_weighting(self.weighting_rule, self.algorithm)
        self.round = S.ServerRound(self.round.server, self.weighting, self.max_weight_share, model=self.model,
                                   **parts)

    def _concern(self, key: str):
        return next((c for c in self.concerns if c.state_key == key), None)

    # what the concerns were always reached by: strategy.scaffold, .c, .robust, .privacy, .dp_clients_per_round
    scaffold = property(lambda self: self._concern("scaffold_c") is not None)
    c = property(lambda self: None if not self.scaffold else self._concern("scaffold_c").control.c)
    robust = property(lambda self: self.round.aggregator)
    privacy = property(lambda self: self.round.privacy)
    dp_clients_per_round = property(lambda self: getattr(self._concern("privacy"), "per_round", None))
    read_in_place = property(lambda self: self.reader.read_in_place)

    server = property(lambda self: self.round.server, doc="The server algorithm of :attr:`round`.")
    optimizer = property(lambda self: self.server if self.round.takes == "updates" else None,
                         doc=":attr:`server` where it takes the clients' updates, else None.")
    fedlaw = property(lambda self: self.server if self.round.takes == "models" else None,
                      doc=":attr:`server` where it takes the client models (FedLAW), else None.")

    @property
    def algorithm(self) -> str:
        """The algorithm name (``fedopt simulate``'s) whose weighting ``"auto"`` takes:
        ``scaffold`` with SCAFFOLD, else by the server's class in
        :data:`fedopt_kernels.server.ALGORITHMS` (a subclass counts as its base; an
        unknown optimizer as ``fedavg``)."""
        if self.scaffold:
            return "scaffold"
        for cls in type(self.server).__mro__:
            for name, algo in S.ALGORITHMS.items():
                if algo.cls is cls:
                    return name
        return "fedavg"

    def summary(self) -> None:
        """Log the server algorithm and the concerns, then Flower ``FedAvg``'s summary."""
        srv = self.server
        hyper = ({k: v for k, v in srv.param_groups[0].items() if k != "params"} if hasattr(srv, "param_groups")
                 else {k: getattr(srv, k) for k in ("learn", "server_epochs", "lr", "betas", "swa")})  # FedLAW's
        log(INFO, "\t├──> fedopt_kernels server: %s(%s)", type(srv).__name__,
            ", ".join(f"{k}={v}" for k, v in hyper.items()))
        log(INFO, "\t│\t├── model: %d parameters in %d tensors (%s, %s)", self.layout.numel, len(self.layout),
            self.layout.dtype, self.device)
        log(INFO, "\t│\t├── client weighting: %s", self.weighting)
        for concern in self.concerns:
            log(INFO, "\t│\t├── %s: %s", *concern.describe())
        super().summary()

    # ------------------------------------------------------------------ the global model
    def global_arrays(self) -> ArrayRecord:
        """The current global model as an ``ArrayRecord`` (``state_dict`` keys)."""
        return tensors_to_arrayrecord(self._named_state(self._keys))

    def load_global_arrays(self, arrays: ArrayRecord) -> None:
        """Make ``arrays`` (``state_dict`` keys; every parameter present) the global
        model: ``configure_train`` does this with the record it sends, unless it is the
        one this strategy returned last round."""
        load_arrayrecord_(self.model, arrays)
        self._keys, self._sent = list(arrays.keys()), arrays

    def _named_state(self, keys: Optional[Sequence[str]]):
        state = self.model.state_dict()
        return [(k, state[k]) for k in (list(state.keys()) if keys is None else keys)]

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Load ``arrays`` into the server's model (unless it is the record this
        strategy returned last round), then sample and build the messages as Flower's
        ``FedAvg`` does, with what each concern adds."""
        if arrays is not self._sent:
            self.load_global_arrays(arrays)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        for concern in self.concerns:
            concern.configure(self, messages, grid)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """Screen the replies, then hand them to the round (module docstring)."""
        replies = list(replies)
        self._check_and_log_replies(replies, is_train=True, validate=False)  # Flower's log of the round
        lr_sum_key = next((c.lr_sum_key for c in self.concerns if c.lr_sum_key), None)
        screened = screen_train_replies(replies, server_round=server_round, layout=self.layout,
                                        allow_extra=list(self.model.state_dict().keys()), check=self.reader.check,
                                        weighted_by_key=self.weighted_by_key, lr_sum_key=lr_sum_key)
        if screened.excluded:
            listed = "; ".join(f"node {n}: {reason} ({detail})" for n, reason, detail in screened.excluded)
            if self.on_bad_reply == "raise":
                raise AggregationError(reason=f"round {server_round}: bad replies (on_bad_reply='raise'): {listed}")
            log(WARNING, "aggregate_train: round %d left out %d repl%s: %s", server_round, len(screened.excluded),
                "y" if len(screened.excluded) == 1 else "ies", listed)
        if not screened.kept:
            if not replies:
                return None, None
            raise AggregationError(reason=f"round {server_round}: no usable reply among {len(replies)}: {listed}")
        t0 = time.perf_counter()
        if self.on_round is not None:
            self.on_round(server_round)
        valid = sorted(screened.kept, key=_order_key)
        contents = [m.content for m in valid]
        nodes = [int(m.metadata.src_node_id) for m in valid]
        records = [next(iter(c.array_records.values())) for c in contents]
        metrics = [next(iter(c.metric_records.values())) for c in contents]
        try:  # the round's weights, once (screened: finite, >= 0; None: uniform)
            weights = self.round.weights(torch.tensor([float(m[self.weighted_by_key]) for m in metrics],
                                                      dtype=torch.float64))
        except ValueError:
            raise AggregationError(reason=f"round {server_round}: the '{self.weighted_by_key}' of every usable "
                                          "reply is 0") from None
        with torch.no_grad():
            try:
                results = self.reader.results(records, [f"the ArrayRecord of node {n}" for n in nodes],
                                              updates=self.round.takes == "updates")
                buffers = self.reader.buffers(records)
            except (ValueError, TypeError) as exc:
                raise AggregationError(reason=str(exc)) from None
            client_state = None  # checked before anything changes
            for concern in self.concerns:
                client_state = concern.client_state(self, results, metrics) or client_state
            outcome = self.round(S.RoundReplies(results, weights=weights, clients=nodes, left_out=screened.excluded,
                                                reasons=REASONS, buffers=buffers, client_state=client_state))
        self.last_stats = outcome.stats.stats
        record = {k: int(v) if isinstance(v, bool) else v for k, v in outcome.record().items()}
        nonfinite = [n for n, reason, _ in outcome.left_out if reason == "nonfinite"]
        if nonfinite:
            log(WARNING, "aggregate_train: left out the %s of node(s) %s (NaN/Inf; nonfinite)%s",
                "update(s)" if self.round.takes == "updates" else "model(s)", nonfinite,
                "; round skipped" if record["server_skipped"] else "")
        out = tensors_to_arrayrecord(self._named_state(self._keys))
        self._sent = out
        if nonfinite:  # the metrics of the clients that counted, as the simulator's
            contents = [c for c, n in zip(contents, nodes) if n not in nonfinite] or contents
        try:
            agg = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except (KeyError, TypeError, ValueError) as exc:  # replies whose other metrics differ: keep the round
            log(WARNING, "aggregate_train: the clients' metrics could not be averaged (%s)", exc)
            agg = MetricRecord()
        for k, v in record.items():
            agg[k] = v
        self.last_aggregation_time = time.perf_counter() - t0
        return out, agg

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The server's state: the global model, the optimizer's state, the concerns'."""
        out = {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
               "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
               "scaffold_c": None, "keys": list(self._keys) if self._keys is not None else None,
               "robust": None, "privacy": None}
        out.update({c.state_key: c.state() for c in self.concerns})
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`; pass :meth:`global_arrays` as the
        ``initial_arrays`` of :meth:`start`."""
        with torch.no_grad():
            own = self.model.state_dict()
            for k, v in state["model"].items():
                own[k].copy_(v)
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for concern in self.concerns:
            if state.get(concern.state_key) is not None:
                concern.load_state(state[concern.state_key])
        self._keys, self._sent = state.get("keys"), None


def _check_flower_arguments(kwargs: dict) -> None:
    """Flower ``FedAvg``'s sampling arguments, checked here: Flower itself accepts, say,
    ``fraction_train=2.0`` and samples every node without a word."""
    for key in ("fraction_train", "fraction_evaluate"):
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0.0 <= value <= 1.0):
            raise ValueError(f"{key} must be a number in [0, 1] (the fraction of the nodes sampled per round), "
                             f"got {value!r}")
    for key in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"):
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{key} must be a non-negative integer, got {value!r}")


def _order_key(msg: Message):
    """The aggregation order: by the ``partition-id`` a reply reports, else by node id."""
    for rec in msg.content.config_records.values():
        if ORDER_KEY in rec:
            return (0, int(rec[ORDER_KEY]), int(msg.metadata.src_node_id))
    return (1, 0, int(msg.metadata.src_node_id))


def _own_server(server, model: nn.Module):
    """``server`` checked to be the model's own (a factory called over its parameters)."""
    params = [p for _, p in model.named_parameters()]
    if isinstance(server, S.FedLAW):
        if server.model is not model:
            raise ValueError("the FedLAW server must be built over the strategy's model")
        return server
    if isinstance(server, S.ServerOptimizer):
        owned = {id(p) for g in server.param_groups for p in g["params"]}
        if owned != {id(p) for p in params} or server.numel != sum(p.numel() for p in params):
            raise ValueError("the server optimizer must be built over exactly the model's parameters")
    elif callable(server):
        server = server(params)
        if not isinstance(server, S.ServerOptimizer):
            raise TypeError(f"the server factory returned {type(server).__name__}, not a ServerOptimizer")
    else:
        raise TypeError("server must be a ServerOptimizer, a FedLAW or a callable params -> ServerOptimizer")
    if [id(p) for g in server.param_groups for p in g["params"]] != [id(p) for p in params]:
        raise ValueError("the server optimizer must hold the model's parameters in named_parameters() "
                         "order (build it from model.parameters())")
    return server


def concerns_from_keywords(kwargs: dict) -> List[Concern]:
    """The concerns a fused strategy's keyword arguments name, taken out of ``kwargs``
    (what is left is Flower ``FedAvg``'s): ``scaffold`` / ``scaffold_num_clients``;
    ``aggregator`` and its parameters by the names of ``fedopt simulate``'s flags
    (``trim_beta``, ``byzantine_f``, ...); ``dp_clip`` and the other ``dp_*``; ``compress``
    (a :class:`~fedopt_kernels.compression.Codec`) with ``error_feedback`` and
    ``compress_seed`` (:mod:`.compression`).  Each is
    checked as far as it can be without the server (a DP setting without ``dp_clip``,
    a robust rule with DP, a parameter of another rule: refused by name)."""
    rule = kwargs.pop("aggregator", "mean")
    robust = S.robust_rule(rule, **{k: kwargs.pop(k) for k in list(kwargs) if k in S.AGGREGATOR_PARAMS})
    dp = {k[3:]: kwargs.pop(k) for k in list(kwargs) if k.startswith("dp_")}
    scaffold, m = kwargs.pop("scaffold", False), kwargs.pop("scaffold_num_clients", None)
    codec, ef, seed = kwargs.pop("compress", None), kwargs.pop("error_feedback", False), kwargs.pop("compress_seed", 0)
    if codec is None and (ef or seed):
        raise ValueError("error_feedback and compress_seed need compress (a fedopt_kernels.compression.Codec)")
    concerns: List[Concern] = []
    if scaffold or m is not None:
        concern = ScaffoldConcern(m)  # checks M even when SCAFFOLD is off, as always
        if scaffold:
            concerns.append(concern)
    if robust is not None:
        concerns.append(RobustConcern(robust))
    if dp.get("clip") is None:
        PrivacyConcern.refuse_without_clip(dp)
    else:
        if robust is not None:
            raise ValueError(robust_with_dp_error(rule, PYTHON_NAMES))
        concerns.append(PrivacyConcern(**dp))
    if codec is not None:
        concerns.append(CompressionConcern(codec, ef, seed))
    return concerns
