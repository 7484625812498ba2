"""A small federated-learning simulator built on the fused optimizers.

Quick start::

    from fedopt_kernels.fl import Simulation, SimulationConfig
    cfg = SimulationConfig(algo="fedavg", nar="co", dataset="digits", rounds=30)
    results = Simulation(cfg).run()
    print(results.final["test_accuracy"])
    results.write("results/"); results.plot("results/")

Pieces: :mod:`~fedopt_kernels.fl.datasets.data` (digits, FedProx's Synthetic, your own data),
:mod:`~fedopt_kernels.fl.datasets.partition` (Dirichlet label split), :mod:`~fedopt_kernels.fl.engine.models`
(MLP, FedLAW's SimpleCNN), :mod:`~fedopt_kernels.fl.engine.client` (local training on a flat
vector with FedNAR, FedProx, SCAFFOLD, FedDecay), :mod:`~fedopt_kernels.fl.engine.batched` (all
of a round's clients as one vmapped computation, the default engine) and
:mod:`~fedopt_kernels.fl.engine.round_plan` (which clients it trains together, at which shapes),
:mod:`~fedopt_kernels.fl.run.server_side` (the run's server algorithm and its round),
:mod:`~fedopt_kernels.fl.run.simulation` (the round loop: rounds, evaluation, checkpoints),
:mod:`~fedopt_kernels.fl.run.round_training` (a round's client training: engines, chunks,
progress), :mod:`~fedopt_kernels.fl.run.population` (a config's dataset, partition, sampled
clients and proxy set), :mod:`~fedopt_kernels.fl.run.results`
(records, files, plots), :mod:`~fedopt_kernels.fl.seeds` (the seed of every random draw).

It comes with the ``sim`` extra (``pip install fedopt_kernels[sim]``: scikit-learn for
digits, matplotlib for the plots, rich for the command line's tables): without it,
importing this package says so (:mod:`fedopt_kernels.extras`).
"""

from ..extras import require

require("sim", "fedopt_kernels.fl (the simulator)")

from .engine.batched import BatchedTrainer, EngineFallbackWarning  # noqa: E402
from .engine.client import LocalConfig, LocalTrainer, NonFiniteClientWarning, ScaffoldState  # noqa: E402
from .run.config import ALGORITHMS, ConfigError, MemoryBudgetWarning, SimulationConfig  # noqa: E402
from .datasets.data import (FederatedDataset, dataset_names, digits, load_dataset, register_dataset,  # noqa: E402
                            synthetic)
from .engine.models import MLP, SimpleCNN, build_model, model_names, register_model  # noqa: E402
from .datasets.partition import Partition, dirichlet_partition, iid_partition, natural_partition  # noqa: E402
from .run.results import Results, plot_comparison  # noqa: E402
from .seeds import batch_seed, derive_seed, init_seed  # noqa: E402
from .run.server_side import ServerSide  # noqa: E402
from .run.simulation import Simulation, make_partition, proxy_split, sample_clients  # noqa: E402
from .engine.client_state import ClientStateStore  # noqa: E402
from .datasets.data import LazyFederatedDataset, synthetic_lazy  # noqa: E402
from .datasets.leaf import CharGRU, load_leaf  # noqa: E402
from .datasets.partition import CSRIndices, contiguous_partition  # noqa: E402

__all__ = [
    "Simulation", "SimulationConfig", "ConfigError", "ALGORITHMS", "Results", "plot_comparison",
    "FederatedDataset", "digits", "synthetic", "load_dataset", "register_dataset", "dataset_names",
    "Partition", "dirichlet_partition", "iid_partition", "natural_partition", "make_partition", "sample_clients",
    "proxy_split",
    "MLP", "SimpleCNN", "build_model", "register_model", "model_names",
    "LocalConfig", "LocalTrainer", "ScaffoldState", "derive_seed", "init_seed", "batch_seed", "ServerSide",
    "BatchedTrainer", "EngineFallbackWarning", "NonFiniteClientWarning", "MemoryBudgetWarning",
    "ClientStateStore", "LazyFederatedDataset", "synthetic_lazy", "load_leaf", "CharGRU", "CSRIndices",
    "contiguous_partition",
]
