"""The seeds of a simulation: every random draw has its own, derived from the experiment seed.

A draw's seed is a stable function of ``(seed, purpose, keys...)`` alone (numpy's
``SeedSequence``), never of the order in which draws happen.  So two algorithms see the
same clients and batches, a resumed run draws what an uninterrupted one would, and an
outside runtime (Flower's ClientApps, ``torchrun`` ranks) reproduces any single draw
with the functions below.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

__all__ = ["Purpose", "derive_seed", "init_seed", "sampling_seed", "batch_seed", "proxy_seed",
           "proxy_order_seed", "dropout_seed", "corrupt_seed", "corrupt_client_seed", "attack_seed",
           "attack_noise_seed", "compress_key"]


class Purpose(IntEnum):
    """What a derived seed is for (the integers are part of the reproducibility contract)."""

    INIT = 1         # the global model's initial values
    SAMPLE = 2       # the clients of a round
    BATCH = 3        # a client's mini-batch order in a round
    PROXY = 4        # FedLAW's server-side proxy set
    PROXY_ORDER = 5  # the proxy set's batch order in a round
    DROPOUT = 6      # random layers of the batched engine
    CORRUPT = 7      # which clients are corrupted, and each one's label map or noise
    ATTACK = 8       # which clients attack (fl/datasets/attacks.py), and the noise of the gaussian attack
    DP_NOISE = 9     # the noise of differentially private aggregation (server/differential_privacy/dp.py)
    COMPRESS = 10    # a round's key of compressed updates: Hadamard signs, stochastic rounding


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys (e.g. ``(seed, purpose, round, client)``): a
    stable function of the keys alone, so every draw can be reproduced independently."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def init_seed(seed: int) -> int:
    """The seed under which :class:`fedopt_kernels.fl.Simulation` initialises its model
    (``torch.manual_seed(init_seed(seed))`` then building it gives the same values)."""
    return derive_seed(seed, Purpose.INIT)


def sampling_seed(seed: int, round_number: int) -> int:
    """The seed of the client sample of round ``round_number`` (1-based)."""
    return derive_seed(seed, Purpose.SAMPLE, round_number)


def batch_seed(seed: int, round_number: int, client: int) -> int:
    """The seed of client ``client``'s batch order in round ``round_number`` (1-based)."""
    return derive_seed(seed, Purpose.BATCH, round_number, client)


def proxy_seed(seed: int) -> int:
    """The seed that draws FedLAW's proxy set."""
    return derive_seed(seed, Purpose.PROXY)


def proxy_order_seed(seed: int, round_number: int) -> int:
    """The seed of the proxy set's batch order in round ``round_number``."""
    return derive_seed(seed, Purpose.PROXY_ORDER, round_number)


def dropout_seed(seed: int, round_number: int, group: int, first_client: int) -> int:
    """The seed of the random layers of one client group of the batched engine."""
    return derive_seed(seed, Purpose.DROPOUT, round_number, group, first_client)


def corrupt_seed(seed: int) -> int:
    """The seed that picks the corrupted clients (:mod:`fedopt_kernels.fl.datasets.corruption`)."""
    return derive_seed(seed, Purpose.CORRUPT)


def corrupt_client_seed(seed: int, client: int) -> int:
    """The seed of corrupted client ``client``'s label map or input noise."""
    return derive_seed(seed, Purpose.CORRUPT, 1, client)


def attack_seed(seed: int) -> int:
    """The seed that picks the attacking clients (:mod:`fedopt_kernels.fl.datasets.attacks`)."""
    return derive_seed(seed, Purpose.ATTACK)


def attack_noise_seed(seed: int, round_number: int, client: int) -> int:
    """The seed of attacking client ``client``'s gaussian update in round ``round_number``."""
    return derive_seed(seed, Purpose.ATTACK, 1, round_number, client)


def compress_key(seed: int, round_number: int) -> int:
    """The key of round ``round_number``'s compressed updates (fl/engine/compressed_updates.py):
    the Hadamard rotation's signs, shared by the round's clients, and, with each client's
    id, its stochastic rounding's uniforms."""
    return derive_seed(seed, Purpose.COMPRESS, round_number)
