"""The round loop of the simulator.

One :class:`Simulation` owns the data (tensors on the device), the partition, the
global model (its parameters are views of ONE flat vector ``x_global``), one local
model for all clients (:class:`~fedopt_kernels.fl.client.LocalTrainer`), the server
side (:class:`~fedopt_kernels.fl.server_side.ServerSide`) and the :class:`Results`.  A round:

1. sample ``per_round`` of the ``clients`` uniformly without replacement;
2. train them (engine ``"batched"``: all together as one ``[C, N]`` computation,
   :mod:`fedopt_kernels.fl.batched`; ``"sequential"``: one after another on the local
   model), each writing ``D_i = x_global - x_end_i`` into its row of a preallocated
   ``[C, N]`` tensor;
3. one server step on that tensor, the clients weighted by the algorithm's own rule
   (``weighting="auto"``: uniform for scaffold, fedexp and asnes, data size for the
   others; :mod:`fedopt_kernels.server.weighting`), then SCAFFOLD's control variates
   (:func:`fedopt_kernels.server.scaffold_control_update_`, without the clients the
   step excluded) and the floating buffers (BatchNorm statistics: averaged with the
   parameters' weights; FedLAW keeps those of its proxy training);
4. evaluate the global model on the test set (FedLAW with ``proxy_source="test"``: on
   the test examples outside its proxy set); append a record.

Clients that cannot take part (``config.on_bad_client="exclude"``, the default): a
client without samples (``no_data``, found before anything trains) or whose local
training raises an ``Exception`` (``error``; Ctrl-C and other ``BaseException`` s still
stop the run) is left out of its round -- its partial statistics undone, no row in the
server step, no SCAFFOLD update -- and the server step leaves out NaN/Inf updates
(``nonfinite``).  The round's record counts them (``excluded_clients`` and
``excluded_<reason>`` for every reason of
:data:`~fedopt_kernels.fl.server_side.BAD_CLIENT_REASONS`; ``left_out`` lists
``[client, reason]`` when any), one warning per round names them (logger
``fedopt_kernels.fl.simulation``), and the round equals the same round without those
clients.  A round in which no client could train at all raises ``RuntimeError``
naming each client and why, and commits nothing (as Flower's ``AggregationError``: a
failure that hits every client is rarely the clients' own, and a run of silently
skipped rounds would hide it); a round whose every update is NaN/Inf is skipped
(``server_skipped``: model and server state unchanged), as before.  The batched engine trains
groups of clients at once, so an error there names no client: that round is retrained
client by client with the sequential engine (``results.meta["sequential_retrains"]``
lists such rounds), which finds the failing clients -- except in the batched engine's
first round, where any error already means "this model cannot be batched" and the run
falls back to the sequential engine for good.  ``on_bad_client="raise"``: a client
without samples raises before anything trains, and a raising client fails the round
(nothing committed), as before.

Determinism: every random draw comes from a generator seeded by a stable function of
``(seed, purpose, round, client)`` -- the model initialisation, the round's clients,
each client's batch order (and dropout), FedLAW's proxy set and its batch order, the
corrupted clients and their damage (``corrupt_fraction``, :mod:`.corruption`).  So
the same seed gives bit-identical results, two algorithms with the same seed see the
same clients and the same batches (``fedopt compare``), and resuming from a
:meth:`Simulation.state_dict` needs no RNG state: the round number is enough.

Engines (:meth:`Simulation._train_clients`): ``"batched"`` trains the round's clients
as one ``[C, N]`` tensor under ``torch.func.vmap`` with the row-wise fused FedNAR step,
drawing exactly the sequential engine's batches; ``"sequential"`` is the oracle it is
tested against (same global model to fp32 rounding).  ``"auto"`` (the default) is
batched unless one client trains per round.  A model ``vmap`` cannot batch falls back
to sequential with an :class:`~fedopt_kernels.fl.batched.EngineFallbackWarning`;
``results.meta["engine"]`` says which engine ran.
"""

from __future__ import annotations

import copy
import logging
import platform
import time
import warnings
from typing import Callable, List, Optional, Union

import torch
from torch import nn

from .. import __version__
from ..server import RobustAggregator, read_metrics
from ..utils import buffers_layout, buffers_to_vector, flatten_parameters_, vector_to_buffers
from .attacks import Attack
from .batched import BatchedTrainer, BatchedUnsupported, EngineFallbackWarning, unsupported_reason
from .chunked import FOLDABLE, RoundFold, chunk_clients, folded_server_step, round_weights
from .client import LocalConfig, LocalTrainer, RoundStats, ScaffoldState
from .client_state import ClientStateStore
from .config import ConfigError, SimulationConfig
from .corruption import corrupt_client_data
from .data import FederatedDataset, LazyFederatedDataset, load_dataset
from .interrupts import deferred_interrupts
from .models import build_model
from .partition import CSRIndices, Partition, dirichlet_partition, iid_partition, natural_partition
from .privacy import RoundPrivacy
from .results import Results
from .seeds import batch_seed, init_seed, proxy_order_seed, proxy_seed, sampling_seed
from .server_side import BAD_CLIENT_REASONS, ServerSide

__all__ = ["Simulation", "make_partition", "load_config_dataset", "sample_clients", "proxy_split"]

STATE_VERSION = 1
_log = logging.getLogger(__name__)


def load_config_dataset(config: SimulationConfig) -> FederatedDataset:
    """The dataset a config names, with its options."""
    opts = {"test_fraction": config.test_fraction}
    if config.dataset in ("synthetic", "synthetic-lazy"):
        opts.update(alpha=config.synthetic_alpha, beta=config.synthetic_beta, iid=config.synthetic_iid,
                    max_samples_per_client=config.max_samples_per_client)
    elif config.dataset == "cifar10":
        opts = {"root": config.data_root}
    elif config.dataset != "digits":
        opts = {}
    try:
        return load_dataset(config.dataset, seed=config.seed, num_clients=config.clients, **opts)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def make_partition(config: SimulationConfig, dataset: FederatedDataset) -> Partition:
    """The partition a config asks for (``auto``: the dataset's natural split if it has
    one, else Dirichlet(alpha))."""
    method = config.partition
    if isinstance(dataset, LazyFederatedDataset) and method not in ("auto", "natural"):
        raise ConfigError(f"dataset {dataset.name!r} is made client by client and comes with its own split; "
                          f"use partition 'natural' (or 'auto'), not {method!r}")
    if method == "auto":
        method = "natural" if dataset.client_indices is not None else "dirichlet"
    if method == "natural":
        if dataset.client_indices is None:
            raise ConfigError(f"dataset {dataset.name!r} has no natural partition; use partition 'dirichlet' or 'iid'")
        part = natural_partition(dataset.client_indices)
        if part.num_clients != config.clients:
            raise ConfigError(f"dataset {dataset.name!r} comes split over {part.num_clients} clients but clients is "
                              f"{config.clients}")
        return part
    try:
        if method == "iid":
            return iid_partition(dataset.num_train, config.clients, seed=config.seed)
        return dirichlet_partition(dataset.y_train, config.clients, config.alpha, seed=config.seed,
                                   min_size=config.min_client_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def sample_clients(seed: int, round_number: int, num_clients: int, per_round: int) -> List[int]:
    """The (sorted) clients of round ``round_number`` (1-based): uniform without
    replacement, a function of ``(seed, round_number)`` only."""
    g = torch.Generator().manual_seed(sampling_seed(seed, round_number))
    return sorted(torch.randperm(num_clients, generator=g)[:per_round].tolist())


def proxy_split(labels: torch.Tensor, size: int, seed: int, *, name: str = "the data", need_rest: bool = True
                ) -> tuple:
    """FedLAW's class-balanced proxy set: ``(proxy, rest)``, sorted index tensors (CPU)
    into ``labels``: ``size`` examples, as equal a number per class as the data allow
    (the first ``size mod classes`` classes one more; [FedLAW] appendix D.2: "a small
    and class-balanced proxy dataset ... randomly selected from the testset"), drawn by
    :func:`~fedopt_kernels.fl.seeds.proxy_seed` ``(seed)``, and the other examples.

    Raises :class:`ConfigError` naming ``proxy-size`` when nothing would be left and
    ``need_rest`` (the rest is the evaluation set).
    """
    y = labels.detach().cpu()
    g = torch.Generator().manual_seed(proxy_seed(seed))
    classes = torch.unique(y).tolist()
    per_class, extra = divmod(int(size), len(classes))
    chosen = []
    for i, c in enumerate(classes):
        idx = (y == c).nonzero().flatten()
        take = min(per_class + (1 if i < extra else 0), idx.numel())
        chosen.append(idx[torch.randperm(idx.numel(), generator=g)[:take]])
    proxy = torch.cat(chosen).sort().values
    keep = torch.ones(y.numel(), dtype=torch.bool)
    keep[proxy] = False
    rest = keep.nonzero().flatten()
    if need_rest and rest.numel() == 0:
        raise ConfigError(f"proxy-size {size} takes all {y.numel()} examples of {name}; lower proxy-size "
                          "(or use proxy-source train)")
    return proxy, rest


class Simulation:
    """A simulated federated training run (see the module docstring).

    Args:
        config: the settings (validated here).
        dataset: a :class:`FederatedDataset` to use instead of ``config.dataset``.
        model: an ``nn.Module`` (the simulator takes it over as the global model: its
            parameters are moved into one flat vector) or a zero-argument callable
            returning one (called under a seeded RNG); None builds ``config.model``.
        partition: a :class:`Partition` to use instead of the config's.
        loss_fn: ``loss_fn(outputs, labels)`` (mean over the batch); default
            cross-entropy.
        hold_out_proxy: hold FedLAW's test-side proxy set (``proxy_source="test"``) out
            of the evaluation even when ``config.algo`` does not use it, so that runs of
            several algorithms are evaluated on the same examples (``fedopt compare``
            does this when one of its runs is fedlaw); None: only when it does.
    """

    def __init__(self, config: SimulationConfig, *, dataset: Optional[FederatedDataset] = None,
                 model: Union[nn.Module, Callable[[], nn.Module], None] = None, partition: Optional[Partition] = None,
                 loss_fn: Optional[Callable] = None, hold_out_proxy: Optional[bool] = None):
        config.validate()
        self.config = config
        self.device = torch.device(config.device)
        ds = dataset if dataset is not None else load_config_dataset(config)
        self.partition = partition if partition is not None else make_partition(config, ds)
        if self.partition.num_clients != config.clients:
            raise ConfigError(f"the partition has {self.partition.num_clients} clients but clients is {config.clients}")
        self.dataset = ds.to(self.device)
        # a lazy dataset's clients are made when sampled (LazyFederatedDataset): each round
        # trains on its own clients' rows (_round_data), the population costs index tables
        self._lazy = isinstance(ds, LazyFederatedDataset)
        if self._lazy and config.corrupt_fraction > 0:
            raise ConfigError(f"corrupt-fraction needs the whole training set in memory; dataset {ds.name!r} is "
                              "made client by client")
        if self._lazy and config.needs_proxy and config.proxy_source == "train":
            raise ConfigError(f"proxy-source train needs the whole training set in memory; dataset {ds.name!r} is "
                              "made client by client (use proxy-source test)")
        self._round_index: Optional[dict] = None  # client -> its rows of the round's data (lazy datasets)
        parts = self.partition.client_indices
        self.client_indices = (_OnDevice(parts, self.device) if isinstance(parts, CSRIndices)
                               else [ix.to(self.device) for ix in parts])
        self.client_sizes = torch.tensor(self.partition.sizes, dtype=torch.float64)
        # what the clients train on: the training set with the corrupted clients' samples
        # damaged (config.corrupt_*); self.dataset itself (test set, proxy set) stays clean
        self.train_x, self.train_y, self.corruption = self._corrupt()
        # attacks for testing (fl/attacks.py); labelflip's attackers train on flipped labels
        self.attack = (Attack.build(config.attack, config.attack_fraction, config.clients, config.seed)
                       if config.attack != "none" else None)
        if self.attack is not None:
            self.train_y = self.attack.poison_labels(self.train_y, self.client_indices, ds.num_classes)
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()

        global_model = self._make_model(model).to(self.device)
        if loss_fn is None:  # cross-entropy over the dataset's classes: one output per class
            self._check_outputs(global_model)
        local_model = copy.deepcopy(global_model)
        self.global_model = global_model
        self.x_global = flatten_parameters_(global_model)
        self.numel = self.x_global.numel()
        self.local = LocalConfig(
            steps=config.local_steps, batch_size=config.batch_size, lr=config.lr, lr_decay=config.lr_decay,
            weight_decay=config.weight_decay, wd_decay=config.wd_decay, max_norm=config.max_norm, nar=config.nar,
            momentum=config.momentum, prox_mu=config.prox_mu if config.algo == "fedprox" else 0.0,
            scaffold=config.algo == "scaffold", decay_beta=config.decay_beta, decay_kind=config.decay_kind,
            decay_per=config.decay_per, backend=config.backend, carry_momentum=config.carry_momentum,
            decay_scales_change=config.decay_scales_change)
        self.trainer = LocalTrainer(local_model, self.loss_fn, self.train_x, self.train_y, self.local)
        # per-client state (fl/client_state.py): rows only for clients that took part, one store for
        # every kind of it (SCAFFOLD's c_i registers "c_i"; other per-client state registers its own name)
        self.client_state = ClientStateStore(
            dtype=getattr(torch, config.client_state_dtype) if config.client_state_dtype else None,
            spill_dir=config.client_state_dir)
        self.scaffold = (ScaffoldState(config.clients, self.numel, device=self.device, dtype=self.x_global.dtype,
                                       store=self.client_state)
                         if self.local.scaffold else None)
        self._buffers_layout = buffers_layout(global_model)
        self._has_buffers = len(self._buffers_layout) > 0
        self.buffer_rows = (torch.empty(config.per_round, self._buffers_layout.numel, device=self.device,
                                        dtype=self._buffers_layout.dtype) if self._has_buffers else None)

        self._proxy_gen = torch.Generator()
        self.proxy_indices: Optional[torch.Tensor] = None  # into the train or test set (proxy_source)
        self.eval_indices: Optional[torch.Tensor] = None  # test examples evaluated (None: all)
        hold_out = config.needs_proxy if hold_out_proxy is None else bool(hold_out_proxy)
        if config.proxy_source == "test" and (hold_out or config.needs_proxy):
            self.proxy_indices, self.eval_indices = proxy_split(self.dataset.y_test, config.proxy_size, config.seed,
                                                                name="the test set")
        elif config.needs_proxy:
            self.proxy_indices, _ = proxy_split(self.dataset.y_train, config.proxy_size, config.seed,
                                                name="the training set", need_rest=False)
        proxy_loader = self._proxy_loader() if config.needs_proxy else None
        self.server = ServerSide(config, global_model, self.x_global, proxy_loader=proxy_loader, loss_fn=self.loss_fn)
        self.updates: Optional[torch.Tensor] = None  # the rows clients train into (_allocate_rounds)
        self.round = 0
        self._elapsed = 0.0
        self.results = Results(config.to_dict(), self._meta(), self.partition.summary(), label=config.algo)
        if config.recipe is not None:  # the recipe the settings came from: each value, its source, overrides
            from .recipes import get as get_recipe

            self.results.meta["recipe"] = get_recipe(config.recipe).resolved(config)
        if self.corruption is not None:
            self.results.meta["corruption"] = self.corruption.to_dict()
        # DP-FedAvg on the server optimizer (fl/privacy.py), and what is recorded of it and the attack
        self.privacy = RoundPrivacy(config, self.server) if config.dp_clip is not None else None
        if self.privacy is not None:
            self.results.meta["dp"] = self.privacy.meta()
        if self.attack is not None:
            self.results.meta["attack"] = self.attack.to_dict()
        # a Byzantine-robust rule as the server optimizer's aggregation (server/robust_aggregator.py);
        # the config refuses it with DP and with the algorithms it cannot serve
        self.robust: Optional[RobustAggregator] = None
        if config.aggregator != "mean":
            self.robust = RobustAggregator(config.aggregator, **config.aggregator_params)
            self.server.optimizer.aggregator = self.robust
            self.results.meta["aggregator"] = self.robust.to_dict()
        self.batched: Optional[BatchedTrainer] = None
        self._setup_engine()
        self._allocate_rounds()

    # ------------------------------------------------------------------ setup
    def _make_model(self, model) -> nn.Module:
        cfg = self.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed(cfg.seed))
            if model is None:
                opts = {"hidden": cfg.hidden} if cfg.model == "mlp" else {}
                try:
                    m = build_model(cfg.model, self.dataset.input_shape, self.dataset.num_classes, **opts)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            elif isinstance(model, nn.Module):
                m = model
            elif callable(model):
                m = model()
            else:
                raise TypeError(f"model must be an nn.Module or a callable returning one, got {type(model).__name__}")
        if not isinstance(m, nn.Module):
            raise TypeError(f"the model factory returned {type(m).__name__}, not an nn.Module")
        if not any(True for _ in m.parameters()):
            raise ValueError("the model has no parameters")
        return m

    def _check_outputs(self, model: nn.Module) -> None:
        """The model must give one score per class (``[batch, num_classes]``): a model
        with more outputs trains under cross-entropy with classes that never occur, one
        with fewer fails mid-round.  One forward of two training examples in eval mode
        (no statistics change, no gradient)."""
        k = self.dataset.num_classes
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = model((self.dataset.x_test if self._lazy else self.dataset.x_train)[:2])
        except Exception:  # noqa: BLE001 - the model's own error shows in the first round as before
            return
        finally:
            model.train(was_training)
        if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] != k:
            raise ConfigError(f"the model gives {out.shape[1]} outputs per example but dataset "
                              f"{self.dataset.name!r} has {k} classes: make its last layer {k} wide (or pass "
                              "loss_fn= for a loss that is not cross-entropy over the classes)")

    def _corrupt(self):
        """``(x_train, y_train, Corruption or None)`` the clients train on."""
        cfg, ds = self.config, self.dataset
        if self._lazy:  # placeholders of the right kind; a round trains on its clients' rows
            return ds.x_test[:1], ds.y_test[:1], None
        if cfg.corrupt_fraction == 0:
            return ds.x_train, ds.y_train, None
        try:
            x, y, record = corrupt_client_data(ds.x_train, ds.y_train, self.client_indices,
                                               fraction=cfg.corrupt_fraction, kind=cfg.corrupt_kind, seed=cfg.seed,
                                               num_classes=ds.num_classes, noise_std=cfg.corrupt_noise_std)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return x, y, record

    def _proxy_loader(self):
        """FedLAW's proxy set (:attr:`proxy_indices`, drawn by :func:`proxy_split`): from
        the test set (``proxy_source="test"``, [FedLAW] appendix D.2) or the pooled
        training data (``"train"``); batches of 128 in a per-round seeded order."""
        ds = self.dataset
        idx = self.proxy_indices.to(self.device)
        if self.config.proxy_source == "test":
            data = torch.utils.data.TensorDataset(ds.x_test[idx], ds.y_test[idx])
        else:
            data = torch.utils.data.TensorDataset(ds.x_train[idx], ds.y_train[idx])
        return torch.utils.data.DataLoader(data, batch_size=128, shuffle=True, generator=self._proxy_gen)

    def _meta(self) -> dict:
        from .. import backends

        try:
            backend = backends.resolve_name(self.config.backend, self.device.type)
        except Exception as exc:  # noqa: BLE001 - reported, the step would raise the same
            backend = f"unavailable ({exc})"
        return {"fedopt_kernels": __version__, "torch": str(torch.__version__), "python": platform.python_version(),
                "device": str(self.device), "backend": backend, "threads": torch.get_num_threads(),
                "num_parameters": self.numel, "dataset": self.dataset.name, "num_train": self.dataset.num_train,
                "num_test": self.num_eval, "input_shape": list(self.dataset.input_shape),
                "num_classes": self.dataset.num_classes, "model": type(self.global_model).__name__,
                "server": self.server.hyper if hasattr(self, "server") else None,
                "weighting": self.config.resolved_weighting,
                "proxy": ({"source": self.config.proxy_source, "size": int(self.proxy_indices.numel()),
                           "held_out_of_test": self.eval_indices is not None}
                          if self.proxy_indices is not None else None)}

    # ------------------------------------------------------------------ rounds
    def sample_clients(self, round_number: int) -> List[int]:
        """The round's clients; with ``holdout_clients`` drawn from the others only (the
        same draw, mapped onto the training clients: no hold-out gives the usual sample)."""
        pool = self.training_clients
        picked = sample_clients(self.config.seed, round_number, len(pool), self.config.per_round)
        return [pool[i] for i in picked]

    @property
    def training_clients(self) -> List[int]:
        """Every client but the held-out ones (sorted)."""
        held = set(self.holdout_clients)
        return [c for c in range(self.config.clients) if c not in held]

    @property
    def holdout_clients(self) -> List[int]:
        """``config.holdout_clients`` clients drawn by the seed (round 0 of the sampling
        stream, which no round uses), never sampled for training; :meth:`evaluate_holdout`
        scores the global model on their data, as [FedDecay] section 4 holds out 20% of
        the users to measure generalisation to new ones."""
        h = self.config.holdout_clients
        if not h:
            return []
        g = torch.Generator().manual_seed(sampling_seed(self.config.seed, 0))
        return sorted(torch.randperm(self.config.clients, generator=g)[:h].tolist())

    @torch.no_grad()
    def evaluate_holdout(self, batch_size: int = 2048) -> tuple:
        """``(accuracy, mean loss)`` of the global model on the held-out clients' pooled
        (uncorrupted) training data: the sample-weighted mean of their accuracies."""
        idx = torch.cat([self.client_indices[c] for c in self.holdout_clients])
        return self._evaluate_on(self.dataset.x_train[idx], self.dataset.y_train[idx], batch_size)

    @property
    def num_eval(self) -> int:
        """How many test examples :meth:`evaluate` uses (the test set, less FedLAW's
        proxy set when it is held out of it)."""
        return self.dataset.num_test if self.eval_indices is None else int(self.eval_indices.numel())

    @torch.no_grad()
    def evaluate(self, batch_size: int = 2048) -> tuple:
        """``(accuracy, mean loss)`` of the global model on the test set (on
        :attr:`eval_indices` when FedLAW's proxy set is held out of it)."""
        ds = self.dataset
        x_test, y_test = ds.x_test, ds.y_test
        if self.eval_indices is not None:
            idx = self.eval_indices.to(self.device)
            x_test, y_test = x_test[idx], y_test[idx]
        return self._evaluate_on(x_test, y_test, batch_size)

    def _evaluate_on(self, x_test: torch.Tensor, y_test: torch.Tensor, batch_size: int) -> tuple:
        model = self.global_model
        n = y_test.shape[0]
        was_training = model.training
        model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for start in range(0, n, batch_size):
            x, y = x_test[start:start + batch_size], y_test[start:start + batch_size]
            out = model(x)
            loss += self.loss_fn(out, y).to(torch.float64) * y.numel()
            correct += (out.argmax(dim=1) == y).sum()
        model.train(was_training)
        acc, total = torch.stack([correct.to(torch.float64), loss]).tolist()
        return acc / n, total / n

    # ------------------------------------------------------------------ engines
    def _setup_engine(self) -> None:
        """The client engine ``config.engine`` asks for (see :mod:`.batched`)."""
        cfg = self.config
        engine = cfg.engine
        if engine == "auto":
            engine = "batched" if cfg.per_round > 1 else "sequential"
        self.results.meta["engine"] = engine
        if engine != "batched":
            return
        if cfg.carry_momentum or cfg.decay_scales_change:  # per-client state / per-epoch rescaling: sequential only
            self._fall_back("carry_momentum and decay_scales_change run on the sequential engine")
            return
        reason = unsupported_reason(self.global_model)
        if reason is not None:
            self._fall_back(reason)
            return
        self.batched = BatchedTrainer(self.trainer.model, self.loss_fn, self.train_x, self.train_y,
                                      self.local, num_classes=self.dataset.num_classes,
                                      buffers=dict(self.global_model.named_buffers()),
                                      client_batch=cfg.client_batch, seed=cfg.seed,
                                      population_sizes=self.partition.sizes, round_clients=cfg.per_round)

    def _fall_back(self, reason: str) -> None:
        """Use the sequential engine from now on, with a one-line notice."""
        self.batched = None
        self.results.meta["engine"] = "sequential"
        self.results.meta["engine_fallback"] = reason
        warnings.warn(f"the batched engine cannot train this model ({reason}); using the sequential engine",
                      EngineFallbackWarning, stacklevel=4)

    def _train_clients_batched(self, round_number: int, clients: List[int]) -> RoundStats:
        stats = RoundStats(self.device)
        C = len(clients)
        if C == 0:
            return stats
        base = self._progress_base
        self.batched.train_round(
            self.x_global, [self._client_rows(cid) for cid in clients], round_index=round_number - 1,
            seeds=[batch_seed(self.config.seed, round_number, cid) for cid in clients],
            out=self.updates[self._rows_at:self._rows_at + C], stats=stats, clients=clients, scaffold=self.scaffold,
            on_group=(None if self.progress is None else lambda done: self._report_progress(round_number, base + done)))
        if self._has_buffers:  # buffers the batched engine allows are not changed by training
            self.buffer_rows[:C].copy_(buffers_to_vector(self.global_model).expand(C, -1))
        self.results.meta.setdefault("client_batch_used", self.batched.planner.last_group_size)
        if self.batched.trace_failure is not None:  # still correct, only slower: say why
            self.results.meta["batched_trace_failure"] = self.batched.trace_failure
        return stats

    def _screen_clients(self, clients: List[int]) -> List[tuple]:
        """``(client, "no_data", detail)`` for the round's clients without samples;
        ``on_bad_client="raise"``: raises before anything trains."""
        empty = [cid for cid in clients if self.client_indices[cid].numel() == 0]
        if empty and self.config.on_bad_client == "raise":
            raise ValueError(f"client(s) {empty} hold no samples and cannot train (on_bad_client='raise'; "
                             "'exclude' leaves them out of their rounds)")
        return [(cid, "no_data", "holds no samples") for cid in empty]

    def _train_clients(self, round_number: int, clients: List[int]) -> RoundStats:
        """Train the round's ``clients``; the ones that take part write their rows
        ``[:len(self._round_kept)]`` of :attr:`updates` (and :attr:`buffer_rows`) in
        order, the others are listed in ``self._round_bad`` (``(client, reason,
        detail)``, in the order of ``clients``)."""
        bad = self._screen_clients(clients)
        skip = {cid for cid, _, _ in bad}
        todo = [cid for cid in clients if cid not in skip]
        self._round_bad, self._round_kept = bad, todo
        self._progress_total = len(clients)
        self._report_progress(round_number, 0)
        if self._chunk is not None:
            return self._train_chunked(round_number, clients, todo, bad)
        if self._lazy:
            self._round_data(todo)
        try:
            self._progress_base = len(bad)  # the clients screened out are done
            stats = self._train_round_clients(round_number, clients, todo, bad)
        finally:
            self._progress_base = 0
            if self._lazy:
                self._round_data(None)
        self._report_progress(round_number, len(clients))
        return stats

    def _report_progress(self, round_number: int, done: int) -> None:
        """``progress(round, done, clients in the round)``, when someone listens."""
        if self.progress is not None:
            self.progress(round_number, done, self._progress_total)

    # ------------------------------------------------------------------ chunked rounds (memory_budget)
    _chunk: Optional[int] = None  # clients trained at once (None: the whole round)
    _foldable = False  # chunks folded into a running sum (fl/chunked.py), else kept in `updates`
    _fold: Optional[RoundFold] = None  # the running sum of the round being trained
    _rows_at = 0  # the row of `updates` the clients being trained write first
    #: ``progress(round, clients_done, clients_in_round)`` as a round's clients train: at its
    #: start (0), after each client (sequential engine), group of clients (batched) and chunk
    #: (``memory_budget``), and at its end (``fedopt simulate`` shows it as a second progress
    #: bar once a round runs long); None: not called.  It only reads counts: no host sync.
    progress: Optional[Callable[[int, int, int], None]] = None
    _progress_total = 0  # the clients of the round being trained
    _progress_base = 0  # of them, the ones done before the piece being trained

    def _allocate_rounds(self) -> None:
        """The rows a round's clients train into: ``[per_round, N]``, or with
        ``memory_budget`` chunks of ``K`` clients (:mod:`.chunked`): a ``[K, N]`` buffer
        folded into a running sum for the weighted-sum algorithms, else the round's
        ``[per_round, N]`` table (memory-mapped under ``client_state_dir`` when set)
        with the clients still trained ``K`` at a time."""
        cfg = self.config
        dtype = self.x_global.dtype
        rows = cfg.per_round
        budget = cfg.memory_budget_bytes
        if budget is not None and type(self)._server_step is not Simulation._server_step:
            # the distributed simulator spreads a round over ranks, each aggregating its block at once: a
            # budget it silently ignored would promise a bound it does not keep
            raise ConfigError("memory-budget is not supported with --distributed: each rank trains and aggregates "
                              "its block of a round's clients at once (more ranks bound a rank's memory); drop "
                              "memory-budget or run without --distributed")
        if budget is not None:
            itemsize = self.x_global.element_size()
            per_client = self.numel * itemsize
            if self.batched is not None:
                per_client += self.batched.planner.client_bytes(cfg.batch_size)
            fixed = 8 * self.numel * itemsize  # model, local copy, server state, the fold's two sums
            chunk = min(cfg.per_round, chunk_clients(budget, per_client, fixed))
            if chunk < cfg.per_round:
                self._chunk = chunk
                # DP clips every row, an attack reads the honest ones and a robust rule compares
                # them: all need the whole round's rows, which a running sum does not keep
                self._foldable = (cfg.algo in FOLDABLE and not self._has_buffers and self.server.optimizer is not None
                                  and dtype in (torch.float32, torch.float64)
                                  and self.privacy is None and self.attack is None and self.robust is None)
                if self.batched is not None:
                    planner = self.batched.planner
                    planner.client_batch = min(planner.client_batch or chunk, chunk)
                if self._foldable:
                    rows = chunk
            self.results.meta["memory_budget"] = budget
            self.results.meta["round_chunk"] = self._chunk
            self.results.meta["round_fold"] = self._foldable
        if self._chunk is not None and not self._foldable and cfg.client_state_dir:
            import os

            os.makedirs(cfg.client_state_dir, exist_ok=True)
            path = os.path.join(cfg.client_state_dir, "round_updates.bin")
            self.updates = torch.from_file(path, shared=True, size=rows * self.numel, dtype=dtype).view(rows, -1)
        else:
            self.updates = torch.empty(rows, self.numel, device=self.device, dtype=dtype)

    def _train_chunked(self, round_number: int, clients: List[int], todo: List[int], bad: list) -> RoundStats:
        """The round's ``todo`` clients trained ``_chunk`` at a time (see
        :meth:`_allocate_rounds`); each chunk folded into :attr:`_fold`, or written to
        its rows of :attr:`updates`."""
        stats = RoundStats(self.device)
        bad, kept = list(bad), []
        position = {cid: i for i, cid in enumerate(todo)}
        self._fold = None
        if self._foldable and todo:
            self._fold = RoundFold(self.server.optimizer, round_weights(self.server, self.client_sizes[todo]),
                                   len(todo), self.numel, self.device, self.x_global.dtype)
        try:
            for start in range(0, len(todo), self._chunk):
                part = todo[start:start + self._chunk]
                self._round_bad, self._round_kept = [], part
                self._progress_base = len(kept) + len(bad)
                self._rows_at = 0 if self._foldable else len(kept)
                if self._lazy:
                    self._round_data(part)
                part_stats = self._train_round_clients(round_number, part, part, [])
                _add_stats(stats, part_stats)
                got = list(self._round_kept)
                bad += self._round_bad
                if self._fold is not None:
                    excluded = self._fold.add(self.updates[:len(got)], [position[cid] for cid in got])
                    if self.scaffold is not None:
                        self.scaffold.fold_chunk(got, excluded)
                kept += got
                self._report_progress(round_number, len(kept) + len(bad))
        finally:
            self._rows_at = 0
            self._progress_base = 0
            if self._lazy:
                self._round_data(None)
        order = {cid: i for i, cid in enumerate(clients)}
        self._round_bad = sorted(bad, key=lambda b: order[b[0]])
        self._round_kept = kept
        return stats

    def _client_rows(self, cid: int) -> torch.Tensor:
        """Client ``cid``'s sample indices into what the engines train on: the training
        set, or (lazy datasets) the round's own rows."""
        return self.client_indices[cid] if self._round_index is None else self._round_index[cid]

    def _round_data(self, clients: Optional[List[int]]) -> None:
        """Lazy datasets: make the round's ``clients``' samples and point the engines at
        them (None: drop them).  Client ``i``'s sample ``j`` is row ``start_i + j``,
        so its batches (drawn from positions) pick the samples they pick in the
        materialised dataset: the same bits."""
        if clients is None:
            x, y = self.dataset.x_test[:1], self.dataset.y_test[:1]
            self._round_index = None
        else:
            x, y, starts = self.dataset.gather(clients)
            sizes = self.partition.client_indices.sizes()
            self._round_index = {cid: torch.arange(s, s + int(sizes[cid]), device=self.device)
                                 for cid, s in zip(clients, starts)}
        self.train_x, self.train_y = x, y
        self.trainer.x_train, self.trainer.y_train = x, y
        if self.batched is not None:
            self.batched.x_train, self.batched.y_train = x, y

    def _train_round_clients(self, round_number: int, clients: List[int], todo: List[int], bad: list) -> RoundStats:
        if self.batched is not None:
            try:
                return self._train_clients_batched(round_number, todo)
            except BatchedUnsupported as exc:  # the first batched round failed: redo it sequentially
                if self.scaffold is not None:
                    self.scaffold.discard_pending()
                self._fall_back(str(exc))
            except Exception as exc:  # noqa: BLE001 - a group failed: find the client(s) one by one
                if self.config.on_bad_client == "raise":
                    raise
                if self.scaffold is not None:
                    self.scaffold.discard_pending()
                self.results.meta.setdefault("sequential_retrains", []).append(round_number)
                _log.warning("round %d: the batched engine raised (%s: %s); retraining the round client by client "
                             "to leave out the failing client(s)", round_number, type(exc).__name__, exc)
        stats = RoundStats(self.device)
        global_buffers = buffers_to_vector(self.global_model) if self._has_buffers else None
        exclude = self.config.on_bad_client == "exclude"
        kept, row = [], 0
        for i, cid in enumerate(todo):
            if i:
                self._report_progress(round_number, self._progress_base + i)
            saved = _snapshot(stats) if exclude else None
            try:
                self.trainer.train(
                    self.x_global, self._client_rows(cid), round_index=round_number - 1,
                    seed=batch_seed(self.config.seed, round_number, cid), out_update=self.updates[self._rows_at + row],
                    stats=stats, client=cid, scaffold=self.scaffold, global_buffers=global_buffers,
                    out_buffers=self.buffer_rows[row] if self._has_buffers else None)
            except Exception as exc:  # noqa: BLE001 - on_bad_client="exclude": leave this client out
                if not exclude:
                    raise
                _restore(stats, saved)  # its partial steps do not count
                if self.scaffold is not None:
                    self.scaffold._pending.pop(cid, None)
                bad.append((cid, "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"))
                continue
            kept.append(cid)
            row += 1
        order = {cid: i for i, cid in enumerate(clients)}
        self._round_bad = sorted(bad, key=lambda b: order[b[0]])
        self._round_kept = kept
        return stats

    def run_round(self) -> dict:
        """Run the next round; returns (and records) its record.

        Client training only writes scratch buffers; the round then commits (control
        variates, server step, evaluation, record) with Ctrl-C (and SIGTERM / SIGHUP
        under :func:`~fedopt_kernels.fl.interrupts.stop_on_signals`) deferred to the end
        of the commit.  So an interrupted run always stands at a completed round and its
        :meth:`state_dict` resumes exactly.
        """
        cfg = self.config
        t0 = time.perf_counter()
        r = self.round + 1
        # the threads the rounds run on (set after construction by fedopt simulate --threads)
        self.results.meta["threads"] = torch.get_num_threads()
        clients = self.sample_clients(r)
        try:
            stats = self._train_clients(r, clients)
            if clients and not self._round_kept:  # every client failed to train: nothing to aggregate
                raise RuntimeError(
                    f"round {r}: none of its {len(clients)} client(s) could train, so the round has nothing to "
                    "aggregate (a failure that hits every client is rarely the clients' own): "
                    + "; ".join(f"client {cid}: {reason} ({detail})" for cid, reason, detail in self._round_bad))
        except BaseException:
            if self.scaffold is not None:
                self.scaffold.discard_round()
            raise
        with deferred_interrupts():
            kept = self._round_kept
            sizes = self.client_sizes[kept]
            C = len(kept)
            self._proxy_gen.manual_seed(proxy_order_seed(cfg.seed, r))
            x_before = self.x_global.detach().clone() if cfg.eval_avg_last_two else None
            if C:
                self._schedule_server(r)
                server_stats = self._server_step(kept, sizes)
                excluded = self.server.last_excluded
                if self.scaffold is not None:  # after the step: without the clients it excluded
                    self.scaffold.server_update(excluded, clients=kept)
                if self._has_buffers and self.server.averages_buffers:
                    # floating buffers (BatchNorm statistics): weighted like the parameters.  FedLAW's
                    # model keeps the statistics of its proxy training ([FedLAW], released code).
                    current = buffers_to_vector(self.global_model)
                    vector_to_buffers(self.server.buffers(self.buffer_rows[:C], sizes, current, excluded),
                                      self.global_model)
            else:  # no client left: the round is skipped, as when every update is NaN/Inf
                server_stats, excluded = {"server_skipped": True}, None
                self.server.last_excluded = None
                if self.scaffold is not None:
                    self.scaffold.discard_round()
            record = {"round": r, "clients": clients}
            record.update(stats.summary())
            record["local_lr"] = self.local.lr_at(r - 1, 0)
            record["weight_decay"] = self.local.weight_decay_at(r - 1)
            record.update(_read_server_stats(server_stats))
            self._record_exclusions(record, kept, excluded)
            if r % cfg.eval_every == 0 or r == cfg.rounds:
                record["test_accuracy"], record["test_loss"] = self.evaluate()
                if x_before is not None:
                    record["test_accuracy_avg2"], record["test_loss_avg2"] = self.evaluate_average(x_before, r)
                if cfg.holdout_clients:
                    record["holdout_accuracy"], record["holdout_loss"] = self.evaluate_holdout()
            self.round = r
            self._elapsed += time.perf_counter() - t0
            record["wall_time"] = self._elapsed
            self.results.append(record)
        return self.results.records[-1]

    def _schedule_server(self, round_number: int) -> None:
        """FedExP's per-round settings as its authors run it: ``eps * fedexp_eps_decay^(t)``
        in round ``t + 1`` (released main.py:308 decays eps by 0.998^2 per round) and
        ``M * eps`` when ``fedexp_scale_eps`` (main.py:404), written into the optimizer's
        param groups -- a closed form of the round number, so a resumed run agrees."""
        cfg = self.config
        if cfg.algo != "fedexp" or self.server.optimizer is None:
            return
        for group in self.server.optimizer.param_groups:
            group["eps"] = cfg.fedexp_eps * cfg.fedexp_eps_decay ** (round_number - 1)
            group["scale_eps_by_clients"] = cfg.fedexp_scale_eps

    @torch.no_grad()
    def evaluate_average(self, x_before: torch.Tensor, round_number: int) -> tuple:
        """``(accuracy, loss)`` of ``(x_before + x_global) / 2``, the mean of the last two
        global iterates, which FedExP's authors evaluate (released main.py:414-421 and
        430-431: in their first round the last iterate alone).  The global model is left
        as it was (bitwise)."""
        if round_number == 1:
            return self.evaluate()
        current = self.x_global.detach().clone()
        try:
            self.x_global.add_(x_before).mul_(0.5)
            return self.evaluate()
        finally:
            self.x_global.copy_(current)

    def _record_exclusions(self, record: dict, kept: List[int], excluded: Optional[torch.Tensor]) -> None:
        """``excluded_clients`` (all reasons), ``excluded_<reason>`` and, when any,
        ``left_out`` (``[client, reason]``, round order) into ``record``; one warning."""
        bad = list(self._round_bad)
        if record.get("excluded_clients"):  # the server step's NaN/Inf exclusions (one read, only then)
            mask = excluded.detach().cpu().tolist()
            bad += [(cid, "nonfinite", "NaN/Inf update") for cid, e in zip(kept, mask) if e]
        counts = {reason: 0 for reason in BAD_CLIENT_REASONS}
        for _, reason, _ in bad:
            counts[reason] += 1
        record["excluded_clients"] = sum(counts.values())
        for reason in BAD_CLIENT_REASONS:
            record[f"excluded_{reason}"] = counts[reason]
        if bad:
            order = {cid: i for i, cid in enumerate(record["clients"])}
            bad.sort(key=lambda b: order[b[0]])
            record["left_out"] = [[cid, reason] for cid, reason, _ in bad]
            if self._log_exclusions:
                _log.warning("round %d left out %d of %d client(s)%s: %s", record["round"], len(bad),
                             len(record["clients"]), "; round skipped" if not kept else "",
                             "; ".join(f"client {cid}: {reason} ({detail})" for cid, reason, detail in bad))

    _log_exclusions = True  # the distributed simulator logs on rank 0 only

    def _server_step(self, clients: List[int], sizes: torch.Tensor) -> dict:
        """The round's server step on the updates in rows ``[:len(clients)]`` (``clients``:
        the ones that took part; ``sizes``: their data sizes, used as weights under
        ``weighting="size"``).
        :class:`~fedopt_kernels.fl.distributed_simulation.DistributedSimulation` spreads it over
        ranks."""
        if self._fold is not None:  # a folded chunked round: the running sum is the aggregation
            fold, self._fold = self._fold, None
            return folded_server_step(self.server, fold)
        rows = self.updates[:len(clients)]
        # honest clients clip (dp_mode "client"), then the attackers replace their updates;
        # the round's record gets the attackers among its clients and the DP numbers (epsilon so far)
        extra = {}
        if self.privacy is not None:
            self.privacy.clip_client_updates_(rows)
        if self.attack is not None:
            extra["attacked_clients"] = self.attack.apply_(rows, clients, self.round + 1)
        stats = self.server.step(rows, sizes)
        if self.privacy is not None:
            extra.update(self.privacy.record())
        if self.robust is not None:  # Krum, Multi-Krum, Bulyan: which clients' updates entered
            extra.update(self.robust.record(clients))
        return {**stats, **extra}

    def run(self, rounds: Optional[int] = None, *, callback: Optional[Callable[[dict, "Simulation"], None]] = None
            ) -> Results:
        """Run until ``rounds`` rounds are done in total (default ``config.rounds``).

        Round 0 (the untrained model's test accuracy and loss) is recorded first.
        ``callback(record, simulation)`` is called after every round (and after round 0);
        a ``KeyboardInterrupt`` propagates with :attr:`results` holding every finished
        round (wrap the call in :func:`~fedopt_kernels.fl.interrupts.stop_on_signals`
        to have SIGTERM and SIGHUP stop it the same way, as ``fedopt simulate`` does).
        """
        target = self.config.rounds if rounds is None else int(rounds)
        self.results.meta["threads"] = torch.get_num_threads()
        if self.round == 0 and not self.results.records:
            acc, loss = self.evaluate()
            self.results.append({"round": 0, "clients": [], "test_accuracy": acc, "test_loss": loss,
                                 "wall_time": 0.0})
            if self.config.holdout_clients:
                self.results.records[-1]["holdout_accuracy"], self.results.records[-1]["holdout_loss"] = \
                    self.evaluate_holdout()
            if callback is not None:
                callback(self.results.records[-1], self)
        while self.round < target:
            record = self.run_round()
            if callback is not None:
                callback(record, self)
        return self.results

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to continue this run: tensors and plain Python values only,
        so ``torch.save`` / ``torch.load(..., weights_only=True)`` round-trip it.  Its
        tensors are copies: later rounds do not change a state dict kept in memory."""
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "round": self.round,
            "elapsed": self._elapsed,
            "x_global": self.x_global.detach().clone(),
            "buffers": buffers_to_vector(self.global_model) if self._has_buffers else None,
            "server": _detached_copy(self.server.state_dict()),  # not the live optimizer state
            "scaffold": ({k: v.clone() for k, v in self.scaffold.state_dict().items()}
                         if self.scaffold is not None else None),
            "results": self.results.to_dict(),
            "dp": self.privacy.state_dict() if self.privacy is not None else None,  # the DP clip and rounds so far
            # the robust rule's rounds and centered clipping's reference point (the previous aggregate)
            "robust": self.robust.state_dict() if self.robust is not None else None,
            # carry_momentum: each client's local momentum buffers (they carry into its next round)
            "local_momentum": ({int(c): [b.detach().clone() for b in bufs]
                                for c, bufs in self.trainer.momentum_buffers.items()}
                               if self.trainer.momentum_buffers else None),
        }

    _RESUMABLE = ("rounds", "eval_every", "device", "backend", "engine", "client_batch", "on_bad_client",
                  "client_state_dir", "memory_budget")

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (a run of the same settings; ``rounds``,
        ``eval_every``, ``device``, ``backend``, ``engine``, ``client_batch``,
        ``on_bad_client``, ``client_state_dir`` and ``memory_budget`` may differ)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"checkpoint version {state.get('version')!r} is not {STATE_VERSION}")
        mine = self.config.to_dict()
        for key, value in state["config"].items():
            if key not in self._RESUMABLE and mine.get(key) != value:
                raise ValueError(f"the checkpoint was made with {key}={value!r}, this run has {mine.get(key)!r}")
        with torch.no_grad():
            self.x_global.copy_(state["x_global"])
            if self._has_buffers and state.get("buffers") is not None:
                vector_to_buffers(state["buffers"].to(self.device), self.global_model)
        self.server.load_state_dict(state["server"])
        if self.scaffold is not None:
            self.scaffold.load_state_dict(state["scaffold"])
        if self.privacy is not None and state.get("dp") is not None:
            self.privacy.load_state_dict(state["dp"])
        if self.robust is not None and state.get("robust") is not None:
            self.robust.load_state_dict(state["robust"])
        if state.get("local_momentum"):
            self.trainer.momentum_buffers = {int(c): [b.to(self.device).clone() for b in bufs]
                                             for c, bufs in state["local_momentum"].items()}
        self.round = int(state["round"])
        self._elapsed = float(state.get("elapsed", 0.0))
        res = Results.from_dict(state["results"])
        self.results.records = [r for r in res.records if r["round"] <= self.round]


class _OnDevice:
    """A read-only sequence of index tensors moved to ``device`` on access (a
    :class:`~fedopt_kernels.fl.partition.CSRIndices` population is never copied whole)."""

    def __init__(self, indices, device):
        self.indices, self.device = indices, device

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.indices[i].to(self.device)


def _detached_copy(value):
    """``value`` with every tensor in it (nested dicts, lists, tuples) cloned: a state
    dict that later rounds do not change under its holder."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detached_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached_copy(v) for v in value)
    return value


def _add_stats(total: RoundStats, part: RoundStats) -> None:
    """``part``'s sums into ``total`` (a chunked round's statistics)."""
    for a, b in ((total.loss_sum, part.loss_sum), (total.clipped, part.clipped),
                 (total.clipped_norm_sum, part.clipped_norm_sum), (total.skipped, part.skipped)):
        a += b
    total.steps += part.steps


def _snapshot(stats: RoundStats) -> tuple:
    return (stats.loss_sum.clone(), stats.clipped.clone(), stats.clipped_norm_sum.clone(), stats.skipped.clone(),
            stats.steps)


def _restore(stats: RoundStats, saved: tuple) -> None:
    """Undo the steps added since :func:`_snapshot` (the same values: bitwise)."""
    for t, v in zip((stats.loss_sum, stats.clipped, stats.clipped_norm_sum, stats.skipped), saved[:4]):
        t.copy_(v)
    stats.steps = saved[4]


def _read_server_stats(stats: dict) -> dict:
    """Device tensors -> Python numbers, with one host sync for the scalars
    (:func:`fedopt_kernels.server.read_metrics`, the reader of every server round)."""
    return read_metrics(stats)
