"""The client side: a Flower ``ClientApp`` ``train`` (and ``evaluate``) function that
trains with FedNAR, FedProx's proximal term and SCAFFOLD's correction.

:class:`FedNARClient` turns three small functions of yours into the functions a
``ClientApp`` registers::

    from flwr.clientapp import ClientApp
    from fedopt_kernels.integrations.flower import FedNARClient

    client = FedNARClient(model_fn=lambda ctx: Net(), data_fn=load_partition, eval_data_fn=load_test)
    app = ClientApp()
    app.train()(client.train)
    app.evaluate()(client.evaluate)

Per train message it builds the model (``model_fn(context)``), loads the global
``ArrayRecord`` into it (one copy per array), and runs the SAME local training as the
simulator (:class:`fedopt_kernels.fl.LocalTrainer`: the model's parameters as one flat
vector, ``local_steps`` fused FedNAR steps, FedProx's ``mu (x - x0)`` and SCAFFOLD's
``c - c_i`` added to the gradient before the clipped step, the local lr annealed by
``lr_decay^(round-1)``).  The batch order (and dropout) of round ``t`` at client
``k`` is seeded by ``(seed, t, k)`` exactly as :class:`fedopt_kernels.fl.Simulation`
seeds it, with ``k`` the node's ``partition-id`` and ``seed`` the run config's
``seed``: the same seed, data and model give the same client models as the simulator.

The reply holds the trained model's ``ArrayRecord`` (the keys of the one received --
Flower's convention, so the reply also works with Flower's own strategies), a
``MetricRecord`` (``num-examples``, ``train_loss``, ``clip_frequency``,
``clipped_steps``, ``skipped_steps``, ``lr_sum``) and a ``ConfigRecord`` ``"fedopt"``
with the ``partition-id`` (the fused strategies aggregate in that order) and the
``server-round`` it answers (a reply to another round is left out).

SCAFFOLD: when the train message carries the server's control variate (the strategy's
``scaffold=True``), the client's own ``c_i`` lives in ``context.state`` (an
``ArrayRecord`` under ``"fedopt-scaffold-ci"``, zeros at first) and is updated with
option II, ``c_i <- c_i + (x0 - x_end) / lr_sum - c``.

Hyperparameters come from a :class:`~fedopt_kernels.fl.LocalConfig`, by default read
from the run config (:func:`local_config_from_run_config`: ``local-steps``,
``batch-size``, ``local-lr``, ``lr-decay``, ``weight-decay``, ``wd-decay``,
``max-norm``, ``nar``, ``local-momentum``, ``prox-mu``, ``decay-beta``,
``decay-kind``, ``decay-per``, ``backend``).  A key the run config leaves out keeps
:class:`LocalConfig`'s default, which is the simulator's
(:data:`fedopt_kernels.defaults.LOCAL`: lr 0.05, lr decay 0.998, weight decay 1e-3, max
norm 10) -- so a client without run-config keys trains with FedNAR as ``fedopt
simulate`` does; ``prox-mu`` stays 0 (no proximal term) unless given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Tuple, Union

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from ...fl.engine.client import LocalConfig, LocalTrainer, RoundStats, ScaffoldState
from ...fl.seeds import batch_seed, init_seed
from ...ops.dp_noise import clip_updates_
from ...utils.flat import parameters_layout
from .compression import CODEC_KEY, EF_STATE_KEY, codec_from_config, codec_spec, reply_to_arrayrecord
from .records import (array_view, arrayrecord_to_vector, load_arrayrecord_, model_to_arrayrecord,
                      tensors_to_arrayrecord)
from .screening import ROUND_KEY
from .privacy import DP_CLIP_KEY
from .scaffold import LR_SUM_KEY, SCAFFOLD_KEY
from .strategy import ORDER_KEY

__all__ = ["FedNARClient", "local_config_from_run_config", "batch_seed", "init_seed", "RUN_CONFIG_KEYS",
           "SCAFFOLD_STATE_KEY", "REPLY_CONFIG_KEY"]

SCAFFOLD_STATE_KEY = "fedopt-scaffold-ci"
REPLY_CONFIG_KEY = "fedopt"

# LocalConfig field -> run config key
RUN_CONFIG_KEYS = {
    "steps": "local-steps", "batch_size": "batch-size", "lr": "local-lr", "lr_decay": "lr-decay",
    "weight_decay": "weight-decay", "wd_decay": "wd-decay", "max_norm": "max-norm", "nar": "nar",
    "momentum": "local-momentum", "prox_mu": "prox-mu", "decay_beta": "decay-beta", "decay_kind": "decay-kind",
    "decay_per": "decay-per", "backend": "backend",
}

Data = Tuple[torch.Tensor, torch.Tensor]


def local_config_from_run_config(run_config, base: Optional[LocalConfig] = None) -> LocalConfig:
    """A :class:`LocalConfig` from a Flower run config (keys of :data:`RUN_CONFIG_KEYS`;
    missing keys keep ``base``'s values, default :class:`LocalConfig`'s; ``backend = ""``
    means automatic)."""
    base = base if base is not None else LocalConfig()
    changes = {}
    for field, key in RUN_CONFIG_KEYS.items():
        if key in run_config:
            changes[field] = _run_config_value(field, key, run_config[key])
    return dataclasses.replace(base, **changes)


# what each run-config value may be: (kind, test, words); checked with the key named, as Flower
# passes the strings of `--run-config "local-lr=abc"` through unchanged
_RUN_CONFIG_RULES = {
    "steps": ("int", lambda v: v >= 1, "a positive integer"),
    "batch_size": ("int", lambda v: v >= 1, "a positive integer"),
    "lr": ("float", lambda v: v >= 0, "a number >= 0"),
    "lr_decay": ("float", lambda v: v > 0, "a number > 0"),
    "weight_decay": ("float", lambda v: v >= 0, "a number >= 0"),
    "wd_decay": ("float", lambda v: v > 0, "a number > 0"),
    "max_norm": ("float", lambda v: v > 0, "a number > 0"),
    "momentum": ("float", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "prox_mu": ("float", lambda v: v >= 0, "a number >= 0"),
    "decay_beta": ("float", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "nar": ("choice", ("co", "grad", "none"), "one of co, grad, none"),
    "decay_kind": ("choice", ("exponential", "linear"), "one of exponential, linear"),
    "decay_per": ("choice", ("step", "epoch"), "one of step, epoch"),
}


def _run_config_value(field: str, key: str, value):
    """``value`` of run-config ``key`` as :class:`LocalConfig`'s ``field`` wants it, or a
    ``ValueError`` naming the key, the value and what it must be."""
    if field == "backend":
        return value or None
    kind, rule, words = _RUN_CONFIG_RULES[field]
    if kind == "choice":
        if value not in rule:
            raise ValueError(f"run config {key!r} must be {words}, got {value!r}")
        return value
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
        if kind == "int":
            if not number.is_integer():
                raise ValueError
            number = int(number)
    except (TypeError, ValueError):
        raise ValueError(f"run config {key!r} must be {words}, got {value!r}") from None
    if not math.isfinite(number) or not rule(number):
        raise ValueError(f"run config {key!r} must be {words}, got {value!r}")
    return number


class FedNARClient:
    """Builds ``ClientApp`` train/evaluate functions (see the module docstring).

    Args:
        model_fn: ``model_fn(context) -> nn.Module``, the architecture (its initial
            values are overwritten by the global arrays).
        data_fn: ``data_fn(context) -> (x, y)``: this client's training data as tensors
            (inputs, int64 labels).  Called per message: cache it if it is costly.
        eval_data_fn: ``eval_data_fn(context) -> (x, y)`` for :meth:`evaluate`.
        config: a :class:`LocalConfig`, or ``config(context) -> LocalConfig``; default
            :func:`local_config_from_run_config` of the run config.
        loss_fn: ``loss_fn(output, target)``, mean over the batch (default cross-entropy).
        seed: the seed of the batch orders (default: the run config's ``seed``, else 0).
        client_id: ``client_id(context) -> int`` (default: ``node_config["partition-id"]``).
        device: where the client trains (default CPU).
        arrayrecord_key, configrecord_key: the keys the strategy uses (Flower's defaults).
    """

    def __init__(self, model_fn: Callable[[Context], nn.Module], data_fn: Callable[[Context], Data], *,
                 eval_data_fn: Optional[Callable[[Context], Data]] = None,
                 config: Union[LocalConfig, Callable[[Context], LocalConfig], None] = None,
                 loss_fn: Optional[Callable] = None, seed: Optional[int] = None,
                 client_id: Optional[Callable[[Context], int]] = None, device: Union[str, torch.device] = "cpu",
                 arrayrecord_key: str = "arrays", configrecord_key: str = "config"):
        if not callable(model_fn) or not callable(data_fn):
            raise TypeError("model_fn and data_fn must be callables taking the Flower Context")
        self.model_fn, self.data_fn, self.eval_data_fn = model_fn, data_fn, eval_data_fn
        self.config = config
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.seed = seed
        self.client_id = client_id
        self.device = torch.device(device)
        self.arrayrecord_key, self.configrecord_key = arrayrecord_key, configrecord_key

    # ------------------------------------------------------------------ helpers
    def _local_config(self, context: Context) -> LocalConfig:
        if self.config is None:
            return local_config_from_run_config(context.run_config)
        if isinstance(self.config, LocalConfig):
            return self.config
        cfg = self.config(context)
        if not isinstance(cfg, LocalConfig):
            raise TypeError(f"config(context) returned {type(cfg).__name__}, not a LocalConfig")
        return cfg

    def _cid(self, context: Context) -> int:
        if self.client_id is not None:
            return int(self.client_id(context))
        if "partition-id" not in context.node_config:
            raise ValueError("the node has no 'partition-id' in its node config; pass client_id=")
        return int(context.node_config["partition-id"])

    def _seed(self, context: Context) -> int:
        if self.seed is not None:
            return int(self.seed)
        return int(context.run_config.get("seed", 0))

    def _model(self, context: Context, arrays: ArrayRecord) -> nn.Module:
        model = self.model_fn(context)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_fn returned {type(model).__name__}, not an nn.Module")
        model = model.to(self.device)
        load_arrayrecord_(model, arrays)
        return model

    def _data(self, fn, context: Context) -> Data:
        x, y = fn(context)
        return x.to(self.device), y.to(self.device)

    # ------------------------------------------------------------------ train
    def train(self, msg: Message, context: Context) -> Message:
        """The ``@app.train()`` function: local FedNAR training from the global arrays."""
        content = msg.content
        arrays = content[self.arrayrecord_key]
        server_round = int(content[self.configrecord_key]["server-round"]) \
            if self.configrecord_key in content and "server-round" in content[self.configrecord_key] else 1
        cfg = self._local_config(context)
        cid = self._cid(context)
        scaffold_c = content[SCAFFOLD_KEY] if SCAFFOLD_KEY in content else None
        cfg = dataclasses.replace(cfg, scaffold=scaffold_c is not None)

        model = self._model(context, arrays)
        x_train, y_train = self._data(self.data_fn, context)
        n = int(y_train.shape[0])
        if n == 0:
            raise ValueError(f"client {cid} has no training data")
        trainer = LocalTrainer(model, self.loss_fn, x_train, y_train, cfg)  # flattens the model's parameters
        x_global = trainer.x.clone()
        update = torch.empty_like(x_global)
        stats = RoundStats(self.device)
        scaffold = None
        if scaffold_c is not None:
            layout = parameters_layout(model)
            c = arrayrecord_to_vector(scaffold_c, layout, name=f"the '{SCAFFOLD_KEY}' record").to(self.device)
            ci_record = context.state[SCAFFOLD_STATE_KEY] if SCAFFOLD_STATE_KEY in context.state else None
            c_i = (arrayrecord_to_vector(ci_record, layout, name="the client's control variate").to(self.device)
                   if ci_record is not None else torch.zeros_like(x_global))
            scaffold = ScaffoldState(1, x_global.numel(), device=self.device, dtype=x_global.dtype)
            scaffold.c.copy_(c)
            scaffold.set_control(0, c_i)
        indices = torch.arange(n, device=self.device)
        lr_sum = trainer.train(x_global, indices, round_index=server_round - 1,
                               seed=batch_seed(self._seed(context), server_round, cid), out_update=update,
                               stats=stats, client=0, scaffold=scaffold)
        with torch.no_grad():  # a non-finite training (update NaN: RoundStats.close_client) sends a NaN model, which
            # the strategy leaves out as nonfinite -- its skipped steps would otherwise send x_global back, a zero update
            trainer.x.masked_fill_(~torch.isfinite(update).all(), float("nan"))
        if scaffold is not None and lr_sum > 0:
            with torch.no_grad():  # option II, as ScaffoldState: c_i += D / lr_sum - c
                c_i_new = scaffold.control(0) + (update / lr_sum - scaffold.c)
                # a non-finite training (its update NaN: RoundStats.close_client) keeps c_i, as the server leaves it out
                c_i_new = torch.where(torch.isfinite(c_i_new).all(), c_i_new, scaffold.control(0))
            layout = parameters_layout(model)
            context.state[SCAFFOLD_STATE_KEY] = tensors_to_arrayrecord(
                (s.name, c_i_new[s.offset:s.offset + s.numel].view(s.shape)) for s in layout.slots)

        config = content[self.configrecord_key] if self.configrecord_key in content else {}
        if DP_CLIP_KEY in config:  # the strategy's dp_mode="client": clip before sending (the server bounds it again)
            with torch.no_grad():
                if not bool(clip_updates_(update, float(config[DP_CLIP_KEY]))):  # an unclipped model keeps its bits
                    torch.sub(x_global, update, out=trainer.x)

        coded = codec_from_config(config)  # the strategy's compress=: send the codes, not the model
        if coded is not None:  # the floating buffers (BatchNorm statistics) travel uncompressed beside the codes
            buffers = [(k, b) for k, b in model.named_buffers() if b.is_floating_point() and k in arrays.keys()]
            arrays_out = self._encode(update, coded, cid, cfg.backend, context, buffers)
        else:
            arrays_out = model_to_arrayrecord(model, keys=list(arrays.keys()))
        summary = stats.summary()
        nan = float("nan")  # a training left out as non-finite has no loss of its own
        metrics = MetricRecord({
            "train_loss": nan if summary["train_loss"] is None else float(summary["train_loss"]),
            "clip_frequency": nan if summary["clip_frequency"] is None else float(summary["clip_frequency"]),
            "clipped_steps": int(summary["clipped_steps"]),
            "skipped_steps": int(summary["skipped_steps"]),
            LR_SUM_KEY: float(lr_sum),
            "num-examples": n,
        })
        reply = RecordDict({
            self.arrayrecord_key: arrays_out,
            "metrics": metrics,
            REPLY_CONFIG_KEY: ConfigRecord({ORDER_KEY: cid, ROUND_KEY: server_round,
                                            **({} if coded is None else {CODEC_KEY: codec_spec(coded[0])})}),
        })
        return Message(content=reply, reply_to=msg)

    @torch.no_grad()
    def _encode(self, update: torch.Tensor, coded, cid: int, backend, context: Context, buffers=()) -> ArrayRecord:
        """The compressed reply's arrays for ``update`` (:mod:`.compression`); with error
        feedback ``a = e + D`` is encoded and ``e <- a - decode(C(a))`` kept in the
        context's state.  A non-finite update keeps the residual; its reply holds a
        NaN/Inf scale (top-k: a NaN/Inf value), which the server's screening leaves out
        as ``bad_arrays`` (the simulator, which sees the update itself, says ``nonfinite``)."""
        codec, key, error_feedback = coded
        a = update.reshape(-1).to(torch.float32)
        if error_feedback and EF_STATE_KEY in context.state:
            a = torch.from_numpy(array_view(context.state[EF_STATE_KEY]["residual"]).copy()).to(a.device) + a
        reply = codec.encode(a, key, cid, backend=backend)
        if error_feedback and bool(torch.isfinite(a).all()):
            residual = a - codec.decode(reply, a.numel(), key).to(a.device)
            context.state[EF_STATE_KEY] = tensors_to_arrayrecord([("residual", residual)])
        return reply_to_arrayrecord(reply, buffers)

    # ------------------------------------------------------------------ evaluate
    @torch.no_grad()
    def evaluate(self, msg: Message, context: Context) -> Message:
        """The ``@app.evaluate()`` function: loss and accuracy of the global arrays on
        ``eval_data_fn(context)``."""
        if self.eval_data_fn is None:
            raise ValueError("FedNARClient.evaluate needs eval_data_fn=")
        model = self._model(context, msg.content[self.arrayrecord_key])
        x, y = self._data(self.eval_data_fn, context)
        model.eval()
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        for start in range(0, int(y.shape[0]), 2048):
            out = model(x[start:start + 2048])
            yy = y[start:start + 2048]
            loss += self.loss_fn(out, yy).to(torch.float64) * yy.numel()
            correct += (out.argmax(dim=1) == yy).sum()
        n = max(int(y.shape[0]), 1)
        metrics = MetricRecord({"eval_loss": float(loss) / n, "eval_acc": float(correct) / n,
                                "num-examples": int(y.shape[0])})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
