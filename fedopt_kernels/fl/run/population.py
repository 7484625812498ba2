"""Who a run's clients are and what they hold: the dataset a config names
(:func:`load_config_dataset`), its split over the clients (:func:`make_partition`),
each round's clients (:func:`sample_clients`), FedLAW's class-balanced proxy set
(:func:`proxy_split`), and a population's index table read onto the device client by
client (:class:`DeviceIndices`).  Every draw is a function of the seed (and round): see
:mod:`.seeds`.
"""

from __future__ import annotations

from typing import List

import torch

from .config import ConfigError, SimulationConfig
from ..datasets.data import FederatedDataset, LazyFederatedDataset, load_dataset
from ..datasets.partition import Partition, dirichlet_partition, iid_partition, natural_partition
from ..seeds import proxy_seed, sampling_seed

__all__ = ["load_config_dataset", "make_partition", "sample_clients", "proxy_split", "DeviceIndices"]


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


class DeviceIndices:
    """A read-only sequence of index tensors moved to ``device`` on access (a
    :class:`~fedopt_kernels.fl.datasets.partition.CSRIndices` population is never copied whole)."""

    def __init__(self, indices, device):
        self.indices, self.device = indices, device

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.indices[i].to(self.device)
