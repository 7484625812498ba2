"""Splitting a training set across clients.

:func:`dirichlet_partition` is the label-Dirichlet split used by FedNAR, FedExP and
FedLAW (Hsu et al. 2019; Li et al. "Federated Learning on Non-IID Data Silos", the
``noniid-labeldir`` of NIID-Bench): for every class ``c`` the class's samples are
divided among the ``M`` clients in proportions ``q_c ~ Dirichlet(alpha * 1_M)``, so each
client ends up with its own label distribution AND its own size (clients of unequal
sizes, as in the papers).  Small ``alpha`` (0.3) is very skewed; large ``alpha`` (10)
nearly IID.  As in NIID-Bench, a client that already holds ``n / M`` samples gets no
more of later classes, and the whole draw is repeated until every client has at least
``min_size`` samples -- up to ``max_tries`` times, while a repeat can be expected to
succeed and stays cheap (:data:`RETRY_SHORT`, :data:`RETRY_WORK`).  A draw
that still leaves clients short (a cross-device population: at 10^5 clients of ~10
samples, ~200 clients are short in every draw, so retrying cannot succeed: the repeats
stop at a draw that leaves more than :data:`RETRY_SHORT` clients short) is topped up:
each short client gets the samples it lacks, drawn uniformly from the other clients'
samples beyond their own ``min_size``.  So every client holds at least
``min_size`` samples, every sample is held once, and the partition is the Dirichlet
draw except those few moved samples (at most ``min_size`` per short client).

Everything is drawn from a NumPy generator seeded by ``seed`` alone, so a partition is
reproducible and independent of everything else the simulator draws.
"""

from __future__ import annotations

from collections.abc import Sequence as _SequenceABC
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

__all__ = ["Partition", "CSRIndices", "dirichlet_partition", "iid_partition", "natural_partition",
           "contiguous_partition", "RETRY_SHORT", "RETRY_WORK"]


class CSRIndices(_SequenceABC):
    """Every client's sample indices as ONE flat int64 array and ``M + 1`` offsets
    (client ``i`` holds ``flat[offsets[i]:offsets[i + 1]]``): a population's index
    table in two arrays instead of ``M`` tensors.  Indexing gives a tensor view (no
    copy); it is a read-only sequence, not a list (``torch.cat`` wants
    ``list(...)``, or :attr:`flat` directly).  ``flat=None``: the indices are
    ``offsets[i] .. offsets[i + 1] - 1`` (a natural split of data stored client after
    client), costing the offsets alone."""

    def __init__(self, offsets: np.ndarray, flat: Optional[np.ndarray] = None):
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.flat = None if flat is None else np.ascontiguousarray(flat, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"client {i} out of range for {len(self)} clients")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if self.flat is None:
            return torch.arange(a, b, dtype=torch.int64)
        return torch.from_numpy(self.flat[a:b])

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class Partition:
    """Which training samples each client holds (``client_indices[i]``: int64 indices)."""

    client_indices: List[torch.Tensor]
    method: str
    alpha: Optional[float] = None
    seed: Optional[int] = None

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @property
    def sizes(self) -> List[int]:
        if isinstance(self.client_indices, CSRIndices):
            return self.client_indices.sizes().tolist()
        return [int(ix.numel()) for ix in self.client_indices]

    def label_counts(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        """``[M, num_classes]`` int64 counts of every class at every client."""
        return torch.stack([torch.bincount(labels[ix], minlength=num_classes) for ix in self.client_indices])

    def summary(self) -> dict:
        s = np.asarray(self.sizes)
        return {"method": self.method, "alpha": self.alpha, "seed": self.seed, "num_clients": self.num_clients,
                "total": int(s.sum()), "min": int(s.min()), "max": int(s.max()), "mean": float(s.mean()),
                "sizes": self.sizes}


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), 0xA11]))


#: a draw that leaves more clients than this short of ``min_size`` ends the repeats: the
#: chance that a repeat leaves none short is then about ``exp(-RETRY_SHORT)`` (in every
#: setting measured, the count of short clients varies little from draw to draw), so the
#: repeats could only burn time (10^5 clients of ~10 samples: ~200 short in every draw)
RETRY_SHORT = 32
#: how many element-steps (``n + classes * M`` per draw) the repeated draws may take in
#: all: 1000 draws of CIFAR-10 (50,000 samples, 10 classes) over 100 clients (the papers'
#: settings keep NIID-Bench's repeats), 30 of 10^6 samples over 10^5 clients; at least one
RETRY_WORK = 60_000_000


def dirichlet_partition(labels, num_clients: int, alpha: float, *, seed: int = 0, min_size: Optional[int] = None,
                        max_tries: int = 1000) -> Partition:
    """Label-Dirichlet partition of ``labels`` (a 1-D tensor/array) over ``num_clients``.

    ``min_size`` (default ``min(10, n // (10 * num_clients))``, at least 1) is the fewest
    samples a client may hold; draws are repeated up to ``max_tries`` times (within
    :data:`RETRY_SHORT` and :data:`RETRY_WORK`) to meet it, then the last draw's short
    clients are topped up (module docstring).  Every sample goes to exactly one client;
    the indices of a client are sorted.
    """
    y = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels).reshape(-1)
    n = y.shape[0]
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    if not (isinstance(alpha, (int, float)) and alpha > 0 and np.isfinite(alpha)):
        raise ValueError(f"the Dirichlet alpha must be > 0, got {alpha!r}")
    if n < num_clients:
        raise ValueError(f"cannot split {n} samples over {num_clients} clients (fewer samples than clients)")
    if min_size is None:
        min_size = max(1, min(10, n // (10 * num_clients)))
    if min_size * num_clients > n:
        raise ValueError(f"min_size={min_size} per client needs {min_size * num_clients} samples, have {n}")
    if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
        raise ValueError(f"max_tries must be a positive integer, got {max_tries!r}")
    rng = _rng(seed)
    classes = np.unique(y)
    by_class = [np.flatnonzero(y == c) for c in classes]
    tries = min(max_tries, max(1, RETRY_WORK // (n + len(classes) * num_clients)))
    for _ in range(tries):
        owner, counts = _dirichlet_draw(rng, by_class, n, num_clients, float(alpha))
        short = int((counts < min_size).sum())
        if short == 0 or short > RETRY_SHORT:
            break
    if short:
        owner, counts = _top_up(rng, owner, counts, min_size)
    # each client's indices ascending: one sort of the key (owner, index) packed into an int64 (< M * n)
    flat = torch.from_numpy(np.sort(owner * n + np.arange(n, dtype=np.int64)) % n)
    idx = list(flat.split(counts.tolist()))
    return Partition(idx, "dirichlet", float(alpha), int(seed))


def _dirichlet_draw(rng: np.random.Generator, by_class: list, n: int, num_clients: int, alpha: float) -> tuple:
    """One draw: ``(owner, counts)``, the client of every sample and each client's size."""
    owners = np.arange(num_clients)
    cap = n / num_clients
    owner = np.empty(n, dtype=np.int64)  # who gets each sample (every sample goes to one client)
    counts = np.zeros(num_clients, dtype=np.int64)
    for members in by_class:
        idx_c = members.copy()
        rng.shuffle(idx_c)
        q = rng.dirichlet(np.full(num_clients, alpha))
        q = q * (counts < cap)  # NIID-Bench: a full client takes no more
        total = q.sum()
        q = q / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
        cuts = (np.cumsum(q) * len(idx_c)).astype(np.int64)[:-1]
        # np.split(idx_c, cuts)'s part k: idx_c[cuts[k-1]:cuts[k]] (cuts clipped as slicing does)
        bounds = np.concatenate([[0], np.clip(np.maximum.accumulate(cuts), 0, len(idx_c)), [len(idx_c)]])
        take = np.diff(bounds)
        owner[idx_c] = np.repeat(owners, take)
        counts += take
    return owner, counts


def _top_up(rng: np.random.Generator, owner: np.ndarray, counts: np.ndarray, min_size: int) -> tuple:
    """Give every client short of ``min_size`` the samples it lacks, drawn uniformly
    (without replacement) from the samples each other client holds beyond its first
    ``min_size`` in a random order -- so no donor drops below ``min_size``, and a donor
    gives in proportion to its surplus (its label mix kept in expectation).  There are
    always enough: the surplus is ``n - M * min_size + deficit >= deficit``."""
    n, num_clients = owner.shape[0], counts.shape[0]
    need = np.maximum(min_size - counts, 0)
    # every sample's rank within its client in a random order: the samples sorted by (client,
    # position in a shuffle), one sort of that key packed into an int64 (< M * n)
    shuffled = rng.permutation(n)
    position = np.empty(n, dtype=np.int64)
    position[shuffled] = np.arange(n)
    order = shuffled[np.sort(owner * n + position) % n]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(n) - np.repeat(starts, counts)
    surplus = order[rank >= min_size]
    moved = surplus[rng.permutation(surplus.shape[0])[:int(need.sum())]]
    owner = owner.copy()
    owner[moved] = np.repeat(np.arange(num_clients), need)
    return owner, np.bincount(owner, minlength=num_clients).astype(np.int64)


def iid_partition(num_samples: int, num_clients: int, *, seed: int = 0) -> Partition:
    """A uniformly random split into ``num_clients`` parts of (nearly) equal size."""
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    if num_samples < num_clients:
        raise ValueError(f"cannot split {num_samples} samples over {num_clients} clients")
    perm = _rng(seed).permutation(num_samples)
    # np.array_split's parts (the first n mod M one longer)
    base, extra = divmod(num_samples, num_clients)
    counts = np.full(num_clients, base, dtype=np.int64)
    counts[:extra] += 1
    part = np.repeat(np.arange(num_clients, dtype=np.int64), counts)
    # each part sorted: one sort of the key (part, index) packed into an int64 (< M * n)
    flat = torch.from_numpy(np.sort(part * num_samples + perm) % num_samples)
    idx = list(flat.split(counts.tolist()))
    return Partition(idx, "iid", None, int(seed))


def natural_partition(client_indices: Sequence[torch.Tensor]) -> Partition:
    """The split a dataset comes with (e.g. FedProx's Synthetic, one part per user);
    a :class:`CSRIndices` is kept as it is (no tensor per client)."""
    if isinstance(client_indices, CSRIndices):
        if (client_indices.sizes() < 1).any():
            raise ValueError("every client of a natural partition must hold at least one sample")
        return Partition(client_indices, "natural")
    idx = [torch.as_tensor(ix, dtype=torch.int64) for ix in client_indices]
    if any(ix.numel() == 0 for ix in idx):
        raise ValueError("every client of a natural partition must hold at least one sample")
    return Partition(idx, "natural")


def contiguous_partition(sizes) -> Partition:
    """The natural split of data stored client after client: client ``i`` holds the
    next ``sizes[i]`` samples.  Index tables only (:class:`CSRIndices` without a flat
    array): 10^5 clients cost one array of offsets."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if sizes.size == 0 or (sizes < 1).any():
        raise ValueError("every client of a natural partition must hold at least one sample")
    return Partition(CSRIndices(np.concatenate([[0], np.cumsum(sizes)])), "natural")
