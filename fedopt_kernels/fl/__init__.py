"""A small federated-learning simulator built on the fused optimizers.

Quick start::

    from fedopt_kernels.fl import Simulation, SimulationConfig
    cfg = SimulationConfig(algo="fedavg", nar="co", dataset="digits", rounds=30)
    results = Simulation(cfg).run()
    print(results.final["test_accuracy"])
    results.write("results/"); results.plot("results/")

Pieces: :mod:`~fedopt_kernels.fl.data` (digits, FedProx's Synthetic, your own data),
:mod:`~fedopt_kernels.fl.partition` (Dirichlet label split), :mod:`~fedopt_kernels.fl.models`
(MLP, FedLAW's SimpleCNN), :mod:`~fedopt_kernels.fl.client` (local training on a flat
vector with FedNAR, FedProx, SCAFFOLD, FedDecay), :mod:`~fedopt_kernels.fl.batched` (all
of a round's clients as one vmapped computation, the default engine) and
:mod:`~fedopt_kernels.fl.round_plan` (which clients it trains together, at which shapes),
:mod:`~fedopt_kernels.fl.server_side` (server optimizers and FedLAW),
:mod:`~fedopt_kernels.fl.simulation` (the round loop), :mod:`~fedopt_kernels.fl.results`
(records, files, plots), :mod:`~fedopt_kernels.fl.seeds` (the seed of every random draw).
"""

from .batched import BatchedTrainer, EngineFallbackWarning
from .client import LocalConfig, LocalTrainer, ScaffoldState
from .config import ALGORITHMS, ConfigError, SimulationConfig
from .data import FederatedDataset, dataset_names, digits, load_dataset, register_dataset, synthetic
from .models import MLP, SimpleCNN, build_model, model_names, register_model
from .partition import Partition, dirichlet_partition, iid_partition, natural_partition
from .results import Results, plot_comparison
from .seeds import batch_seed, derive_seed, init_seed
from .server_side import SERVER_DEFAULTS, ServerSide
from .simulation import Simulation, make_partition, proxy_split, sample_clients

__all__ = [
    "Simulation", "SimulationConfig", "ConfigError", "ALGORITHMS", "Results", "plot_comparison",
    "FederatedDataset", "digits", "synthetic", "load_dataset", "register_dataset", "dataset_names",
    "Partition", "dirichlet_partition", "iid_partition", "natural_partition", "make_partition", "sample_clients",
    "proxy_split",
    "MLP", "SimpleCNN", "build_model", "register_model", "model_names",
    "LocalConfig", "LocalTrainer", "ScaffoldState", "derive_seed", "init_seed", "batch_seed", "ServerSide",
    "SERVER_DEFAULTS",
    "BatchedTrainer", "EngineFallbackWarning",
]
