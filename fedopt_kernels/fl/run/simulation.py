"""The round loop of the simulator.

One :class:`Simulation` owns the data (tensors on the device), the partition, the
global model (its parameters are views of ONE flat vector ``x_global``), one local
model for all clients (:class:`~fedopt_kernels.fl.engine.client.LocalTrainer`), the server
side (:class:`~fedopt_kernels.fl.run.server_side.ServerSide`) and the :class:`Results`.  A round:

1. sample ``per_round`` of the ``clients`` uniformly without replacement;
2. train them (engine ``"batched"``: all together as one ``[C, N]`` computation,
   :mod:`fedopt_kernels.fl.engine.batched`; ``"sequential"``: one after another on the local
   model), each writing ``D_i = x_global - x_end_i`` into its row of a preallocated
   ``[C, N]`` tensor;
3. the server round (:class:`fedopt_kernels.server.ServerRound`, the Flower strategies'
   too) on that tensor: the clients weighted by the algorithm's own rule
   (``weighting="auto"``: uniform for scaffold, fedexp and asnes, data size for the
   others; :mod:`fedopt_kernels.server.weighting`), the aggregation (the robust rule or
   DP-FedAvg of the config), the step, SCAFFOLD's control variates (without the clients
   the step excluded), the floating buffers (BatchNorm statistics: averaged with the
   parameters' weights; FedLAW keeps those of its proxy training) and the record;
4. evaluate the global model on the test set (FedLAW with ``proxy_source="test"``: on
   the test examples outside its proxy set); append a record.

Clients that cannot take part (``config.on_bad_client="exclude"``, the default): a
client without samples (``no_data``, found before anything trains) or whose local
training raises an ``Exception`` (``error``; Ctrl-C and other ``BaseException`` s still
stop the run) is left out of its round -- its partial statistics undone, no row in the
server step, no SCAFFOLD update -- and the server step leaves out NaN/Inf updates
(``nonfinite``).  The round's record counts them (``excluded_clients`` and
``excluded_<reason>`` for every reason of
:data:`~fedopt_kernels.fl.run.server_side.BAD_CLIENT_REASONS`; ``left_out`` lists
``[client, reason]`` when any), one warning per round names them (logger
``fedopt_kernels.fl.run.simulation``), and the round equals the same round without those
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

:class:`Simulation` coordinates parts that each own their state and their piece of
the checkpoint:

* :attr:`~Simulation.population` (:class:`~fedopt_kernels.fl.run.population.Population`):
  the dataset, partition, sampling, held-out clients, corruption, attack and proxy set
  (:func:`load_config_dataset`, :func:`make_partition`, :func:`sample_clients`,
  :func:`proxy_split` are re-exported here);
* :attr:`~Simulation.training` (:class:`~fedopt_kernels.fl.run.round_training.RoundTraining`):
  the local model, the engines (``"batched"``, ``"sequential"``, ``"auto"``) and their
  fallback, chunked rounds under ``memory_budget``, the progress reports, the clients'
  state (SCAFFOLD's ``c_i``, error feedback, carried momentum) and the replies;
* :attr:`~Simulation.server` (:class:`~fedopt_kernels.fl.run.server_side.ServerSide`): the
  algorithm, its schedule, the round (:class:`~fedopt_kernels.server.ServerRound`) and
  its components' state (DP, robust rule);
* :attr:`~Simulation.evaluation` (:class:`~fedopt_kernels.fl.run.evaluation.Evaluation`);
* the coordinator itself: the global model, the round number, the :class:`Results` and
  the checkpoint (:mod:`~fedopt_kernels.fl.run.checkpoint`).

The names the simulator has always offered (``sim.dataset``, ``sim.updates``,
``sim.scaffold``, ...) read and write the part that owns them.
"""

from __future__ import annotations

import copy
import platform
import time
from typing import Callable, List, Optional, Union

import torch
from torch import nn

from ... import __version__
from ...utils import buffers_to_vector, flatten_parameters_, vector_to_buffers
from ..datasets.data import FederatedDataset
from ..datasets.partition import Partition
from ..engine.models import build_model
from ..seeds import init_seed
from .checkpoint import STATE_VERSION, check_resumable
from .config import ConfigError, SimulationConfig
from .evaluation import Evaluation
from .interrupts import deferred_interrupts
from .left_out import LeftOutLog
# re-exported: fedopt_kernels.fl.run.simulation has always offered these
from .population import Population, load_config_dataset, make_partition, proxy_split, sample_clients
from .results import Results
from .round_training import RoundTraining
from .server_side import ServerSide

__all__ = ["Simulation", "make_partition", "load_config_dataset", "sample_clients", "proxy_split"]


def _delegate(part: str, name: str) -> property:
    """A property of :class:`Simulation` that reads (and writes) ``name`` of its part
    ``part``: a name the simulator has always offered, now owned by that part."""
    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value):
        setattr(getattr(self, part), name, value)
    return property(get, put, doc=f"``{part}.{name}``")


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
        self.population = Population(config, self.device, dataset=dataset, partition=partition,
                                     hold_out_proxy=hold_out_proxy)
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.global_model = _global_model(config, self.population, model).to(self.device)
        if loss_fn is None:  # cross-entropy over the dataset's classes: one output per class
            _check_outputs(self.global_model, self.population)
        local_model = copy.deepcopy(self.global_model)  # before its parameters become views of x_global
        self.x_global = flatten_parameters_(self.global_model)
        self.numel = self.x_global.numel()
        self.training = self._training_part(local_model)
        proxy_loader = self.population.proxy_loader() if config.needs_proxy else None
        self.server = ServerSide(config, self.global_model, self.x_global, proxy_loader=proxy_loader,
                                 loss_fn=self.loss_fn, client_state=self.training.scaffold)
        self.evaluation = Evaluation(self.global_model, self.x_global, self.loss_fn, self.population)
        self.left_out = LeftOutLog()  # the record's and the log's account of the clients left out
        self.round = 0
        self._elapsed = 0.0
        self.results = Results(config.to_dict(), self._meta(), self.partition.summary(), label=config.algo)
        if config.recipe is not None:  # the recipe the settings came from: each value, its source, overrides
            from .recipes import get as get_recipe

            self.results.meta["recipe"] = get_recipe(config.recipe).resolved(config)
        if self.corruption is not None:
            self.results.meta["corruption"] = self.corruption.to_dict()
        recorded = {**self.server.meta(), **({"attack": self.attack.to_dict()} if self.attack is not None else {})}
        for key in ("dp", "attack", "aggregator"):  # DP-FedAvg, the attack, the robust rule: in the results' order
            if key in recorded:
                self.results.meta[key] = recorded[key]
        self.training.setup(self.server, self.results.meta)

    def _training_part(self, local_model: nn.Module) -> RoundTraining:
        """The local-training part (the distributed simulator's spreads rounds over ranks)."""
        return RoundTraining(self.config, self.population, self.global_model, local_model, self.x_global,
                             self.loss_fn)

    def _meta(self) -> dict:
        from ... import backends

        try:
            backend = backends.resolve_name(self.config.backend, self.device.type)
        except Exception as exc:  # noqa: BLE001 - reported, the step would raise the same
            backend = f"unavailable ({exc})"
        ds, pop = self.dataset, self.population
        return {"fedopt_kernels": __version__, "torch": str(torch.__version__), "python": platform.python_version(),
                "device": str(self.device), "backend": backend, "threads": torch.get_num_threads(),
                "num_parameters": self.numel, "dataset": ds.name, "num_train": ds.num_train,
                "num_test": pop.num_eval, "input_shape": list(ds.input_shape), "num_classes": ds.num_classes,
                "model": type(self.global_model).__name__, "server": self.server.hyper,
                "weighting": self.config.resolved_weighting,
                "proxy": ({"source": self.config.proxy_source, "size": int(pop.proxy_indices.numel()),
                           "held_out_of_test": pop.eval_indices is not None}
                          if pop.proxy_indices is not None else None)}

    # ------------------------------------------------------------------ the parts' names, kept
    dataset, partition = _delegate("population", "dataset"), _delegate("population", "partition")
    client_indices = _delegate("population", "client_indices")
    client_sizes = _delegate("population", "client_sizes")
    train_x, train_y = _delegate("population", "train_x"), _delegate("population", "train_y")
    corruption, attack = _delegate("population", "corruption"), _delegate("population", "attack")
    proxy_indices, eval_indices = _delegate("population", "proxy_indices"), _delegate("population", "eval_indices")
    training_clients = _delegate("population", "training_clients")
    holdout_clients = _delegate("population", "holdout_clients")
    num_eval, _lazy = _delegate("population", "num_eval"), _delegate("population", "lazy")
    _proxy_gen = _delegate("population", "proxy_gen")
    trainer, local, batched = _delegate("training", "trainer"), _delegate("training", "local"), _delegate(
        "training", "batched")
    updates, buffer_rows = _delegate("training", "updates"), _delegate("training", "buffer_rows")
    scaffold, compression = _delegate("training", "scaffold"), _delegate("training", "compression")
    client_state, progress = _delegate("training", "client_state"), _delegate("training", "progress")
    _chunk, _foldable = _delegate("training", "_chunk"), _delegate("training", "_foldable")
    _has_buffers = _delegate("training", "_has_buffers")
    _round_kept, _round_bad = _delegate("training", "round_kept"), _delegate("training", "round_bad")
    privacy, robust = _delegate("server", "privacy"), _delegate("server", "robust")
    _log_exclusions = _delegate("left_out", "enabled")  # the distributed simulator logs on rank 0 only

    def _train_clients(self, round_number: int, clients: List[int], **kw):
        """:meth:`RoundTraining.train_clients` (an instance attribute of this name
        replaces it in tests that make a client fail)."""
        return self.training.train_clients(round_number, clients, **kw)

    # ------------------------------------------------------------------ rounds
    def sample_clients(self, round_number: int) -> List[int]:
        """The round's clients (:meth:`Population.sample_clients`)."""
        return self.population.sample_clients(round_number)

    def evaluate(self, batch_size: int = 2048) -> tuple:
        """``(accuracy, mean loss)`` of the global model on the test set (less FedLAW's
        proxy set when it is held out of it)."""
        return self.evaluation.evaluate(batch_size)

    def evaluate_holdout(self, batch_size: int = 2048) -> tuple:
        """``(accuracy, mean loss)`` of the global model on the held-out clients' data."""
        return self.evaluation.evaluate_holdout(batch_size)

    def evaluate_average(self, x_before: torch.Tensor, round_number: int) -> tuple:
        """:meth:`evaluate` of the mean of the last two global iterates (FedExP's)."""
        return self.evaluation.evaluate_average(x_before, round_number, self.evaluate)

    def run_round(self, clients: Optional[List[int]] = None) -> dict:
        """Run the next round; returns (and records) its record.  ``clients``: the round's
        clients instead of :meth:`sample_clients`'s (the virtual clock's synchronous rounds,
        :mod:`~fedopt_kernels.fl.run.clocked`, keep only those that finished in time).

        Client training only writes scratch buffers; the round then commits (control
        variates, server step, evaluation, record) with Ctrl-C (and SIGTERM / SIGHUP
        under :func:`~fedopt_kernels.fl.run.interrupts.stop_on_signals`) deferred to the end
        of the commit.  So an interrupted run always stands at a completed round and its
        :meth:`state_dict` resumes exactly.
        """
        cfg = self.config
        t0 = time.perf_counter()
        r = self.round + 1
        # the threads the rounds run on (set after construction by fedopt simulate --threads)
        self.results.meta["threads"] = torch.get_num_threads()
        clients = self.sample_clients(r) if clients is None else list(clients)
        try:
            stats = self._train_clients(r, clients)
            if clients and not self._round_kept:  # every client failed to train: nothing to aggregate
                raise RuntimeError(
                    f"round {r}: none of its {len(clients)} client(s) could train, so the round has nothing to "
                    "aggregate (a failure that hits every client is rarely the clients' own): "
                    + "; ".join(f"client {cid}: {reason} ({detail})" for cid, reason, detail in self._round_bad))
        except BaseException:
            self.training.discard_round()
            raise
        with deferred_interrupts():
            self.population.seed_proxy_order(r)
            x_before = self.x_global.detach().clone() if cfg.eval_avg_last_two else None
            if self._round_kept:
                self.server.schedule(r)
            # the round (fedopt_kernels.server.ServerRound): weights, aggregation, step, SCAFFOLD, buffers, record
            replies, extra = self.training.round_replies(clients, r)
            outcome = self.server.round(replies)
            record = {"round": r, "clients": clients}
            record.update(stats.summary())
            record["local_lr"] = self.local.lr_at(r - 1, 0)
            record["weight_decay"] = self.local.weight_decay_at(r - 1)
            record.update(outcome.record(extra))
            self.left_out.record(record, outcome.left_out, self.training.round_nonfinite, bool(self._round_kept))
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

    def run(self, rounds: Optional[int] = None, *, callback: Optional[Callable[[dict, "Simulation"], None]] = None
            ) -> Results:
        """Run until ``rounds`` rounds are done in total (default ``config.rounds``).

        Round 0 (the untrained model's test accuracy and loss) is recorded first.
        ``callback(record, simulation)`` is called after every round (and after round 0);
        a ``KeyboardInterrupt`` propagates with :attr:`results` holding every finished
        round (wrap the call in :func:`~fedopt_kernels.fl.run.interrupts.stop_on_signals`
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

    # ------------------------------------------------------------------ the parts' names, kept
    dataset = _delegate("population", "dataset")
    partition = _delegate("population", "partition")
    client_indices = _delegate("population", "client_indices")
    client_sizes = _delegate("population", "client_sizes")
    train_x = _delegate("population", "train_x")
    train_y = _delegate("population", "train_y")
    corruption = _delegate("population", "corruption")
    attack = _delegate("population", "attack")
    proxy_indices = _delegate("population", "proxy_indices")
    eval_indices = _delegate("population", "eval_indices")
    training_clients = _delegate("population", "training_clients")
    holdout_clients = _delegate("population", "holdout_clients")
    num_eval = _delegate("population", "num_eval")
    _lazy = _delegate("population", "lazy")
    _proxy_gen = _delegate("population", "proxy_gen")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to continue this run: tensors and plain Python values only,
        so ``torch.save`` / ``torch.load(..., weights_only=True)`` round-trip it.  Its
        tensors are copies: later rounds do not change a state dict kept in memory.  The
        keys (:mod:`.checkpoint`) are those of every earlier version."""
        server, clients = self.server.checkpoint(), self.training.state_dict()
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "round": self.round,
            "elapsed": self._elapsed,
            "x_global": self.x_global.detach().clone(),
            "buffers": buffers_to_vector(self.global_model) if self._has_buffers else None,
            "server": server["server"],
            "scaffold": clients["scaffold"],
            "results": self.results.to_dict(),
            "dp": server["dp"],
            "robust": server["robust"],
            "local_momentum": clients["local_momentum"],
            "error_feedback": clients["error_feedback"],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (a run of the same settings; ``rounds``,
        ``eval_every``, ``device``, ``backend``, ``engine``, ``client_batch``,
        ``on_bad_client``, ``client_state_dir`` and ``memory_budget`` may differ)."""
        check_resumable(state, self.config)
        with torch.no_grad():
            self.x_global.copy_(state["x_global"])
            if self._has_buffers and state.get("buffers") is not None:
                vector_to_buffers(state["buffers"].to(self.device), self.global_model)
        self.server.load_checkpoint(state)
        self.training.load_state_dict(state)
        self.round = int(state["round"])
        self._elapsed = float(state.get("elapsed", 0.0))
        res = Results.from_dict(state["results"])
        self.results.records = [r for r in res.records if r["round"] <= self.round]


# ---------------------------------------------------------------------------- the global model
def _global_model(cfg: SimulationConfig, population: Population, model) -> nn.Module:
    """The global model: ``model`` (a module or a factory of one) or ``cfg.model``, made
    under the seed's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed(cfg.seed))
        if model is None:
            opts = {"hidden": cfg.hidden} if cfg.model == "mlp" else {}
            try:
                m = build_model(cfg.model, population.dataset.input_shape, population.dataset.num_classes, **opts)
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

def _check_outputs(model: nn.Module, population: Population) -> None:
    """The model must give one score per class (``[batch, num_classes]``): a model
    with more outputs trains under cross-entropy with classes that never occur, one
    with fewer fails mid-round.  One forward of two training examples in eval mode
    (no statistics change, no gradient)."""
    k = population.dataset.num_classes
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model((population.dataset.x_test if population.lazy else population.dataset.x_train)[:2])
    except Exception:  # noqa: BLE001 - the model's own error shows in the first round as before
        return
    finally:
        model.train(was_training)
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] != k:
        raise ConfigError(f"the model gives {out.shape[1]} outputs per example but dataset "
                          f"{population.dataset.name!r} has {k} classes: make its last layer {k} wide (or pass "
                          "loss_fn= for a loss that is not cross-entropy over the classes)")
