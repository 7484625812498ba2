"""Flower strategies whose ``aggregate_train`` is one fused aggregation + a server optimizer.

:class:`FusedStrategy` is a :class:`flwr.serverapp.strategy.FedAvg` (same sampling,
same messages, same ``fraction_train`` / ``min_*_nodes`` / ``weighted_by_key``
arguments, same federated evaluation) whose aggregation is replaced: it keeps the
global model on the server (``strategy.model``, its parameters moved into ONE flat
vector ``strategy.x_global``) and, per round,

1. ``configure_train``: loads the ``ArrayRecord`` it is asked to send into that model
   (round 1: the ``initial_arrays`` of :meth:`start`; later rounds: what it returned);
2. ``aggregate_train``: puts the replies in a fixed order (by the ``partition-id`` a
   client reports, else by node id -- so the result does not depend on the order in
   which messages arrive), and calls the server optimizer's ``step(D, weights)`` on
   the updates ``D_i = x_global - x_i`` with the replies' ``num-examples`` as weights.
   On a CPU server ``D`` is read in place (``read_in_place=True``, the default): the
   replies' arrays, viewed where they lie, with ``x_global`` as
   :class:`~fedopt_kernels.ops.ClientPieces` -- the kernel subtracts as it reads, so a
   round adds ``O(N)`` memory on top of the replies, and gives bit for bit what the
   copy would (FedLAW reads the client models themselves in place, in every pass of
   its learning).  Otherwise (``read_in_place=False``, an array of another dtype, or
   an accelerator, where the models are copied over and subtracted there) the
   replies are copied into ONE ``[C, N]`` tensor (:func:`~.records.stack_arrayrecords`:
   one pass per array, the subtraction folded into the copy).  One fused pass computes
   the weighted mean and every norm the adaptive methods need, and excludes clients
   whose arrays hold NaN/Inf.  FedLAW gets the client models themselves.  Floating
   buffers (BatchNorm statistics) become the ``num-examples``-weighted mean of the
   clients'; integer buffers keep the server's values.  It returns the new global
   ``ArrayRecord`` (the keys, in the order, of the one it sent) and a ``MetricRecord``
   with Flower's weighted mean of the clients' metrics plus the server's statistics
   (``server_lr``, ``lr_scale``, ``update_norm``, ``excluded_clients``,
   ``server_skipped``; ASNES adds ``gain_ratio``, ``sigma2``, ``nu2``; FedLAW reports
   ``gamma``, ``lambda`` and ``proxy_loss``) -- the names of ``fedopt simulate``'s records.

SCAFFOLD (``scaffold=True``): the server's control variate ``c`` (flat, zeros at
first) travels to the clients as a second ``ArrayRecord`` under
``"scaffold-c"``; a client reports ``lr_sum`` (the sum of its local learning rates)
and the server applies option II: ``c <- c + (1/M) sum_i (D_i / lr_sum_i - c)``, ``M``
the number of clients in the federation (``scaffold_num_clients``, default: the nodes
connected to the grid), after the server step and without the clients it excluded:
:func:`fedopt_kernels.server.scaffold_control_update_`, the simulator's update too.
The client side is :mod:`fedopt_kernels.integrations.flower.client`.

The named strategies (:class:`FedAvg`, :class:`FedAvgM`, :class:`FedAdam`,
:class:`FedYogi`, :class:`FedAdagrad`, :class:`FedExP`, :class:`ASNES`,
:class:`FedLAW`) take the hyperparameters of the server optimizers of
:mod:`fedopt_kernels.server` and Flower's ``FedAvg`` keyword arguments;
:func:`make_strategy` builds one by the simulator's algorithm names.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import FedAvg as _FlowerFedAvg
from flwr.supercore import log
from torch import nn

from ... import defaults as D
from ... import server as S
from ...ops import ClientPieces
from ...utils.flat import (buffers_layout, buffers_to_vector, flatten_parameters_, parameters_layout,
                           vector_to_buffers)
from ...fl.config import AGGREGATOR_PARAMS, AGGREGATORS, TRIM_BETA
from ...fl.dp_settings import PYTHON_NAMES, check_dp_settings, robust_with_dp_error
from ...fl.privacy import RoundPrivacy
from ...server.robust_aggregator import RobustAggregator, refuse_robust_statistics
from .records import arrayrecords_as_pieces, load_arrayrecord_, stack_arrayrecords, tensors_to_arrayrecord
from .screening import BAD_REPLY_POLICIES, REASONS, screen_train_replies

__all__ = [
    "FusedStrategy", "FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedExP", "ASNES", "FedLAW",
    "make_strategy", "STRATEGIES", "SCAFFOLD_KEY", "ORDER_KEY",
]

SCAFFOLD_KEY = "scaffold-c"  # ArrayRecord of the server control variate in train messages
ORDER_KEY = "partition-id"  # a reply's ConfigRecord entry that fixes the aggregation order
LR_SUM_KEY = "lr_sum"  # a reply's MetricRecord entry: sum of the local lrs (SCAFFOLD)
DP_CLIP_KEY = "dp-clip"  # the train ConfigRecord's entry with dp_mode="client": the clip the clients clip to

ServerFactory = Callable[[List[nn.Parameter]], S.ServerOptimizer]


class FusedStrategy(_FlowerFedAvg):
    """A Flower strategy around one server optimizer of :mod:`fedopt_kernels.server`
    (or a :class:`~fedopt_kernels.server.FedLAW`); see the module docstring.

    Args:
        model: the global model.  The strategy takes it over: its parameters are moved
            into one flat vector (``x_global``) and updated in place every round, so
            ``strategy.model`` is always the current global model.  All parameters
            must share one dtype and device (the aggregation runs on that device).
        server: a ``ServerOptimizer`` built over ``model.parameters()``, a callable
            ``params -> ServerOptimizer``, or a ``FedLAW`` over ``model``.
        scaffold: send SCAFFOLD's server control variate and update it (see above).
        scaffold_num_clients: ``M`` of SCAFFOLD's update (default: connected nodes).
        weighting: ``"auto"`` (default: the algorithm's own, see above), ``"size"``
            (the replies' ``weighted_by_key``, ``num-examples`` by default) or
            ``"uniform"``; :attr:`weighting` is the resolved rule.
        on_round: optional ``callback(server_round)`` called at the start of every
            ``aggregate_train`` (e.g. to reseed a data loader).
        on_bad_reply: ``"exclude"`` (default): a reply that cannot be aggregated (a
            failed node, a second reply of a node, a reply to another round, missing
            or misshapen arrays, a missing, negative or non-finite ``num-examples``;
            :mod:`~fedopt_kernels.integrations.flower.screening`) is left out and
            counted in the round's metrics (``excluded_clients`` and
            ``excluded_<reason>``), the round goes on with the rest, and fails
            (``AggregationError``) only when no usable reply remains.  ``"raise"``:
            any such reply fails the round, naming it.
        read_in_place: aggregate a CPU server's replies where they lie (see above;
            ``False``: copy them into a ``[C, N]`` tensor first, the same result).
        max_weight_share: the largest share of the round's total weight one client
            may get (``None``, the default: no cap).  Without a cap a client that
            claims ``num-examples = 10^12`` takes the whole weighted mean; with
            ``max_weight_share = 0.25`` it gets at most a quarter and the others keep
            their proportions.  The default is no cap because a cap changes the
            estimator honest federations use (FedAvg weights by data size) -- set one
            where clients are not trusted; it composes with the server optimizer's
            ``max_client_norm`` (which bounds what an update can do with its share).
        aggregator: ``"mean"`` (default: the server optimizer's weighted mean) or a
            Byzantine-robust rule, by ``fedopt simulate --aggregator``'s names (median,
            trimmed-mean, krum, multi-krum, bulyan, geomed, centered-clip, norm-bound;
            :class:`~fedopt_kernels.server.RobustAggregator`, docs/robustness.md), with its
            parameters by the same names as the flags: ``trim_beta``, ``byzantine_f``,
            ``krum_m``, ``geomed_iters``, ``geomed_tol``, ``cclip_tau``, ``cclip_iters``,
            ``norm_bound_radius``.  Krum, Multi-Krum and Bulyan report the node ids they
            selected in the round's metrics (``robust_selected``).  Refused with FedLAW,
            SCAFFOLD, FedExP and ASNES (their steps need the weighted mean).
        dp_clip: DP-FedAvg (docs/privacy.md): every update is clipped to this norm (the
            initial clip with ``dp_target_quantile``), the clipped updates summed, Gaussian
            noise added and the sum divided by the nodes sampled per round ``m``; ``None``
            (default): no differential privacy.  The other ``dp_*`` arguments are
            ``fedopt simulate``'s ``--dp-*`` flags, same names and meanings:
            ``dp_noise_multiplier`` (``z``: noise std ``z`` times the clip),
            ``dp_target_quantile`` (adaptive clipping, Andrew et al. 2021), ``dp_delta``
            (the round's metrics carry ``dp_epsilon`` at this delta), ``dp_mode``
            (``"server"``, or ``"client"``: the current clip goes to the clients in the
            train ``ConfigRecord`` as ``"dp-clip"``, for them to clip to -- the server
            bounds every update all the same).  The simulator's mechanism and
            accountant are built (:class:`~fedopt_kernels.fl.privacy.RoundPrivacy`), so
            a round equals the simulator's on the same updates, and the round's metrics
            carry ``dp_clip``, ``dp_noise_std``, ``dp_unclipped_fraction`` (adaptive) and
            ``dp_epsilon`` (with noise), as results.json does.  Settings that would void
            the guarantee are refused, naming the argument, by the checks of
            ``fedopt simulate`` (:func:`~fedopt_kernels.fl.dp_settings.check_dp_settings`):
            data-size weighting (``weighting="uniform"`` is needed), SCAFFOLD, FedExP,
            ASNES, FedLAW, a robust ``aggregator``, noise without ``dp_delta``.
        dp_num_clients: with ``dp_clip``, required: ``n``, the nodes of the federation.
            Flower's ``FedAvg`` samples ``m = max(int(fraction_train n),
            min_train_nodes)`` of them uniformly without replacement, which the
            accountant models (``"fixed"``; ``"all"`` when ``m = n``); ``configure_train``
            refuses a round where the grid has another number of nodes.
        dp_clip_lr, dp_clip_count_stddev: adaptive clipping's ``eta_C`` (default 0.2)
            and ``sigma_b`` (default ``m / 20``), the simulator's defaults (it has no
            flags for them).
        dp_seed: the seed of the noise (round ``t``'s key is ``dp_noise_key(dp_seed,
            t)``: :class:`~fedopt_kernels.server.dp.DPAggregator`; the simulator uses its
            ``--seed``).
        **kwargs: Flower ``FedAvg``'s (``fraction_train``, ``fraction_evaluate``,
            ``min_train_nodes``, ``min_evaluate_nodes``, ``min_available_nodes``,
            ``weighted_by_key``, ``arrayrecord_key``, ``configrecord_key``,
            ``train_metrics_aggr_fn``, ``evaluate_metrics_aggr_fn``).
    """

    def __init__(self, model: nn.Module, server: Union[S.ServerOptimizer, S.FedLAW, ServerFactory], *,
                 scaffold: bool = False, scaffold_num_clients: Optional[int] = None, weighting: str = "auto",
                 on_round: Optional[Callable[[int], None]] = None, on_bad_reply: str = "exclude",
                 max_weight_share: Optional[float] = None, read_in_place: bool = True, aggregator: str = "mean",
                 trim_beta: Optional[float] = None, byzantine_f: Optional[int] = None, krum_m: Optional[int] = None,
                 geomed_iters: Optional[int] = None, geomed_tol: Optional[float] = None,
                 cclip_tau: Optional[float] = None, cclip_iters: Optional[int] = None,
                 norm_bound_radius: Optional[float] = None, dp_clip: Optional[float] = None,
                 dp_noise_multiplier: float = 0.0, dp_target_quantile: Optional[float] = None,
                 dp_delta: Optional[float] = None, dp_mode: str = "server", dp_num_clients: Optional[int] = None,
                 dp_clip_lr: Optional[float] = None, dp_clip_count_stddev: Optional[float] = None,
                 dp_seed: int = 0, **kwargs):
        robust = _robust_aggregator(aggregator, dict(
            trim_beta=trim_beta, byzantine_f=byzantine_f, krum_m=krum_m, geomed_iters=geomed_iters,
            geomed_tol=geomed_tol, cclip_tau=cclip_tau, cclip_iters=cclip_iters, norm_bound_radius=norm_bound_radius))
        dp = dict(clip=dp_clip, noise_multiplier=dp_noise_multiplier, target_quantile=dp_target_quantile,
                  delta=dp_delta, mode=dp_mode, clip_lr=dp_clip_lr, clip_count_stddev=dp_clip_count_stddev)
        _check_flower_arguments(kwargs)  # Flower's FedAvg takes them as given
        super().__init__(**kwargs)
        self.dp_num_clients = dp_num_clients
        self._check_dp_arguments(robust, aggregator, dp, dp_seed)  # before the model is taken over
        self.read_in_place = bool(read_in_place)
        if on_bad_reply not in BAD_REPLY_POLICIES:
            raise ValueError(f"on_bad_reply must be one of {BAD_REPLY_POLICIES}, got {on_bad_reply!r}")
        if max_weight_share is not None and (isinstance(max_weight_share, bool) or not isinstance(
                max_weight_share, (int, float)) or not 0.0 < max_weight_share <= 1.0):
            raise ValueError(f"max_weight_share must be None or a number in (0, 1], got {max_weight_share!r}")
        self.on_bad_reply = on_bad_reply
        self.max_weight_share = None if max_weight_share is None else float(max_weight_share)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not any(True for _ in model.parameters()):
            raise ValueError("the model has no parameters")
        self.model = model
        self.x_global = flatten_parameters_(model)  # Parameter objects are kept: optimizers stay valid
        self.layout = parameters_layout(model)
        self.buffers_layout = buffers_layout(model)
        self.device = self.x_global.device
        params = [p for _, p in model.named_parameters()]
        if isinstance(server, S.FedLAW):
            if server.model is not model:
                raise ValueError("the FedLAW server must be built over the strategy's model")
        elif isinstance(server, S.ServerOptimizer):
            owned = {id(p) for g in server.param_groups for p in g["params"]}
            if owned != {id(p) for p in params} or server.numel != self.layout.numel:
                raise ValueError("the server optimizer must be built over exactly the model's parameters")
        elif callable(server):
            server = server(params)
            if not isinstance(server, S.ServerOptimizer):
                raise TypeError(f"the server factory returned {type(server).__name__}, not a ServerOptimizer")
        else:
            raise TypeError("server must be a ServerOptimizer, a FedLAW or a callable params -> ServerOptimizer")
        if isinstance(server, S.ServerOptimizer):
            order = [p for g in server.param_groups for p in g["params"]]
            if [id(p) for p in order] != [id(p) for p in params]:
                raise ValueError("the server optimizer must hold the model's parameters in named_parameters() "
                                 "order (build it from model.parameters())")
        if scaffold_num_clients is not None and (not isinstance(scaffold_num_clients, int) or scaffold_num_clients < 1):
            raise ValueError(f"scaffold_num_clients must be a positive int, got {scaffold_num_clients!r}")
        self.scaffold = bool(scaffold)
        self.scaffold_num_clients = scaffold_num_clients
        self.robust: Optional[RobustAggregator] = robust  # None: the weighted mean
        if robust is not None:
            if not isinstance(server, S.ServerOptimizer):
                raise ValueError(f"aggregator {aggregator!r} needs a server optimizer that takes the clients' "
                                 "updates; FedLAW learns its own aggregation weights from the client models")
            if self.scaffold:
                raise ValueError(f"aggregator {aggregator!r} cannot be used with scaffold=True: SCAFFOLD's control "
                                 "variate averages every client's correction, poisoned ones included")
            refuse_robust_statistics(server, aggregator)  # FedExP, ASNES, max_client_norm: refused here
            server.aggregator = robust
        self.weighting = S.resolve_weighting(weighting, _algorithm_of(server, self.scaffold))
        self.privacy: Optional[RoundPrivacy] = None  # DP-FedAvg's mechanism and accountant (the simulator's)
        if dp_clip is not None:  # now the checks that need the algorithm and its weighting
            m = self.dp_clients_per_round
            check_dp_settings(**dp, algo=_algorithm_of(server, self.scaffold), weighting=weighting,
                              resolved_weighting=self.weighting, clients=dp_num_clients, per_round=m,
                              names=PYTHON_NAMES)
            self.privacy = RoundPrivacy.attach(server, **dp, seed=dp_seed, clients=dp_num_clients, per_round=m)
        # the one server round (fedopt_kernels.server.round): the simulator runs the same
        self.round = S.ServerRound(server, self.weighting, self.max_weight_share)
        self.c: Optional[torch.Tensor] = torch.zeros_like(self.x_global) if self.scaffold else None
        self._scaffold_m: Optional[int] = None
        self.on_round = on_round
        self._sent: Optional[ArrayRecord] = None  # the record this strategy produced last
        self._keys: Optional[List[str]] = None  # keys (and order) of the global ArrayRecord
        self._rows: Optional[torch.Tensor] = None  # reusable [C, N] CPU buffer (the copying path)
        self._snapshot: Optional[torch.Tensor] = None  # x_global before a SCAFFOLD step (see _base)
        self.last_stats = None  # ServerStats (or FedLAWRound) of the last round
        self.last_aggregation_time: Optional[float] = None

    # ------------------------------------------------------------------ info
    @property
    def server(self):
        """The server algorithm (a :class:`~fedopt_kernels.server.ServerOptimizer` or a
        :class:`~fedopt_kernels.server.FedLAW`) of :attr:`round`."""
        return self.round.server

    @property
    def optimizer(self) -> Optional[S.ServerOptimizer]:
        """:attr:`server` where it takes the clients' updates, else None."""
        return self.server if self.round.takes == "updates" else None

    def _check_dp_arguments(self, robust, aggregator: str, dp: dict, seed) -> None:
        """The ``dp_*`` arguments, as far as they can be checked before the server exists
        (the algorithm and its weighting are checked once it does)."""
        n = self.dp_num_clients
        if dp["clip"] is None:
            check_dp_settings(**dp, algo="", weighting="", resolved_weighting="", clients=1, per_round=1,
                              names=PYTHON_NAMES)  # refuses any other dp_* given without dp_clip
            if n is not None:
                raise ValueError("dp_num_clients needs dp_clip (the clip C): it is the population differential "
                                 "privacy is accounted over")
            return
        if robust is not None:
            raise ValueError(robust_with_dp_error(aggregator, PYTHON_NAMES))
        if n is None:
            raise ValueError("dp_clip needs dp_num_clients, the number of nodes in the federation, which Flower "
                             "samples from each round: the privacy accountant needs it")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"dp_num_clients must be a positive integer, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"dp_seed must be an integer >= 0, got {seed!r}")
        m = self.dp_clients_per_round
        if m > n:
            raise ValueError(f"the nodes sampled per round, max(int(fraction_train * dp_num_clients), "
                             f"min_train_nodes) = {m}, exceed dp_num_clients = {n}")
        check_dp_settings(**dp, algo="", weighting="uniform", resolved_weighting="uniform", clients=n, per_round=m,
                          names=PYTHON_NAMES)

    @property
    def dp_clients_per_round(self) -> Optional[int]:
        """``m``, the nodes Flower's ``FedAvg`` samples per round out of
        ``dp_num_clients`` (``max(int(fraction_train n), min_train_nodes)``): DP-FedAvg's
        divisor and the accountant's sample; None without ``dp_num_clients``."""
        if self.dp_num_clients is None:
            return None
        return max(int(self.dp_num_clients * self.fraction_train), self.min_train_nodes)

    @property
    def fedlaw(self) -> Optional[S.FedLAW]:
        """:attr:`server` where it takes the client models (FedLAW), else None."""
        return self.server if self.round.takes == "models" else None

    @property
    def algorithm(self) -> str:
        """The algorithm name (``fedopt simulate``'s) whose weighting ``"auto"`` takes:
        ``scaffold`` with ``scaffold=True``, else by the server's class in
        :data:`fedopt_kernels.server.ALGORITHMS` (a subclass counts as its base; an
        unknown optimizer as ``fedavg``)."""
        return _algorithm_of(self.server, self.scaffold)

    def summary(self) -> None:
        """Log the server optimizer, then Flower ``FedAvg``'s summary."""
        srv = self.server
        if hasattr(srv, "param_groups"):
            hyper = {k: v for k, v in srv.param_groups[0].items() if k != "params"}
        else:  # FedLAW keeps its hyperparameters as attributes
            hyper = {k: getattr(srv, k) for k in ("learn", "server_epochs", "lr", "betas", "swa")}
        desc = f"{type(srv).__name__}({', '.join(f'{k}={v}' for k, v in hyper.items())})"
        log(INFO, "\t├──> fedopt_kernels server: %s", desc)
        log(INFO, "\t│\t├── model: %d parameters in %d tensors (%s, %s)", self.layout.numel, len(self.layout),
            self.layout.dtype, self.device)
        log(INFO, "\t│\t├── client weighting: %s", self.weighting)
        log(INFO, "\t│\t├── SCAFFOLD control variates: %s", "on" if self.scaffold else "off")
        log(INFO, "\t│\t└── differential privacy: %s", "off" if self.privacy is None else self.privacy.meta())
        super().summary()

    def global_arrays(self) -> ArrayRecord:
        """The current global model as an ``ArrayRecord`` (``state_dict`` keys)."""
        return tensors_to_arrayrecord(self._named_state(self._keys))

    def load_global_arrays(self, arrays: ArrayRecord) -> None:
        """Make ``arrays`` (``state_dict`` keys; every parameter present) the global
        model: ``configure_train`` does this with the record it sends, unless it is the
        one this strategy returned last round."""
        load_arrayrecord_(self.model, arrays)
        self._keys = list(arrays.keys())
        self._sent = arrays

    def _named_state(self, keys: Optional[Sequence[str]]):
        state = self.model.state_dict()
        keys = list(state.keys()) if keys is None else keys
        return [(k, state[k]) for k in keys]

    # ------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Load ``arrays`` into the server's model (unless it is the record this
        strategy returned last round), then sample and build the messages as Flower's
        ``FedAvg`` does (plus SCAFFOLD's ``c``)."""
        if arrays is not self._sent:
            self.load_global_arrays(arrays)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if self.privacy is not None and messages:
            self._check_dp_sampling(len(messages), len(list(grid.get_node_ids())))
            if self.privacy.aggregator.mode == "client":  # the clip the clients clip to (one host read)
                clip = float(self.privacy.aggregator.clip)
                for msg in messages:
                    msg.content[self.configrecord_key][DP_CLIP_KEY] = clip
        if self.scaffold and messages:
            if self.scaffold_num_clients is not None:
                self._scaffold_m = self.scaffold_num_clients
            else:
                self._scaffold_m = len(list(grid.get_node_ids()))
            c_record = tensors_to_arrayrecord(
                (s.name, self.c[s.offset:s.offset + s.numel].view(s.shape)) for s in self.layout.slots)
            for msg in messages:
                msg.content[SCAFFOLD_KEY] = c_record
        return messages

    def _check_dp_sampling(self, sampled: int, connected: int) -> None:
        """Refuse a round whose sampling the accountant does not model: ``m`` of
        ``dp_num_clients`` nodes, uniformly without replacement."""
        n, m = self.dp_num_clients, self.dp_clients_per_round
        if connected != n or sampled != m:
            raise ValueError(f"differential privacy is accounted for {m} of dp_num_clients = {n} nodes sampled per "
                             f"round, but this round sampled {sampled} of {connected} connected nodes: the accountant "
                             "would report a wrong epsilon; set dp_num_clients to the federation's size")

    def _order(self, replies: List[Message]) -> List[Message]:
        def key(msg: Message):
            for rec in msg.content.config_records.values():
                if ORDER_KEY in rec:
                    return (0, int(rec[ORDER_KEY]), int(msg.metadata.src_node_id))
            return (1, 0, int(msg.metadata.src_node_id))

        return sorted(replies, key=key)

    def _rows_buffer(self, C: int) -> torch.Tensor:
        N = self.layout.numel
        if self._rows is None or tuple(self._rows.shape) != (C, N):
            self._rows = None  # free the old one first
            self._rows = torch.empty(C, N, dtype=self.layout.dtype, pin_memory=self.device.type == "cuda")
        return self._rows

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """Aggregate the replies with the fused kernels and the server optimizer."""
        replies = list(replies)
        self._check_and_log_replies(replies, is_train=True, validate=False)  # Flower's log of the round
        screened = screen_train_replies(replies, server_round=server_round, layout=self.layout,
                                        allow_extra=list(self.model.state_dict().keys()),
                                        weighted_by_key=self.weighted_by_key,
                                        lr_sum_key=LR_SUM_KEY if self.scaffold else None)
        if screened.excluded:
            listed = "; ".join(f"node {n}: {reason} ({detail})" for n, reason, detail in screened.excluded)
            if self.on_bad_reply == "raise":
                raise AggregationError(reason=f"round {server_round}: bad replies (on_bad_reply='raise'): {listed}")
            log(WARNING, "aggregate_train: round %d left out %d repl%s: %s", server_round, len(screened.excluded),
                "y" if len(screened.excluded) == 1 else "ies", listed)
        if not screened.kept:
            if not replies:
                return None, None
            raise AggregationError(reason=f"round {server_round}: no usable reply among {len(replies)}: "
                                          + "; ".join(f"node {n}: {reason} ({detail})"
                                                      for n, reason, detail in screened.excluded))
        t0 = time.perf_counter()
        if self.on_round is not None:
            self.on_round(server_round)
        valid = self._order(screened.kept)
        contents = [m.content for m in valid]
        nodes = [int(m.metadata.src_node_id) for m in valid]
        records = [next(iter(c.array_records.values())) for c in contents]
        metrics = [next(iter(c.metric_records.values())) for c in contents]
        names = [f"the ArrayRecord of node {n}" for n in nodes]
        weights = [float(m[self.weighted_by_key]) for m in metrics]  # screened: finite, >= 0
        if sum(weights) <= 0 and self.weighting == "size":
            raise AggregationError(reason=f"round {server_round}: the '{self.weighted_by_key}' of every usable "
                                          "reply is 0")
        # the round's weights, once: the sizes as float64 (None: uniform), capped under max_weight_share
        round_weights = self.round.weights(torch.tensor(weights, dtype=torch.float64))
        C = len(records)
        on_cpu = self.device.type == "cpu"
        updates = self.round.takes == "updates"  # D_i = x_global - x_i, or the client models (FedLAW)

        with torch.no_grad():
            try:
                # D_i = x_global - x_i read where the replies lie (CPU), else one pass per array into
                # [C, N] rows: D_i straight from the client's bytes (CPU), or the client models (FedLAW,
                # or an accelerator: subtracted there after one transfer).
                U = None
                if on_cpu and self.read_in_place:  # FedLAW: the models themselves, no base
                    U = arrayrecords_as_pieces(records, self.layout, names=names,
                                               subtract_from=self._base() if updates else None)
                if U is None:
                    rows = stack_arrayrecords(records, self.layout, out=self._rows_buffer(C), names=names,
                                              subtract_from=self.x_global if (updates and on_cpu) else None)
                    U = rows if on_cpu else rows.to(self.device, non_blocking=True)
                    if updates and not on_cpu:
                        torch.sub(self.x_global, U, out=U)
                buffers = self._client_buffers(records)
            except (ValueError, TypeError) as exc:
                raise AggregationError(reason=str(exc)) from None
            lr_sums = self._lr_sums(metrics) if self.scaffold else None  # checked before anything changes
            scaffold_m = self._scaffold_clients() if self.scaffold else None
            D = U
            if self.scaffold and not updates:  # D_i = x_global - x_i before the step moves x_global
                D = (ClientPieces(U.pieces, subtract_from=self._base()) if isinstance(U, ClientPieces)
                     else self.x_global - U)
            stats = self.round.step(U, round_weights)
            self.last_stats = stats.stats
            server_metrics = self._read_round(stats, nodes)
            excluded = stats.excluded
            if self.scaffold:  # after the step: a client it excluded never reaches c
                S.scaffold_control_update_(self.c, D, lr_sums, num_clients=scaffold_m, excluded=excluded)
            if buffers is not None and not self.server.keeps_buffers:
                # with the round's weights (the step's, capped); FedLAW's model keeps its proxy-trained statistics
                current = buffers_to_vector(self.model).to(buffers.device)
                vector_to_buffers(self.round.buffers(buffers, round_weights, current, excluded), self.model)
        out = tensors_to_arrayrecord(self._named_state(self._keys))
        self._sent = out
        if server_metrics["excluded_clients"] and excluded is not None:  # the clients that counted, as the simulator
            mask = excluded.tolist()  # read only when the step left a NaN/Inf update out
            contents = [c for c, e in zip(contents, mask) if not e] or contents
        try:
            agg = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except (KeyError, TypeError, ValueError) as exc:  # replies whose other metrics differ: keep the round
            log(WARNING, "aggregate_train: the clients' metrics could not be averaged (%s)", exc)
            agg = MetricRecord()
        counts = screened.counts()
        counts["nonfinite"] = server_metrics["excluded_clients"]
        server_metrics["excluded_clients"] = sum(counts.values())
        for reason in REASONS:
            server_metrics[f"excluded_{reason}"] = counts.get(reason, 0)
        for k, v in server_metrics.items():
            agg[k] = v
        if self.privacy is not None:  # dp_clip, dp_noise_std, dp_unclipped_fraction, dp_epsilon: results.json's
            for k, v in self.privacy.record().items():
                agg[k] = v
        if self.robust is not None and self.robust.selects:  # the node ids whose updates entered
            agg["robust_selected"] = self.robust.record(nodes)["robust_selected"]
        self.last_aggregation_time = time.perf_counter() - t0
        return out, agg

    def _base(self) -> torch.Tensor:
        """What the replies read in place are subtracted from: ``x_global`` itself, read
        by the aggregation before the step moves it; with SCAFFOLD, which reads the
        updates again after the step, a snapshot (``O(N)``, one buffer kept)."""
        if not self.scaffold:
            return self.x_global
        if self._snapshot is None:
            self._snapshot = torch.empty_like(self.x_global)
        return self._snapshot.copy_(self.x_global)

    def _client_buffers(self, records: List[ArrayRecord]) -> Optional[torch.Tensor]:
        L = self.buffers_layout
        if len(L) == 0 or not all(all(s.name in r for s in L.slots) for r in records):
            return None  # no buffers, or the clients do not send them: keep the server's
        B = stack_arrayrecords(records, L)
        return B.to(self.device) if self.device.type != "cpu" else B

    def _scaffold_clients(self) -> int:
        """``M`` of SCAFFOLD's update: the one ``configure_train`` saw, else
        ``scaffold_num_clients``."""
        m = self._scaffold_m if self._scaffold_m is not None else self.scaffold_num_clients
        if m is None:
            raise AggregationError(reason="scaffold=True: the number of clients M is unknown (aggregate_train "
                                          "before configure_train): pass scaffold_num_clients")
        return m

    def _lr_sums(self, metrics: List[MetricRecord]) -> List[float]:
        """Each reply's ``lr_sum`` (SCAFFOLD's ``K eta_l``)."""
        out = []
        for m in metrics:
            if LR_SUM_KEY not in m:
                raise AggregationError(reason=f"scaffold=True needs '{LR_SUM_KEY}' in every reply's MetricRecord "
                                              "(use fedopt_kernels.integrations.flower.FedNARClient)")
            out.append(float(m[LR_SUM_KEY]))
        return out

    def _read_round(self, stats: S.ServerRoundStats, nodes: List[int]) -> Dict[str, object]:
        """The round's statistics as a ``MetricRecord``'s values (one host sync; flags as
        0/1), and a warning naming the nodes whose results it left out (NaN/Inf)."""
        out = stats.read()
        for key, value in out.items():
            if isinstance(value, bool):
                out[key] = int(value)
        excluded = stats.excluded.cpu().tolist()
        if any(excluded):
            what = "update(s)" if self.round.takes == "updates" else "model(s)"
            log(WARNING, "aggregate_train: left out the %s of node(s) %s (NaN/Inf; nonfinite)%s", what,
                [n for n, e in zip(nodes, excluded) if e], "; round skipped" if out["server_skipped"] else "")
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The server's state (global model, optimizer state, SCAFFOLD's ``c``)."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scaffold_c": self.c.clone() if self.c is not None else None,
            "keys": list(self._keys) if self._keys is not None else None,
            "robust": self.robust.state_dict() if self.robust is not None else None,
            "privacy": self.privacy.state_dict() if self.privacy is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`; pass :meth:`global_arrays` as the
        ``initial_arrays`` of :meth:`start`."""
        with torch.no_grad():
            own = self.model.state_dict()
            for k, v in state["model"].items():
                own[k].copy_(v)
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.c is not None and state.get("scaffold_c") is not None:
            self.c.copy_(state["scaffold_c"])
        if self.robust is not None and state.get("robust") is not None:
            self.robust.load_state_dict(state["robust"])
        if self.privacy is not None and state.get("privacy") is not None:
            self.privacy.load_state_dict(state["privacy"])
        self._keys = state.get("keys")
        self._sent = None


# ---------------------------------------------------------------------------- named strategies
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


def _robust_aggregator(rule: str, given: dict) -> Optional[RobustAggregator]:
    """The strategy's ``aggregator=`` and its parameters, by ``fedopt simulate``'s
    names (``trim_beta``, ``byzantine_f``, ...: :data:`fedopt_kernels.fl.config.AGGREGATOR_PARAMS`),
    as a :class:`~fedopt_kernels.server.RobustAggregator` (None for ``"mean"``); a
    parameter given for another rule is refused by name."""
    if rule not in AGGREGATORS:
        raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {rule!r}")
    params = {}
    for name, value in given.items():
        if value is None:
            continue
        rules, param = AGGREGATOR_PARAMS[name]
        if rule not in rules:
            raise ValueError(f"{name} applies to aggregator {' / '.join(rules)}, got aggregator {rule!r}")
        params[param] = value
    if rule == "mean":
        return None
    if rule == "trimmed-mean":
        params.setdefault("beta", TRIM_BETA)
    return RobustAggregator(rule, **params)


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
    more at construction).  ``loss_fn(output, target) -> scalar``.  The other arguments
    are :class:`fedopt_kernels.server.FedLAW`'s, then Flower ``FedAvg``'s.
    """

    def __init__(self, model: nn.Module, proxy_loader, loss_fn: Callable, *, learn: str = D.FEDLAW["learn"],
                 server_epochs: int = D.FEDLAW["server_epochs"], lr: float = D.FEDLAW["lr"],
                 betas: Tuple[float, float] = D.FEDLAW["betas"],
                 swa: bool = False, swa_start: int = 5, swa_lr: float = 0.05,
                 lr_step: Optional[Tuple[int, float]] = (20, 0.5), train_mode: bool = True,
                 backend: Optional[str] = None, **kwargs):
        self._proxy_fn = None
        loader = proxy_loader
        if callable(proxy_loader) and not hasattr(proxy_loader, "__iter__"):
            self._proxy_fn = proxy_loader
            loader = proxy_loader(1)
        fedlaw = S.FedLAW(model, loader, loss_fn, learn=learn, server_epochs=server_epochs, lr=lr, betas=betas,
                          swa=swa, swa_start=swa_start, swa_lr=swa_lr, lr_step=lr_step, train_mode=train_mode,
                          backend=backend)
        user_hook = kwargs.pop("on_round", None)

        def on_round(server_round: int) -> None:
            if self._proxy_fn is not None:
                self.server.proxy_loader = self._proxy_fn(server_round)
            if user_hook is not None:
                user_hook(server_round)

        super().__init__(model, fedlaw, on_round=on_round, **kwargs)


def _algorithm_of(server, scaffold: bool) -> str:
    """The registry name of ``server``'s algorithm (``scaffold`` with SCAFFOLD; the first
    name of its class or nearest base in :data:`fedopt_kernels.server.ALGORITHMS`, else
    ``fedavg``)."""
    if scaffold:
        return "scaffold"
    for cls in type(server).__mro__:
        for name, algo in S.ALGORITHMS.items():
            if algo.cls is cls:
                return name
    return "fedavg"


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
