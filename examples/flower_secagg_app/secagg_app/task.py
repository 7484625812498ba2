"""Model and data of the app: a small MLP on a fixed synthetic classification set, so
that a test can rebuild any node's data and model and compute the plain round."""

from __future__ import annotations

import torch

SAMPLES, FEATURES, CLASSES = 60, 8, 3


def make_model(width: int = 5, seed: int = 1) -> torch.nn.Module:
    """``FEATURES -> width -> CLASSES``: ``12 width + 3`` parameters (width 974126: 11.69M,
    a ResNet-18-sized update, for measuring a round)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Linear(width, CLASSES))


def client_data(partition_id: int):
    """``(x, y)`` of node ``partition_id``: unequal slices of one seeded set."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    n = 10 + 8 * partition_id
    return x[partition_id * 20:partition_id * 20 + n], y[partition_id * 20:partition_id * 20 + n]
