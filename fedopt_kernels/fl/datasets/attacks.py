r"""Byzantine attacks for testing robust and private aggregation.

A seeded fraction of the clients attacks: ``round(fraction * clients)`` of them (half
up), chosen by the seed alone as a prefix of one seeded permutation (so the attackers
of a smaller fraction are a subset of those of a larger one, as
:mod:`.corruption`'s).  An attacker trains honestly and then replaces its update
``D_i`` (``x_global - x_end_i``, the pseudo-gradient) before sending it, or, for
``labelflip``, trains on flipped labels:

==============  =======================================================================
``signflip``    ``D_i <- -D_i`` (the sign-flipping attack)
``scale``       ``D_i <- lambda D_i`` (boosting; ``lambda`` = ``scale``, default 10)
``gaussian``    ``D_i <- N(0, sigma^2 I)`` (a random update; ``sigma`` = ``noise_std``,
                default 1), drawn per ``(seed, round, client)``
``labelflip``   data-side: the attacker's training labels ``y <- K - 1 - y`` (``K``
                classes; the label-flipping attack of Fang et al. 2020 / Tolpegin et al.
                2020), applied once before round 1
``alie``        "A Little Is Enough" (Baruch, Baruch & Goldberg 2019, Algorithm 3): with
                ``n`` clients in the round, ``f`` of them attackers, ``s = floor(n/2 + 1)
                - f`` and ``z_max = Phi^-1((n - s) / n)`` (the normal quantile), every
                attacker sends ``mu_j - z_max sigma_j`` per coordinate, ``mu`` and
                ``sigma`` the mean and (unbiased) std of the round's honest updates
==============  =======================================================================

ALIE's statistics are those of every client of the round before the attack (the
omniscient attacker of the robust-aggregation benchmarks; Baruch et al. estimate them
from the attackers' own honest updates, which approach the same values).  When the
attackers hold a majority of a round (``s < 1``), ``s`` is taken as 1.

Everything is recorded: the attackers in ``results.json`` ``meta["attack"]`` and, per
round, the attackers among the round's clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import List, Optional, Sequence, Tuple

import torch

from .corruption import owned_samples
from ..seeds import attack_noise_seed, attack_seed

__all__ = ["ATTACKS", "UPDATE_ATTACKS", "Attack", "attacked_clients", "alie_z_max", "attack_updates_",
           "flip_labels"]

ATTACKS = ("signflip", "scale", "gaussian", "labelflip", "alie")
UPDATE_ATTACKS = ("signflip", "scale", "gaussian", "alie")  # applied to the updates; labelflip to the data
DEFAULT_SCALE = 10.0
DEFAULT_NOISE_STD = 1.0


def attack_count(num_clients: int, fraction: float) -> int:
    """``round(fraction * num_clients)``, half up."""
    return int(math.floor(fraction * num_clients + 0.5))


def attacked_clients(seed: int, num_clients: int, fraction: float) -> List[int]:
    """The sorted ids of the attacking clients (see the module docstring)."""
    if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 <= fraction <= 1):
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    count = attack_count(num_clients, fraction)
    if count == 0:
        return []
    g = torch.Generator().manual_seed(attack_seed(seed))
    return sorted(torch.randperm(num_clients, generator=g)[:count].tolist())


def alie_z_max(n: int, f: int) -> float:
    """Baruch et al. 2019, Algorithm 3: ``s = floor(n/2 + 1) - f`` (at least 1) and
    ``z_max = Phi^-1((n - s) / n)``, for ``f`` attackers among ``n`` clients."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive number of clients, got {n!r}")
    if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f <= n:
        raise ValueError(f"f must be a number of attackers in [0, n={n}], got {f!r}")
    s = max(math.floor(n / 2 + 1) - f, 1)
    p = (n - s) / n
    return NormalDist().inv_cdf(p) if 0 < p < 1 else 0.0  # n = 1: no honest client to hide among


@torch.no_grad()
def attack_updates_(updates: torch.Tensor, rows: Sequence[int], kind: str, *, scale: float = DEFAULT_SCALE,
                    noise_std: float = DEFAULT_NOISE_STD, generators: Optional[Sequence[torch.Generator]] = None
                    ) -> torch.Tensor:
    """Turn the honest updates in ``rows`` of ``updates`` (``[C, N]``, the round's
    clients) into attacked ones, in place; returns ``updates``.

    ``kind``: one of :data:`UPDATE_ATTACKS`; ``generators``: one per attacked row for
    ``gaussian`` (CPU generators; the draw is moved to the updates' device)."""
    if kind not in UPDATE_ATTACKS:
        raise ValueError(f"kind must be one of {', '.join(UPDATE_ATTACKS)} (labelflip attacks the data: "
                         f"flip_labels), got {kind!r}")
    if not isinstance(updates, torch.Tensor) or updates.dim() != 2 or not updates.is_floating_point():
        raise ValueError(f"updates must be a [C, N] floating tensor, got "
                         f"{tuple(updates.shape) if isinstance(updates, torch.Tensor) else type(updates).__name__}")
    C = updates.shape[0]
    rows = [int(r) for r in rows]
    if len(set(rows)) != len(rows) or any(not 0 <= r < C for r in rows):
        raise ValueError(f"rows must be distinct row indices in [0, {C}), got {rows}")
    if kind == "gaussian" and (generators is None or len(generators) != len(rows)):
        raise ValueError(f"the gaussian attack needs one generator per attacked row ({len(rows)})")
    if not rows:
        return updates
    idx = torch.tensor(rows, device=updates.device)
    if kind == "signflip":
        updates[idx] = -updates[idx]
    elif kind == "scale":
        updates[idx] = updates[idx] * float(scale)
    elif kind == "gaussian":
        for r, g in zip(rows, generators):
            noise = torch.randn(updates.shape[1], generator=g, dtype=torch.float32)
            updates[r] = (float(noise_std) * noise).to(device=updates.device, dtype=updates.dtype)
    else:  # alie: mean and unbiased std of the round's honest updates, per coordinate, in fp64
        honest = updates.to(torch.float64)
        mu = honest.mean(dim=0)
        sigma = honest.std(dim=0) if C > 1 else torch.zeros_like(mu)
        z = alie_z_max(C, len(rows))
        updates[idx] = (mu - z * sigma).to(updates.dtype).unsqueeze(0).expand(len(rows), -1)
    return updates


def flip_labels(y: torch.Tensor, client_indices: Sequence[torch.Tensor], clients: Sequence[int],
                num_classes: int) -> torch.Tensor:
    """A copy of the training labels ``y`` with those of ``clients`` flipped, ``y <- K - 1
    - y`` (``y`` unchanged and returned as is when ``clients`` is empty).  The attackers'
    samples must not be held by another client too."""
    if num_classes < 2:
        raise ValueError(f"labelflip needs at least 2 classes, got {num_classes}")
    if not clients:
        return y
    mask = owned_samples(client_indices, clients, y.shape[0], y.device, who="an attacking client", what="labelflip")
    y = y.clone()
    y[mask] = (num_classes - 1) - y[mask]
    return y


@dataclass
class Attack:
    """The attack of a run: ``kind``, ``fraction``, the attacking ``clients`` and the
    parameters (see the module docstring).  Recorded in ``results.json``
    ``meta["attack"]`` (:meth:`to_dict`)."""

    kind: str
    fraction: float
    clients: List[int]
    seed: int = 0
    scale: float = DEFAULT_SCALE
    noise_std: float = DEFAULT_NOISE_STD

    @classmethod
    def build(cls, kind: str, fraction: float, num_clients: int, seed: int, *, scale: float = DEFAULT_SCALE,
              noise_std: float = DEFAULT_NOISE_STD) -> "Attack":
        if kind not in ATTACKS:
            raise ValueError(f"unknown attack {kind!r}; choose one of {', '.join(ATTACKS)}")
        if not (math.isfinite(scale) and math.isfinite(noise_std) and noise_std > 0):
            raise ValueError(f"scale must be finite and noise_std finite and > 0, got {scale!r}, {noise_std!r}")
        return cls(kind, float(fraction), attacked_clients(seed, num_clients, fraction), int(seed), float(scale),
                   float(noise_std))

    def round_attackers(self, round_clients: Sequence[int]) -> Tuple[List[int], List[int]]:
        """``(rows, clients)``: the positions in ``round_clients`` of this round's
        attackers, and their ids."""
        mine = set(self.clients)
        pairs = [(i, c) for i, c in enumerate(round_clients) if c in mine]
        return [i for i, _ in pairs], [c for _, c in pairs]

    def apply_(self, updates: torch.Tensor, round_clients: Sequence[int], round_number: int) -> List[int]:
        """Attack the round's updates in place (rows in the order of ``round_clients``);
        returns the attackers among ``round_clients``.  ``labelflip`` changes no update
        (its attackers trained on flipped labels: :meth:`poison_labels`)."""
        rows, ids = self.round_attackers(round_clients)
        if self.kind in UPDATE_ATTACKS and rows:
            gens = ([torch.Generator().manual_seed(attack_noise_seed(self.seed, round_number, c)) for c in ids]
                    if self.kind == "gaussian" else None)
            attack_updates_(updates, rows, self.kind, scale=self.scale, noise_std=self.noise_std, generators=gens)
        return ids

    def poison_labels(self, y: torch.Tensor, client_indices: Sequence[torch.Tensor], num_classes: int
                      ) -> torch.Tensor:
        """The training labels the clients train on: flipped for the attackers under
        ``labelflip``; ``y`` itself otherwise."""
        if self.kind != "labelflip":
            return y
        return flip_labels(y, client_indices, self.clients, num_classes)

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "fraction": self.fraction, "clients": list(self.clients)}
        if self.kind == "scale":
            out["scale"] = self.scale
        elif self.kind == "gaussian":
            out["noise_std"] = self.noise_std
        return out
