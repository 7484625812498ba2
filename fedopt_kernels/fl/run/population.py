"""Who a run's clients are and what they hold: the dataset a config names
(:func:`load_config_dataset`), its split over the clients (:func:`make_partition`),
each round's clients (:func:`sample_clients`), FedLAW's class-balanced proxy set
(:func:`proxy_split`), and a population's index table read onto the device client by
client (:class:`DeviceIndices`).  Every draw is a function of the seed (and round): see
:mod:`.seeds`.

:class:`Population` is the simulator's data part: it owns all of these for one run
(with the corrupted clients' damage and the attackers' poisoned labels), so that
:class:`~fedopt_kernels.fl.run.simulation.Simulation` only coordinates.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .config import ConfigError, SimulationConfig
from ..datasets.attacks import Attack
from ..datasets.corruption import corrupt_client_data
from ..datasets.data import FederatedDataset, LazyFederatedDataset, load_dataset
from ..datasets.partition import CSRIndices, Partition, dirichlet_partition, iid_partition, natural_partition
from ..seeds import proxy_order_seed, proxy_seed, sampling_seed

__all__ = ["load_config_dataset", "make_partition", "sample_clients", "proxy_split", "DeviceIndices", "Population"]


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


class Population:
    """The clients of one run and what they hold (the simulator's data part).

    It owns the dataset (on ``device``), its :attr:`partition`, each client's sample
    indices (:attr:`client_indices`) and data size (:attr:`client_sizes`), what the
    clients train on (:attr:`train_x`, :attr:`train_y`: the training set with the
    corrupted clients' samples damaged, ``config.corrupt_*``, and the label-flipping
    attackers' labels flipped; :attr:`dataset` itself stays clean), the attack
    (:attr:`attack`, ``config.attack``), the held-out clients, each round's sample, and
    FedLAW's proxy set (:attr:`proxy_indices`; :attr:`eval_indices`: the test examples
    left for evaluation when it is held out of the test set).  A lazy dataset's clients
    are made when sampled (:meth:`round_data`): the population then costs index tables.

    ``hold_out_proxy``: hold the test-side proxy set out of the evaluation even when
    ``config.algo`` does not use it (None: only when it does).
    """

    def __init__(self, config: SimulationConfig, device: torch.device, *, dataset: Optional[FederatedDataset] = None,
                 partition: Optional[Partition] = None, hold_out_proxy: Optional[bool] = None):
        self.config, self.device = config, device
        ds = dataset if dataset is not None else load_config_dataset(config)
        self.partition = partition if partition is not None else make_partition(config, ds)
        if self.partition.num_clients != config.clients:
            raise ConfigError(f"the partition has {self.partition.num_clients} clients but clients is {config.clients}")
        self.dataset = ds.to(device)
        self.lazy = isinstance(ds, LazyFederatedDataset)
        if self.lazy and config.corrupt_fraction > 0:
            raise ConfigError(f"corrupt-fraction needs the whole training set in memory; dataset {ds.name!r} is "
                              "made client by client")
        if self.lazy and config.needs_proxy and config.proxy_source == "train":
            raise ConfigError(f"proxy-source train needs the whole training set in memory; dataset {ds.name!r} is "
                              "made client by client (use proxy-source test)")
        self.round_index: Optional[dict] = None  # client -> its rows of the round's data (lazy datasets)
        parts = self.partition.client_indices
        self.client_indices = (DeviceIndices(parts, device) if isinstance(parts, CSRIndices)
                               else [ix.to(device) for ix in parts])
        self.client_sizes = torch.tensor(self.partition.sizes, dtype=torch.float64)
        self.train_x, self.train_y, self.corruption = self._corrupt()
        # attacks for testing (fl/datasets/attacks.py); labelflip's attackers train on flipped labels
        self.attack = (Attack.build(config.attack, config.attack_fraction, config.clients, config.seed)
                       if config.attack != "none" else None)
        if self.attack is not None:
            self.train_y = self.attack.poison_labels(self.train_y, self.client_indices, ds.num_classes)
        self.proxy_indices: Optional[torch.Tensor] = None  # into the train or test set (proxy_source)
        self.eval_indices: Optional[torch.Tensor] = None  # test examples evaluated (None: all)
        self.proxy_gen = torch.Generator()  # the proxy loader's batch order, reseeded every round
        hold_out = config.needs_proxy if hold_out_proxy is None else bool(hold_out_proxy)
        if config.proxy_source == "test" and (hold_out or config.needs_proxy):
            self.proxy_indices, self.eval_indices = proxy_split(self.dataset.y_test, config.proxy_size, config.seed,
                                                                name="the test set")
        elif config.needs_proxy:
            self.proxy_indices, _ = proxy_split(self.dataset.y_train, config.proxy_size, config.seed,
                                                name="the training set", need_rest=False)

    def _corrupt(self):
        """``(x_train, y_train, Corruption or None)`` the clients train on."""
        cfg, ds = self.config, self.dataset
        if self.lazy:  # placeholders of the right kind; a round trains on its clients' rows
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

    # ------------------------------------------------------------------ who trains
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
        stream, which no round uses), never sampled for training, as [FedDecay] section 4
        holds out 20% of the users to measure generalisation to new ones."""
        h = self.config.holdout_clients
        if not h:
            return []
        g = torch.Generator().manual_seed(sampling_seed(self.config.seed, 0))
        return sorted(torch.randperm(self.config.clients, generator=g)[:h].tolist())

    # ------------------------------------------------------------------ what they train on
    def client_rows(self, cid: int) -> torch.Tensor:
        """Client ``cid``'s sample indices into what the engines train on: the training
        set, or (lazy datasets) the round's own rows."""
        return self.client_indices[cid] if self.round_index is None else self.round_index[cid]

    def round_data(self, clients: Optional[List[int]]) -> tuple:
        """Lazy datasets: make the round's ``clients``' samples (None: drop them) and
        return ``(x, y)``, the new :attr:`train_x` and :attr:`train_y`.  Client ``i``'s
        sample ``j`` is row ``start_i + j``, so its batches (drawn from positions) pick
        the samples they pick in the materialised dataset: the same bits."""
        if clients is None:
            x, y = self.dataset.x_test[:1], self.dataset.y_test[:1]
            self.round_index = None
        else:
            x, y, starts = self.dataset.gather(clients)
            sizes = self.partition.client_indices.sizes()
            self.round_index = {cid: torch.arange(s, s + int(sizes[cid]), device=self.device)
                                for cid, s in zip(clients, starts)}
        self.train_x, self.train_y = x, y
        return x, y

    # ------------------------------------------------------------------ FedLAW's proxy set
    def proxy_loader(self):
        """FedLAW's proxy set (:attr:`proxy_indices`, drawn by :func:`proxy_split`): from
        the test set (``proxy_source="test"``, [FedLAW] appendix D.2) or the pooled
        training data (``"train"``); batches of 128 in a per-round seeded order
        (:meth:`seed_proxy_order`)."""
        ds = self.dataset
        idx = self.proxy_indices.to(self.device)
        if self.config.proxy_source == "test":
            data = torch.utils.data.TensorDataset(ds.x_test[idx], ds.y_test[idx])
        else:
            data = torch.utils.data.TensorDataset(ds.x_train[idx], ds.y_train[idx])
        return torch.utils.data.DataLoader(data, batch_size=128, shuffle=True, generator=self.proxy_gen)

    def seed_proxy_order(self, round_number: int) -> None:
        """The proxy loader's batch order of round ``round_number``: a function of the
        seed and the round, so a resumed run draws the same batches."""
        self.proxy_gen.manual_seed(proxy_order_seed(self.config.seed, round_number))

    @property
    def num_eval(self) -> int:
        """How many test examples are evaluated (the test set, less FedLAW's proxy set
        when it is held out of it)."""
        return self.dataset.num_test if self.eval_indices is None else int(self.eval_indices.numel())
