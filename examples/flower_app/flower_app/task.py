"""Model and data of the app: an MLP on scikit-learn's 8x8 digits, split across clients
with fedopt_kernels' label-Dirichlet partition -- the same model, initial values, data and
partition as ``fedopt simulate --dataset digits --model mlp`` with the same seed."""

from __future__ import annotations

from functools import lru_cache

import torch

from fedopt_kernels.fl import build_model, digits, dirichlet_partition, proxy_split
from fedopt_kernels.integrations.flower import init_seed


@lru_cache(maxsize=4)
def load_data(seed: int):
    """The digits dataset as tensors (the simulator's stratified 80/20 split)."""
    return digits(seed=seed)


@lru_cache(maxsize=16)
def partition(seed: int, num_partitions: int, alpha: float):
    ds = load_data(seed)
    return dirichlet_partition(ds.y_train, num_partitions, alpha, seed=seed)


def client_data(seed: int, partition_id: int, num_partitions: int, alpha: float):
    """``(x, y)``: the training samples of client ``partition_id``."""
    ds = load_data(seed)
    idx = partition(seed, num_partitions, alpha).client_indices[partition_id]
    return ds.x_train[idx], ds.y_train[idx]


def test_data(seed: int, proxy_size: int = 0):
    """The test examples the server evaluates on: all of them, or with ``proxy_size > 0``
    those outside FedLAW's proxy set ([FedLAW] appendix D.2, as ``fedopt simulate``)."""
    ds = load_data(seed)
    if proxy_size <= 0:
        return ds.x_test, ds.y_test
    _, rest = proxy_split(ds.y_test, proxy_size, seed, name="the test set")
    return ds.x_test[rest], ds.y_test[rest]


def make_model(seed: int, hidden: int) -> torch.nn.Module:
    """The simulator's initial MLP for ``seed`` (clients overwrite the values anyway)."""
    ds = load_data(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed(seed))
        return build_model("mlp", ds.input_shape, ds.num_classes, hidden=(hidden, hidden))


def proxy_loader(seed: int, size: int):
    """FedLAW's server-side proxy set: ``size`` class-balanced TEST examples ([FedLAW]
    appendix D.2; the simulator's default ``proxy_source="test"``, the same draw)."""
    ds = load_data(seed)
    idx, _ = proxy_split(ds.y_test, size, seed, name="the test set")
    data = torch.utils.data.TensorDataset(ds.x_test[idx], ds.y_test[idx])
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(data, batch_size=128, shuffle=True, generator=g)
