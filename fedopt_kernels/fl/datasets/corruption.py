"""Corrupted clients: a seeded fraction of the clients trains on damaged data.

Robustness claims (FedLAW down-weighting corrupted clients, [FedLAW] section 6 and
Table 8) need clients whose data are wrong in a known way.  ``corrupt_fraction`` of the
``clients`` (``round(fraction * clients)``, half up) are chosen by the seed alone and
their *training* samples are changed once, before round 1; the test set, the other
clients' samples and FedLAW's proxy set stay clean.  Kinds:

``labels``  every label of a corrupted client goes through a fixed random permutation
            of the classes without fixed points (a derangement, drawn per client), so
            every one of its labels is wrong and the client learns a consistent but
            wrong mapping.
``swap``    FedLAW's own definition ([FedLAW] section 6, "swapping two labels in their
            local training data"): one random pair of classes ``(a, b)`` per client is
            exchanged; its other labels are untouched.
``noise``   additive Gaussian noise ``x + N(0, corrupt_noise_std^2)`` on every input
            element of the client's samples, drawn once (the same noisy sample every
            round).  The shipped datasets are standardised, so std 1 is noise as strong
            as the signal.

Which clients are corrupted depends on ``(seed, clients, fraction)`` only -- not on the
kind, the algorithm or the data -- and the clients of a smaller fraction are a subset
of those of a larger one (a prefix of one seeded permutation).  The per-client label
map or noise depends on ``(seed, client)`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..seeds import corrupt_client_seed, corrupt_seed

__all__ = ["CORRUPT_KINDS", "Corruption", "corrupted_clients", "corrupt_client_data", "label_map"]

CORRUPT_KINDS = ("labels", "swap", "noise")


@dataclass
class Corruption:
    """What was corrupted: recorded in ``results.json`` under ``meta["corruption"]``."""

    fraction: float
    kind: str
    clients: List[int]
    noise_std: Optional[float] = None
    label_maps: Dict[int, List[int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {"fraction": self.fraction, "kind": self.kind, "clients": list(self.clients)}
        if self.kind == "noise":
            out["noise_std"] = self.noise_std
        else:  # JSON keys are strings
            out["label_maps"] = {str(c): m for c, m in self.label_maps.items()}
        return out


def corrupted_clients(seed: int, num_clients: int, fraction: float) -> List[int]:
    """The sorted ids of the ``round(fraction * num_clients)`` corrupted clients."""
    count = int(math.floor(fraction * num_clients + 0.5))
    if count == 0:
        return []
    g = torch.Generator().manual_seed(corrupt_seed(seed))
    return sorted(torch.randperm(num_clients, generator=g)[:count].tolist())


def label_map(seed: int, client: int, num_classes: int, kind: str) -> List[int]:
    """``m`` with corrupted label ``m[y]`` for true label ``y`` (see the module docstring)."""
    if num_classes < 2:
        raise ValueError(f"label corruption needs at least 2 classes, got {num_classes}")
    g = torch.Generator().manual_seed(corrupt_client_seed(seed, client))
    if kind == "swap":
        a, b = torch.randperm(num_classes, generator=g)[:2].tolist()
        m = list(range(num_classes))
        m[a], m[b] = b, a
        return m
    if kind == "labels":
        ident = torch.arange(num_classes)
        while True:  # rejection sampling: a uniform derangement (about e tries)
            p = torch.randperm(num_classes, generator=g)
            if not bool((p == ident).any()):
                return p.tolist()
    raise ValueError(f"unknown label corruption {kind!r}")


def owned_samples(client_indices: Sequence[torch.Tensor], clients: Sequence[int], num_samples: int,
                  device: torch.device, *, who: str, what: str) -> torch.Tensor:
    """The ``[num_samples]`` mask of the samples that ``clients`` hold; refused (naming
    the first other client that holds one of them too) unless no other client does --
    damaging a shared sample would damage an honest client as well."""
    chosen = set(clients)
    mask = torch.zeros(num_samples, dtype=torch.bool, device=device)
    for c in clients:
        mask[client_indices[c].to(device)] = True
    for c, ix in enumerate(client_indices):
        if c not in chosen and bool(mask[ix.to(device)].any()):
            raise ValueError(f"client {c} shares training samples with {who}; {what} needs a partition in which "
                             "every sample belongs to one client")
    return mask


def corrupt_client_data(x: torch.Tensor, y: torch.Tensor, client_indices: Sequence[torch.Tensor], *, fraction: float,
                        kind: str, seed: int, num_classes: int, noise_std: float = 1.0
                        ) -> Tuple[torch.Tensor, torch.Tensor, Corruption]:
    """``(x', y', record)``: copies of the training tensors with the corrupted clients'
    samples changed (``x``/``y`` are not modified; an unchanged tensor is returned as
    is).  The corrupted clients' samples must not be held by a clean client too."""
    if kind not in CORRUPT_KINDS:
        raise ValueError(f"unknown corruption kind {kind!r}; choose one of {', '.join(CORRUPT_KINDS)}")
    clients = corrupted_clients(seed, len(client_indices), fraction)
    record = Corruption(float(fraction), kind, clients, noise_std=float(noise_std) if kind == "noise" else None)
    if not clients:
        return x, y, record
    mask = owned_samples(client_indices, clients, y.shape[0], y.device, who="a corrupted client",
                         what="corruption")
    if kind == "noise":
        x = x.clone()
        for c in clients:
            ix = client_indices[c].to(x.device)
            g = torch.Generator().manual_seed(corrupt_client_seed(seed, c))
            noise = torch.randn((ix.numel(),) + tuple(x.shape[1:]), generator=g, dtype=torch.float64)
            x[ix] = (x[ix].to(torch.float64) + noise_std * noise.to(x.device)).to(x.dtype)
        return x, y, record
    y = y.clone()
    for c in clients:
        m = label_map(seed, c, num_classes, kind)
        record.label_maps[c] = m
        ix = client_indices[c].to(y.device)
        y[ix] = torch.tensor(m, dtype=y.dtype, device=y.device)[y[ix]]
    return x, y, record
