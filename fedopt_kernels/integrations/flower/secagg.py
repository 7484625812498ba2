"""Secure aggregation: the fused server steps under Flower's SecAgg+.

Under secure aggregation the server never sees one client's update: each client masks
what it sends, and the masks cancel only in the sum (SecAgg+, Bell et al. CCS 2020,
Flower's ``SecAggPlusWorkflow`` and ``secaggplus_mod``).  Flower 1.41 runs SecAgg+ only
as a *legacy* workflow: ``SecAggPlusWorkflow`` requires a ``LegacyContext`` and calls
``configure_fit`` / ``aggregate_fit`` of a ``flwr.server.strategy.Strategy``, and
``secaggplus_mod`` wraps a ClientApp that answers legacy ``FitIns`` with a ``FitRes``.
The Message-API strategies (``flwr.serverapp.strategy``, what
:class:`~fedopt_kernels.integrations.flower.FusedStrategy` is) cannot run under it:
their ``start`` drives the Grid itself and their ``aggregate_train`` expects each
client's reply.  So this module offers the same fused server steps behind Flower's
legacy interface:

* :class:`SecAggPlusFusedStrategy` -- a legacy ``Strategy`` whose ``aggregate_fit``
  receives the unmasked weighted mean (all the workflow reveals) and applies one fused
  server step to it (:class:`~fedopt_kernels.server.SecureSumAggregator`): FedAvg,
  FedAvgM, FedAdam, FedYogi, FedAdagrad, FedExP and ASNES.  Combinations that need
  individual updates are refused when it is built, with the reason: robust
  aggregators, FedLAW (it weighs each client's model), per-client norm bounds
  (``max_client_norm``), per-client NaN exclusion records;
* :class:`SecAggFedNARClient` -- the ClientApp side: FedNAR local training
  (:class:`~fedopt_kernels.integrations.flower.FedNARClient`), answering with its update
  ``D_i = x_global - x_i`` and, for FedExP and ASNES, ``||D_i||^2`` spread over a few
  more masked values (``norm_slots``), so the secure sum also carries
  ``sum_i p_i ||D_i||^2`` -- their step needs that and no single norm;
* :func:`secaggplus_workflow` -- Flower's ``DefaultWorkflow`` with SecAgg+ as its fit
  workflow, whose replies are screened first: a masked vector of the wrong shape or
  dtype (a malformed or hostile reply) is treated as a dropout, so SecAgg+ removes its
  masks from the sum (up to its reconstruction threshold) and the round goes on
  without it, recorded, instead of crashing the server or corrupting the sum.

What SecAgg+ does to the numbers: each value is clipped to ``[-clipping_range,
clipping_range]`` (default 8) and quantized to ``quantization_range`` levels (default
2^22: a step of 3.8e-6 at the default range) before masking, so the mean the step
receives differs from the plain float mean by that quantization, not by masking
(the masks cancel exactly, modulo 2^32).  Client weights (``num_examples``) travel in
clear in Flower's ``FitRes``; with ``weighting="uniform"`` every client says 1.

Compression under SecAgg+ (``codec=``): a masked value is a dense field element whatever
a client encoded, and codes on per-client scales (int8/int4/fp8 per block) or on
per-client coordinates (top-k) do not sum to anything under masks -- only values on ONE
shared grid do, which is what SecAgg+'s own quantization is.  So the codec runs on the
client before masking: each client sends ``decode(encode(D_i))`` (the same lossy step,
e.g. for error feedback), SecAgg+ quantizes it on its shared grid, and the unmasked mean
is ``decode_aggregate`` of the clients' codes within SecAgg+'s quantization bound.  It
saves no bytes on the wire (the masked vector is int64 whatever the codec).  Refused
before the run: a codec with central DP (``decode(encode(D_i))`` of a clipped update can
exceed the clip -- int8 rounds up to half a step per value -- so the sum's sensitivity
would no longer be ``clip``).

Central DP under secure aggregation (:class:`SecureDP`): each client clips its update to
``clip`` before masking it, and the server adds ``N(0, (z clip)^2)`` to the unmasked sum
and divides by the expected number of clients (DP-FedAvg's fixed denominator, as
:class:`~fedopt_kernels.server.DPAggregator`), with the project's counter-based noise.  The
server cannot check that a client clipped -- it never sees one update -- so the guarantee
rests on the clients clipping, as in Flower's ``DifferentialPrivacyClientSideFixedClipping``
with SecAgg+; SecAgg+ itself bounds each value only by its clipping range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.clientapp import ClientApp
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.strategy import Strategy
from torch import nn

from ...compression import Codec
from ...ops import compressed as codecs
from ...ops.dp_noise import gaussian_noise_
from ...ops.validation import check_real
from ...server import LocalAggregator, SecureSumAggregator, ServerOptimizer
from ...server.differential_privacy.dp import dp_noise_key, refuse_client_statistics
from .client import FedNARClient
from .strategy import DP_CLIP_KEY

__all__ = ["SecAggPlusFusedStrategy", "SecAggFedNARClient", "secaggplus_workflow", "SecureDP", "NORM_SLOTS_KEY",
           "WEIGHT_KEY", "refuse_under_secure_aggregation"]

NORM_SLOTS_KEY = "fedopt-norm-slots"  # FitIns config: spread ||D_i||^2 over this many extra masked values
WEIGHT_KEY = "fedopt-weighting"  # FitIns config: "data" (num_examples = samples) or "uniform" (1)
CODEC_KEY = "fedopt-codec"  # FitIns config: the client sends decode(encode(D_i)) with this codec ("" = none)
CODEC_BLOCK_KEY = "fedopt-codec-block"  # ... its block (int8, int4, fp8)
CODEC_FRACTION_KEY = "fedopt-codec-fraction"  # ... top-k's fraction kept
ROUND_KEY = "server-round"


@dataclass(frozen=True)
class SecureDP:
    """Central DP of the secure sum (DP-FedAvg, McMahan et al. 2018, fixed denominator):
    clients clip ``D_i`` to ``clip``; the server computes ``(sum_i D_i + N(0, (z clip)^2
    I)) / expected_clients`` from the unmasked sum, the noise keyed by ``(seed, round)``
    (:func:`fedopt_kernels.server.differential_privacy.dp.dp_noise_key`).  Uniform weights only (each client's
    weight 1 keeps the sensitivity at ``clip``); FedExP and ASNES are refused (their step
    reads the clients' norms, which the mechanism does not privatise).  Account the rounds
    with :class:`~fedopt_kernels.server.differential_privacy.privacy_accountant.PrivacyAccountant`."""

    clip: float
    noise_multiplier: float
    expected_clients: float
    seed: int = 0

    def __post_init__(self):
        check_real(self.clip, "clip", low=0.0, low_open=True)
        check_real(self.noise_multiplier, "noise_multiplier", low=0.0, low_open=True)
        check_real(self.expected_clients, "expected_clients", low=0.0, low_open=True)


def refuse_under_secure_aggregation(optimizer) -> None:
    """Raise ``ValueError`` naming why ``optimizer`` cannot run under secure aggregation,
    where the server holds only the sum of the clients' updates."""
    if not isinstance(optimizer, ServerOptimizer):
        raise ValueError(f"{type(optimizer).__name__} cannot run under secure aggregation: it needs each client's "
                         "model (FedLAW learns one weight per client on a proxy set); the server sees only the sum")
    if not isinstance(optimizer.aggregator, LocalAggregator):
        raise ValueError(f"the aggregator {optimizer.aggregator!r} cannot run under secure aggregation: robust "
                         "aggregation (median, Krum, trimmed mean, ...) and per-client DP clipping read each client's "
                         "update; the server sees only the sum")
    if optimizer.max_client_norm is not None:
        raise ValueError("max_client_norm cannot run under secure aggregation: bounding each update's norm on the "
                         "server reads each update; clip on the clients instead")


class SecAggPlusFusedStrategy(Strategy):
    """A fused server optimizer behind Flower's legacy ``Strategy`` interface, for
    ``SecAggPlusWorkflow`` (:func:`secaggplus_workflow`).

    ``model``: the global model (updated in place); ``optimizer``: a
    :class:`~fedopt_kernels.server.ServerOptimizer` over its parameters (FedAvg, FedAvgM,
    FedAdam, FedYogi, FedAdagrad, FedExP, ASNES; refused otherwise, see
    :func:`refuse_under_secure_aggregation`).  ``fraction_train`` / ``min_train_nodes``:
    the nodes sampled a round (SecAgg+ needs at least 2).  ``weighting``: "uniform" or
    "data" (the clients' sample counts, which SecAgg+ also uses to weight the sum).
    ``norm_slots``: how many masked values carry ``||D_i||^2 / norm_slots`` for FedExP and
    ASNES (each value must stay within SecAgg+'s clipping range: ``norm_slots *
    clipping_range`` bounds the squared norm it can carry).  ``evaluate_fn(model, round)
    -> (loss, metrics)``: central evaluation after each round (optional).  ``codec`` (a
    :class:`fedopt_kernels.compression.Codec`: its name, block or top-k fraction; round to
    nearest, no rotation): each client sends ``decode(encode(D_i))`` through SecAgg+ (see
    the module); refused with ``dp``.
    """

    def __init__(self, model: nn.Module, optimizer, *, fraction_train: float = 1.0, min_train_nodes: int = 2,
                 weighting: str = "uniform", norm_slots: int = 16, dp: Optional[SecureDP] = None,
                 evaluate_fn: Optional[Callable[[nn.Module, int], Tuple[float, Dict]]] = None,
                 codec: Optional[Codec] = None):
        refuse_under_secure_aggregation(optimizer)
        if codec is not None:
            if not isinstance(codec, Codec):
                raise TypeError("codec must be None or a fedopt_kernels.compression.Codec (e.g. Codec('int8', "
                                f"block=256), Codec('topk', fraction=0.1)), got {type(codec).__name__}")
            if codec.stochastic or codec.rotation is not None:
                raise ValueError(f"codec={codec!r}: under SecAgg+ the client's decode(encode(D_i)) rounds to nearest "
                                 "without a rotation (stochastic=False, rotation=None)")
            if dp is not None:
                raise ValueError(f"codec={codec.name!r} cannot run with central DP under secure aggregation: "
                                 "decode(encode(D_i)) of a clipped update can exceed the clip, so the sum's "
                                 "sensitivity would no longer be dp.clip; compress without DP, or DP without a codec")
        if dp is not None:
            if not isinstance(dp, SecureDP):
                raise TypeError(f"dp must be a SecureDP, got {type(dp).__name__}")
            refuse_client_statistics(optimizer)
            if weighting != "uniform":
                raise ValueError("dp: DP-FedAvg under secure aggregation needs weighting='uniform' (a client's weight "
                                 "above 1 would raise the sum's sensitivity above the clip)")
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train!r}")
        if not isinstance(min_train_nodes, int) or min_train_nodes < 2:
            raise ValueError(f"min_train_nodes must be an int >= 2 (SecAgg+ needs two clients), got {min_train_nodes!r}")
        if weighting not in ("uniform", "data"):
            raise ValueError(f"weighting must be 'uniform' or 'data', got {weighting!r}")
        if not isinstance(norm_slots, int) or norm_slots < 1:
            raise ValueError(f"norm_slots must be an int >= 1, got {norm_slots!r}")
        self.model, self.optimizer = model, optimizer
        self.names = [n for n, _ in model.named_parameters()]
        self.fraction_train, self.min_train_nodes = fraction_train, min_train_nodes
        self.weighting, self.evaluate_fn, self.dp = weighting, evaluate_fn, dp
        self.norm_slots = norm_slots if optimizer.needs_client_sq_norms else 0
        self.codec = codec
        self.history: List[dict] = []
        self.last_mean: Optional[torch.Tensor] = None  # what the last step took (float64): the unmasked mean, noised under dp

    # -------------------------------------------------------------- legacy Strategy
    def _arrays(self) -> List[np.ndarray]:
        return [p.detach().cpu().numpy().copy() for p in self.model.parameters()]

    def initialize_parameters(self, client_manager):  # noqa: D102
        return ndarrays_to_parameters(self._arrays())

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: D102
        available = client_manager.num_available()
        n = max(self.min_train_nodes, int(available * self.fraction_train))
        clients = client_manager.sample(num_clients=n, min_num_clients=self.min_train_nodes)
        config = {ROUND_KEY: server_round, WEIGHT_KEY: self.weighting, NORM_SLOTS_KEY: self.norm_slots}
        if self.dp is not None:  # the clients clip to a hair under the clip, as DPAggregator's client mode
            config[DP_CLIP_KEY] = float(self.dp.clip) * (1 - 1e-5)
        if self.codec is not None:
            config[CODEC_KEY] = self.codec.name
            config[CODEC_BLOCK_KEY] = self.codec.block
            if self.codec.name == "topk":
                config[CODEC_FRACTION_KEY] = float(self.codec.fraction)
        return [(c, FitIns(parameters, dict(config))) for c in clients]

    def aggregate_fit(self, server_round, results, failures):  # noqa: D102
        record = {"round": server_round, "clients": len(results), "failures": len(failures)}
        if not results:
            record["server_skipped"] = True
            self.history.append(record)
            return None, {"server_skipped": 1}
        # Every result holds the same unmasked weighted mean (the workflow writes it into each)
        mean = parameters_to_ndarrays(results[0][1].parameters)
        shapes = [tuple(p.shape) for p in self.model.parameters()]
        if len(mean) != len(shapes) + (1 if self.norm_slots else 0) or any(
                tuple(a.shape) != s for a, s in zip(mean, shapes)):
            raise ValueError(f"round {server_round}: the secure sum has arrays of shapes "
                             f"{[tuple(a.shape) for a in mean]}, the model {shapes}")
        flat = torch.from_numpy(np.concatenate([a.reshape(-1).astype(np.float64) for a in mean[:len(shapes)]]))
        msq = torch.tensor(float(mean[-1].astype(np.float64).sum())) if self.norm_slots else None
        if msq is not None:
            record["mean_client_sq_norm"] = float(msq)
        weights = [float(res.num_examples) for _, res in results]
        if self.dp is not None:  # sum + N(0, (z C)^2), over the fixed denominator
            total = flat.to(torch.float32) * len(results)
            std = self.dp.noise_multiplier * self.dp.clip
            gaussian_noise_(total, std, dp_noise_key(self.dp.seed, server_round))
            flat = total.to(torch.float64) / self.dp.expected_clients
            record.update(dp_clip=float(self.dp.clip), dp_noise_std=std)
        self.last_mean = flat
        st = self.optimizer.step(None, weights, aggregator=SecureSumAggregator(flat, mean_client_sq_norm=msq))
        metrics = {k: float(v) for k, v in self.optimizer.round_stats(st).metrics.items()
                   if v is not None and v.dim() == 0}
        record.update(metrics)
        if self.evaluate_fn is not None:
            loss, more = self.evaluate_fn(self.model, server_round)
            record.update(test_loss=float(loss), **{k: float(v) for k, v in more.items()})
        self.history.append(record)
        return ndarrays_to_parameters(self._arrays()), metrics

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: D102
        return []  # central evaluation (evaluate_fn) only: nothing is asked of the clients

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: D102
        return None, {}

    def evaluate(self, server_round, parameters):  # noqa: D102
        return None


# ------------------------------------------------------------------ the workflow
class _ScreenedSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow whose masked-vector replies are checked first: a reply
    whose masked vector does not have the expected arrays (count, shapes, integer dtype)
    becomes an error reply, which SecAgg+ handles as a dropout (the node's masks are
    reconstructed from its neighbours' shares and removed, if the threshold allows).
    ``expected(round) -> [shapes]`` gives what a round's replies must hold."""

    def __init__(self, *args, expected: Callable[[], List[tuple]], **kwargs):
        super().__init__(*args, **kwargs)
        self._expected = expected
        self.rejected: List[Tuple[int, str]] = []  # (node id, reason), every round

    def collect_masked_vectors_stage(self, grid, context, state):  # noqa: D102
        return super().collect_masked_vectors_stage(_ScreeningGrid(grid, self), context, state)


class _ScreeningGrid:
    """The workflow's Grid, with the masked-vector replies screened on receipt."""

    def __init__(self, grid, workflow: _ScreenedSecAggPlusWorkflow):
        self._grid, self._workflow = grid, workflow

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error
        from flwr.common import bytes_to_ndarray

        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        expected = self._workflow._expected()
        sent = {m.metadata.message_id: m for m in messages}
        to_node = {m.metadata.dst_node_id: m for m in messages}
        answered = set()
        out = []
        for msg in replies:
            reason = None
            node = msg.metadata.src_node_id
            original = sent.get(msg.metadata.reply_to_message_id)
            if node == SUPERLINK_NODE_ID and node not in to_node:
                # the SuperLink's own reply in place of a node's (through a deployment: a node
                # that stopped its heartbeats); the node's missing reply is its dropout
                why = f"error {msg.error.code}: {msg.error.reason}" if msg.has_error() else "no error"
                self._workflow.rejected.append((node, f"the SuperLink answered in place of a node ({why})"))
                continue
            if original is None or original.metadata.dst_node_id != node or node in answered:
                # a reply to no message of this stage (replayed from an earlier one), from
                # another node than the one asked, or a second reply: never summed
                reason = (f"a reply to message {msg.metadata.reply_to_message_id!r}, which this stage did not send "
                          f"to node {node} (replayed or duplicated)")
                original = to_node.get(node)
                if original is None or node in answered:
                    self._workflow.rejected.append((node, reason))
                    continue  # nothing of this stage to answer: dropped
            elif not msg.has_error():
                try:
                    arrays = [bytes_to_ndarray(b) for b in msg.content.config_records[RECORD_KEY_CONFIGS][
                        Key.MASKED_PARAMETERS]]
                    shapes = [tuple(a.shape) for a in arrays]
                    # the first masked array is SecAgg+'s own weight factor: [1]
                    if shapes[1:] != expected or shapes[:1] != [(1,)]:
                        reason = f"masked vector of shapes {shapes}, expected [(1,)] + {expected}"
                    elif any(a.dtype.kind not in "iu" for a in arrays):
                        reason = f"masked vector of dtypes {sorted({str(a.dtype) for a in arrays})}, expected integers"
                except Exception as exc:  # noqa: BLE001 - a reply that cannot be read at all
                    reason = f"unreadable masked vector: {type(exc).__name__}: {exc}"
            answered.add(node)
            if reason is not None:
                self._workflow.rejected.append((node, reason))
                out.append(Message(Error(code=1, reason=reason), reply_to=original))
            else:
                out.append(msg)
        return out


def secaggplus_workflow(strategy: SecAggPlusFusedStrategy, *, num_shares=1.0, reconstruction_threshold=0.7,
                        clipping_range: float = 8.0, quantization_range: int = 2 ** 22,
                        max_weight: Optional[float] = None, timeout: Optional[float] = None) -> DefaultWorkflow:
    """Flower's ``DefaultWorkflow`` with a screened SecAgg+ as its fit workflow, for
    ``strategy``.  ``num_shares`` / ``reconstruction_threshold`` as Flower's (floats:
    fractions of the sampled nodes / of the shares): the round survives up to ``num_shares
    - reconstruction_threshold`` dropouts after the key exchange.  The workflow object is
    ``workflow.fit_workflow``; its ``rejected`` lists every screened-out reply.

    Precision: each client sends ``D_i * w_i / max_weight`` quantized with a step of ``2 *
    clipping_range / quantization_range`` (stochastic rounding), so the mean's error is
    below ``C * step * max_weight / sum_i w_i``.  ``max_weight`` (None: 1 for uniform
    weighting, where every ``w_i`` is 1 and the error is below one step; Flower's 1000 for
    data weighting) should be the largest client weight expected: a larger one costs
    precision, a smaller one overflows (Flower warns)."""
    if max_weight is None:
        max_weight = 1.0 if strategy.weighting == "uniform" else 1000.0
    def expected():
        shapes = [tuple(p.shape) for p in strategy.model.parameters()]
        return shapes + ([(strategy.norm_slots,)] if strategy.norm_slots else [])

    fit = _ScreenedSecAggPlusWorkflow(num_shares, reconstruction_threshold, clipping_range=clipping_range,
                                      quantization_range=quantization_range, max_weight=max_weight, timeout=timeout,
                                      expected=expected)
    return DefaultWorkflow(fit_workflow=fit)


# ------------------------------------------------------------------ the client side
class SecAggFedNARClient:
    """FedNAR local training answering SecAgg+'s legacy fit: ``app = client.app()`` is a
    ``ClientApp`` with ``secaggplus_mod``.  Per round it trains as
    :class:`~fedopt_kernels.integrations.flower.FedNARClient` does (the same arguments,
    the same bits of the trained model) and replies with ``D_i = x_global - x_i`` (float32
    arrays in the model's parameter order), plus ``||D_i||^2`` spread over the requested
    norm slots, and ``num_examples`` = its sample count ("data") or 1 ("uniform")."""

    def __init__(self, model_fn: Callable[[Context], nn.Module], data_fn, **kwargs):
        self.inner = FedNARClient(model_fn, data_fn, **kwargs)
        self.model_fn = model_fn

    def app(self) -> ClientApp:
        app = ClientApp(mods=[secaggplus_mod])
        app.train()(self.train)
        return app

    def train(self, msg: Message, context: Context) -> Message:
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        names = [n for n, _ in self.model_fn(context).named_parameters()]
        arrays = parameters_to_ndarrays(fitins.parameters)
        if len(arrays) != len(names):
            raise ValueError(f"the global model has {len(arrays)} arrays, this client's model {len(names)}")
        config = fitins.config
        server_round = int(config.get(ROUND_KEY, 1))
        inner_config = {"server-round": server_round}
        if DP_CLIP_KEY in config:  # FedNARClient clips its update to it before replying
            inner_config[DP_CLIP_KEY] = float(config[DP_CLIP_KEY])
        inner = Message(content=RecordDict({"arrays": ArrayRecord(dict(zip(names, (torch.from_numpy(a)
                                                                                    for a in arrays)))),
                                            "config": ConfigRecord(inner_config)}),
                        dst_node_id=msg.metadata.dst_node_id, message_type=MessageType.TRAIN)
        reply = self.inner.train(inner, context)
        trained = reply.content["arrays"]
        update = [(a.astype(np.float64) - trained[n].numpy().astype(np.float64)).astype(np.float32)
                  for n, a in zip(names, arrays)]
        if config.get(CODEC_KEY, ""):
            update = _encode_decode(update, config)
        slots = int(config.get(NORM_SLOTS_KEY, 0))
        if slots:
            q = float(sum(float(np.dot(u.reshape(-1).astype(np.float64), u.reshape(-1).astype(np.float64)))
                          for u in update))
            update.append(np.full((slots,), q / slots, dtype=np.float32))
        metrics = reply.content["metrics"]
        n = int(metrics["num-examples"]) if config.get(WEIGHT_KEY, "uniform") == "data" else 1
        fitres = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(update), n,
                        {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not math.isnan(v)})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


def _encode_decode(update: List[np.ndarray], config) -> List[np.ndarray]:
    """``decode(encode(D))`` of the whole update (the arrays concatenated in the model's
    order, as the server's mean is), split back into the arrays: what a compressing client
    sends through SecAgg+."""
    flat = torch.from_numpy(np.concatenate([u.reshape(-1) for u in update]))
    codec = str(config[CODEC_KEY])
    if codec == "topk":
        code = codecs.encode(flat, codec, fraction=float(config[CODEC_FRACTION_KEY]))
    else:
        code = codecs.encode(flat, codec, block=int(config[CODEC_BLOCK_KEY]))
    dense = codecs.decode(code).numpy()
    out, at = [], 0
    for u in update:
        out.append(dense[at:at + u.size].reshape(u.shape).astype(np.float32))
        at += u.size
    return out
