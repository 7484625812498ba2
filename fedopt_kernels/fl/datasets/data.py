"""Datasets of the simulator: held in memory as tensors, with an optional natural split.

Built in (no download):

* ``digits``: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), as
  ``[n, 1, 8, 8]`` float images scaled to ``[0, 1]`` and standardised with the training
  set's mean and std; a stratified train/test split (80/20 by default).
* ``synthetic``: the Synthetic(alpha, beta) benchmark of FedProx (Li et al., MLSys 2020,
  ``data/synthetic_*/generate_synthetic.py``): client ``k`` has ``u_k ~ N(0, alpha)``,
  ``B_k ~ N(0, beta)``, ``W_k ~ N(u_k, 1)`` ``[60, 10]``, ``b_k ~ N(u_k, 1)``,
  ``v_k ~ N(B_k, 1)`` ``[60]``, inputs ``x ~ N(v_k, diag(j^-1.2))`` and labels
  ``argmax(softmax(x W_k + b_k))``; ``lognormal(4, 2) + 50`` samples per client
  (``iid=True``: one global ``W, b`` and ``v_k = B_k``).  The data come already split
  across clients (``client_indices``: the natural partition); each client's samples are
  split train/test and the test parts form the global test set.

* ``synthetic-lazy``: the same Synthetic(alpha, beta), each client generated from its
  own seed when a round samples it (:class:`LazyFederatedDataset`): a population of
  10^5 clients costs an array of sizes.  Not the same values as ``synthetic`` (which
  draws all clients from one stream), so a separate name.

* ``cifar10``: torchvision's CIFAR-10 when torchvision and the data are on the machine
  (nothing is downloaded).

Your own data: :meth:`FederatedDataset.from_datasets` turns any map-style
``torch.utils.data.Dataset`` pair into one; :func:`register_dataset` makes a factory
available by name to :func:`load_dataset`, and the command line also takes
``--dataset package.module:function`` (a factory called with ``seed`` and
``num_clients``).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from ..registry import Registry
from .federated_dataset import FederatedDataset

__all__ = ["FederatedDataset", "LazyFederatedDataset", "load_dataset", "register_dataset", "dataset_names", "digits",
           "synthetic", "synthetic_lazy", "cifar10"]


# ---------------------------------------------------------------------------- digits
def _digits_arrays():
    """``(images [1797, 8, 8] float, labels [1797] int)`` of scikit-learn's digits.

    Read straight from the CSV that scikit-learn ships (``sklearn/datasets/data/
    digits.csv.gz``: 64 pixel columns and the label per row), located without importing
    scikit-learn -- its import costs about as much as torch's own and nothing else of it
    is needed.  ``load_digits`` is the fallback if the file has moved.
    """
    import gzip
    import importlib.util
    import os

    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",", dtype=np.float64)
            return table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


def digits(*, seed: int = 0, test_fraction: float = 0.2, standardize: bool = True) -> FederatedDataset:
    """scikit-learn's 8x8 digits as ``[n, 1, 8, 8]`` images (stratified split by ``seed``)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xD1]))
    train_idx, test_idx = [], []
    for c in range(10):  # stratified: the same fraction of every class in the test set
        idx = np.flatnonzero(target == c)
        rng.shuffle(idx)
        n_test = int(round(len(idx) * test_fraction))
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    train_idx = np.sort(np.concatenate(train_idx))
    test_idx = np.sort(np.concatenate(test_idx))
    x_tr, x_te = x[train_idx], x[test_idx]
    if standardize:
        mean, std = x_tr.mean(), x_tr.std()
        x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    return FederatedDataset("digits", x_tr, y[train_idx], x_te, y[test_idx], 10,
                            info={"source": "sklearn.datasets.load_digits", "test_fraction": test_fraction})


# ---------------------------------------------------------------------------- synthetic
def _check_synthetic(alpha: float, beta: float, num_clients: int, test_fraction: float) -> None:
    """The arguments :func:`synthetic` and :func:`synthetic_lazy` share."""
    if alpha < 0 or beta < 0:
        raise ValueError(f"synthetic alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")


def synthetic(alpha: float = 1.0, beta: float = 1.0, *, num_clients: int = 30, iid: bool = False,
              dimension: int = 60, num_classes: int = 10, seed: int = 0, test_fraction: float = 0.2,
              max_samples_per_client: Optional[int] = None) -> FederatedDataset:
    """FedProx's Synthetic(alpha, beta) (see the module docstring), seeded by ``seed``.

    ``max_samples_per_client`` caps the heavy lognormal tail of client sizes (None: no
    cap, as in FedProx).  Every client keeps at least one training and one test sample.
    """
    _check_synthetic(alpha, beta, num_clients, test_fraction)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5E]))
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    if max_samples_per_client is not None:
        sizes = np.minimum(sizes, max(int(max_samples_per_client), 2))
    mean_w = rng.normal(0, alpha, num_clients)
    mean_b = mean_w
    big_b = rng.normal(0, beta, num_clients)
    cov_diag = np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2)
    if iid:
        w_global = rng.normal(0, 1, (dimension, num_classes))
        b_global = rng.normal(0, 1, num_classes)
    # the sizes are known up front: each client's samples go straight into preallocated
    # float32 tensors (the float64 -> float32 rounding of torch.tensor(np.concatenate(...))
    # element by element, so the same bits), not into lists of float64 arrays concatenated
    # at the end -- that held the population three times over (10 GB at 20000 clients)
    n_test_all = np.minimum(np.maximum(np.round(sizes * test_fraction).astype(np.int64), 1), sizes - 1)
    owners = sizes - n_test_all
    bounds = np.concatenate([[0], np.cumsum(owners)])
    test_bounds = np.concatenate([[0], np.cumsum(n_test_all)])
    x_tr = torch.empty(int(bounds[-1]), dimension, dtype=torch.float32)
    y_tr = torch.empty(int(bounds[-1]), dtype=torch.int64)
    x_te = torch.empty(int(test_bounds[-1]), dimension, dtype=torch.float32)
    y_te = torch.empty(int(test_bounds[-1]), dtype=torch.int64)
    for k in range(num_clients):
        v = np.ones(dimension) * big_b[k] if iid else rng.normal(big_b[k], 1, dimension)
        w = w_global if iid else rng.normal(mean_w[k], 1, (dimension, num_classes))
        b = b_global if iid else rng.normal(mean_b[k], 1, num_classes)
        xx = v + rng.standard_normal((int(sizes[k]), dimension)) * np.sqrt(cov_diag)  # N(v, diag(j^-1.2))
        yy = np.argmax(xx @ w + b, axis=1)  # argmax of the softmax = argmax of the logits
        n_test = int(n_test_all[k])
        x_te[test_bounds[k]:test_bounds[k + 1]] = torch.from_numpy(xx[:n_test])
        y_te[test_bounds[k]:test_bounds[k + 1]] = torch.from_numpy(yy[:n_test])
        x_tr[bounds[k]:bounds[k + 1]] = torch.from_numpy(xx[n_test:])
        y_tr[bounds[k]:bounds[k + 1]] = torch.from_numpy(yy[n_test:])
    idx = [torch.arange(int(bounds[k]), int(bounds[k + 1]), dtype=torch.int64) for k in range(num_clients)]
    return FederatedDataset(f"synthetic({alpha:g},{beta:g})", x_tr, y_tr, x_te, y_te, num_classes, idx,
                            info={"alpha": alpha, "beta": beta, "iid": iid, "num_clients": num_clients})


# ---------------------------------------------------------------------------- data made per client
class LazyFederatedDataset:
    """A federated dataset whose clients' training data are made when a round samples
    them: the population costs an array of client sizes, not tensors.

    ``client_fn(client) -> (x [n_i, ...] float, y [n_i] int64)`` returns client
    ``client``'s training samples, the same values on every call (seeded per client,
    or read from a memory-mapped array).  The natural partition is "client after
    client" (:func:`~fedopt_kernels.fl.datasets.partition.contiguous_partition`): client ``i``'s
    sample ``j`` is global sample ``offsets[i] + j``.  The test set is held as tensors
    (its size is the dataset's choice, not the population's).  The simulator gathers a
    round's clients with :meth:`gather` and trains on those rows only; training on the
    :meth:`materialise` d dataset gives the same bits (tested).
    """

    def __init__(self, name: str, client_sizes, client_fn: Callable, x_test: torch.Tensor, y_test: torch.Tensor,
                 num_classes: int, *, info: Optional[dict] = None, device="cpu"):
        self.name = name
        self.client_sizes = np.asarray(client_sizes, dtype=np.int64).reshape(-1)
        if self.client_sizes.size == 0 or (self.client_sizes < 1).any():
            raise ValueError(f"{name}: every client must hold at least one training sample")
        self.client_fn = client_fn
        self.x_test, self.y_test = x_test, y_test
        self.num_classes = int(num_classes)
        self.info = dict(info or {})
        self.device = torch.device(device)
        if y_test.dtype != torch.int64 or y_test.dim() != 1 or x_test.shape[0] != y_test.shape[0]:
            raise ValueError(f"{name}: y_test must be a 1-D int64 tensor, one label per test input")
        if y_test.numel() == 0:
            raise ValueError(f"{name}: the test set must be non-empty")

    @property
    def client_indices(self):
        from .partition import CSRIndices

        return CSRIndices(np.concatenate([[0], np.cumsum(self.client_sizes)]))

    @property
    def num_clients(self) -> int:
        return int(self.client_sizes.size)

    @property
    def input_shape(self) -> tuple:
        return tuple(self.x_test.shape[1:])

    @property
    def num_train(self) -> int:
        return int(self.client_sizes.sum())

    @property
    def num_test(self) -> int:
        return int(self.x_test.shape[0])

    def client_data(self, client: int) -> tuple:
        """``(x, y)`` of client ``client``'s training samples, on the dataset's device."""
        x, y = self.client_fn(int(client))
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        n = int(self.client_sizes[client])
        if x.shape[0] != n or y.shape != (n,):
            raise ValueError(f"{self.name}: client {client} should hold {n} samples, its data have "
                             f"{tuple(x.shape)} inputs and {tuple(y.shape)} labels")
        return x.to(self.device), y.to(self.device)

    def gather(self, clients) -> tuple:
        """``(x, y, starts)``: the clients' samples one after another, and where each
        client's rows start (``starts[i]`` for ``clients[i]``)."""
        xs, ys, starts, at = [], [], [], 0
        for cid in clients:
            x, y = self.client_data(cid)
            xs.append(x)
            ys.append(y)
            starts.append(at)
            at += x.shape[0]
        if not xs:
            return self.x_test[:0], self.y_test[:0], []
        return torch.cat(xs), torch.cat(ys), starts

    def to(self, device) -> "LazyFederatedDataset":
        return LazyFederatedDataset(self.name, self.client_sizes, self.client_fn, self.x_test.to(device),
                                    self.y_test.to(device), self.num_classes, info=self.info, device=device)

    def materialise(self) -> FederatedDataset:
        """Every client's data as one :class:`FederatedDataset` (small populations: tests)."""
        x, y, _ = self.gather(range(self.num_clients))
        return FederatedDataset(self.name, x, y, self.x_test, self.y_test, self.num_classes,
                                list(self.client_indices), dict(self.info))


def synthetic_lazy(alpha: float = 1.0, beta: float = 1.0, *, num_clients: int = 30, iid: bool = False,
                   dimension: int = 60, num_classes: int = 10, seed: int = 0, test_fraction: float = 0.2,
                   max_samples_per_client: Optional[int] = None, test_clients: int = 100) -> LazyFederatedDataset:
    """FedProx's Synthetic(alpha, beta), each client generated from its own seed when it
    is sampled (``--dataset synthetic-lazy``): the same distribution as
    :func:`synthetic`, NOT the same values (that draws every client from one stream,
    so client ``k`` exists only after clients ``0..k-1``).

    The population's sizes, ``u_k`` and ``B_k`` (and the IID variant's ``W, b``) are
    drawn up front, vectorised (10^5 clients: a few milliseconds); client ``k``'s
    ``v_k, W_k, b_k`` and samples from ``SeedSequence([seed, 0x5E, 1, k])``.  A client's
    first ``round(test_fraction * n_k)`` samples are its test part, as in
    :func:`synthetic`; the test set is the test parts of ``test_clients`` clients
    drawn by the seed (all clients when there are fewer), so it does not grow with
    the population.
    """
    _check_synthetic(alpha, beta, num_clients, test_fraction)
    if isinstance(test_clients, bool) or not isinstance(test_clients, int) or test_clients < 1:
        raise ValueError(f"test_clients must be a positive int, got {test_clients!r}")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5E, 0]))
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    if max_samples_per_client is not None:
        sizes = np.minimum(sizes, max(int(max_samples_per_client), 2))
    mean_w = rng.normal(0, alpha, num_clients)
    big_b = rng.normal(0, beta, num_clients)
    cov_sqrt = np.sqrt(np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2))
    w_global = rng.normal(0, 1, (dimension, num_classes)) if iid else None
    b_global = rng.normal(0, 1, num_classes) if iid else None
    n_test = np.minimum(np.maximum(np.round(sizes * test_fraction).astype(np.int64), 1), sizes - 1)
    evaluated = np.sort(rng.choice(num_clients, size=min(num_clients, test_clients), replace=False))

    def samples(k: int):
        r = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5E, 1, int(k)]))
        v = np.ones(dimension) * big_b[k] if iid else r.normal(big_b[k], 1, dimension)
        w = w_global if iid else r.normal(mean_w[k], 1, (dimension, num_classes))
        b = b_global if iid else r.normal(mean_w[k], 1, num_classes)
        xx = v + r.standard_normal((int(sizes[k]), dimension)) * cov_sqrt
        return torch.from_numpy(xx.astype(np.float32)), torch.from_numpy(np.argmax(xx @ w + b, axis=1))

    def train_part(k: int):
        x, y = samples(k)
        return x[int(n_test[k]):], y[int(n_test[k]):]

    tests = [samples(k) for k in evaluated]
    x_te = torch.cat([x[:int(n_test[k])] for k, (x, _) in zip(evaluated, tests)])
    y_te = torch.cat([y[:int(n_test[k])] for k, (_, y) in zip(evaluated, tests)])
    return LazyFederatedDataset(f"synthetic-lazy({alpha:g},{beta:g})", sizes - n_test, train_part, x_te, y_te,
                                num_classes, info={"alpha": alpha, "beta": beta, "iid": iid, "num_clients": num_clients,
                                                   "test_clients": int(evaluated.size)})


# ---------------------------------------------------------------------------- registry
_DATASETS = Registry("dataset")


def register_dataset(name: str, factory: Callable[..., FederatedDataset], *, overwrite: bool = False) -> None:
    """Make ``factory(seed=..., num_clients=..., **options) -> FederatedDataset``
    available as ``name`` (to :func:`load_dataset`, the simulator and ``fedopt``).

    The factory receives ``seed`` and ``num_clients`` as keyword arguments plus the
    options given to :func:`load_dataset`; it may ignore them.  Example::

        def cifar10(seed, num_clients, root="~/data"):
            import torchvision, torchvision.transforms as T
            t = T.Compose([T.ToTensor(), T.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))])
            return FederatedDataset.from_datasets(
                torchvision.datasets.CIFAR10(root, train=True, transform=t),
                torchvision.datasets.CIFAR10(root, train=False, transform=t),
                name="cifar10", num_classes=10)

        register_dataset("cifar10", cifar10)
    """
    _DATASETS.register(name, factory, overwrite=overwrite)


def dataset_names() -> List[str]:
    return _DATASETS.names()


def dataset_forms() -> str:
    """Every form ``--dataset`` takes, in words (its help and its error list them)."""
    return (", ".join(dataset_names()) + ", leaf-femnist:PATH, leaf-shakespeare:PATH (LEAF's files in PATH), "
            "a name registered with fedopt_kernels.fl.register_dataset, or package.module:function (your own "
            "dataset: docs/datasets.md)")


def unknown_dataset(name: str) -> Optional[str]:
    """Why ``name`` is no form of ``--dataset`` (None when it is one; a
    ``package.module:function`` is only checked when it is imported)."""
    if ":" in name:
        return None
    if name.startswith("leaf-"):
        return (f"dataset {name!r} needs the folder of its LEAF data: {name}:PATH, PATH the folder that holds "
                "train/ and test/ (LEAF's data/<name>/data)")
    if name not in _DATASETS:
        return f"unknown dataset {name!r}; choose one of {dataset_forms()}"
    return None


def load_dataset(name: str, *, seed: int = 0, num_clients: int = 20, **options) -> FederatedDataset:
    """Build the registered dataset ``name``, or call ``"package.module:function"``
    (``function(seed=..., num_clients=..., **options) -> FederatedDataset``), or load
    LEAF's ``"leaf-femnist:/path"`` / ``"leaf-shakespeare:/path"`` (:mod:`.leaf`)."""
    if name.startswith("leaf-") and ":" in name:
        from .leaf import load_leaf

        kind, _, root = name[len("leaf-"):].partition(":")
        return load_leaf(kind, root)
    problem = unknown_dataset(name)
    if problem:
        raise ValueError(problem)
    factory = _DATASETS.resolve(name)
    ds = factory(seed=seed, num_clients=num_clients, **options)
    if not isinstance(ds, (FederatedDataset, LazyFederatedDataset)):
        raise TypeError(f"the factory of dataset {name!r} returned {type(ds).__name__}, not a FederatedDataset")
    return ds


def _digits_factory(*, seed: int, num_clients: int, **options) -> FederatedDataset:
    return digits(seed=seed, **options)


def _synthetic_factory(*, seed: int, num_clients: int, alpha: float = 1.0, beta: float = 1.0,
                       **options) -> FederatedDataset:
    return synthetic(alpha, beta, num_clients=num_clients, seed=seed, **options)


def cifar10(*, seed: int = 0, num_clients: int = 20, root: Optional[str] = None) -> FederatedDataset:
    """CIFAR-10 through torchvision, if you have it (nothing is downloaded): the train
    and test sets under ``root`` (default ``$FEDOPT_DATA`` or ``~/.cache/fedopt/data``),
    normalised per channel.  Needs ``pip install torchvision`` and the data already on
    disk (``torchvision.datasets.CIFAR10(root, download=True)`` once)."""
    import os

    try:
        import torchvision
        import torchvision.transforms as T
    except ImportError:
        raise ValueError("dataset 'cifar10' needs torchvision (pip install torchvision)") from None
    root = os.path.expanduser(root or os.environ.get("FEDOPT_DATA") or "~/.cache/fedopt/data")
    t = T.Compose([T.ToTensor(), T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))])
    try:
        train = torchvision.datasets.CIFAR10(root, train=True, transform=t, download=False)
        test = torchvision.datasets.CIFAR10(root, train=False, transform=t, download=False)
    except RuntimeError as exc:
        raise ValueError(f"CIFAR-10 is not under {root} ({exc}); fetch it once with "
                         f"torchvision.datasets.CIFAR10({root!r}, download=True) or set --data-root") from None
    return FederatedDataset.from_datasets(train, test, name="cifar10", num_classes=10)


register_dataset("digits", _digits_factory)
register_dataset("synthetic", _synthetic_factory)
register_dataset("cifar10", cifar10)


def _synthetic_lazy_factory(*, seed: int, num_clients: int, alpha: float = 1.0, beta: float = 1.0,
                            **options) -> LazyFederatedDataset:
    return synthetic_lazy(alpha, beta, num_clients=num_clients, seed=seed, **options)


register_dataset("synthetic-lazy", _synthetic_lazy_factory)

from . import leaf as _leaf  # noqa: E402,F401 - registers LEAF's character model (chargru)
