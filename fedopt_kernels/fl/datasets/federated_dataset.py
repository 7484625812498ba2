"""``FederatedDataset``: a classification dataset held as tensors, with its optional
natural split over clients -- what every loader of :mod:`.data` and :mod:`.leaf`
returns, defined apart from them so that neither loader module imports the other."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

__all__ = ["FederatedDataset"]


@dataclass
class FederatedDataset:
    """A classification dataset held as tensors.

    ``x_train``/``x_test``: float inputs with the sample index first; ``y_train``/
    ``y_test``: int64 labels in ``[0, num_classes)``.  ``client_indices`` is the natural
    partition of the training set (one int64 index tensor per client) when the data come
    split by client (Synthetic, LEAF-style data), else None (partition it with
    :mod:`fedopt_kernels.fl.datasets.partition`).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    client_indices: Optional[List[torch.Tensor]] = None
    info: Dict[str, object] = field(default_factory=dict)

    def __post_init__(self):
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"{self.name}: x_{split} has {x.shape[0]} samples but y_{split} has {y.shape[0]}")
            if y.dtype != torch.int64 or y.dim() != 1:
                raise ValueError(f"{self.name}: y_{split} must be a 1-D int64 tensor of class indices")
            if not x.is_floating_point():
                raise ValueError(f"{self.name}: x_{split} must be floating point, got {x.dtype}")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(f"{self.name}: train inputs {tuple(self.x_train.shape[1:])} and test inputs "
                             f"{tuple(self.x_test.shape[1:])} differ in shape")
        if self.num_train == 0 or self.num_test == 0:
            raise ValueError(f"{self.name}: the train and test sets must both be non-empty")
        top = int(max(self.y_train.max(), self.y_test.max()))
        if int(min(self.y_train.min(), self.y_test.min())) < 0 or top >= self.num_classes:
            raise ValueError(f"{self.name}: labels must lie in [0, {self.num_classes}), got up to {top}")

    @property
    def input_shape(self) -> tuple:
        return tuple(self.x_train.shape[1:])

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.x_test.shape[0])

    def to(self, device) -> "FederatedDataset":
        """The same dataset with its tensors on ``device``."""
        return FederatedDataset(self.name, self.x_train.to(device), self.y_train.to(device), self.x_test.to(device),
                                self.y_test.to(device), self.num_classes, self.client_indices, dict(self.info))

    @classmethod
    def from_datasets(cls, train, test, *, name: str = "custom", num_classes: Optional[int] = None,
                      client_indices: Optional[Sequence[Sequence[int]]] = None,
                      dtype: torch.dtype = torch.float32) -> "FederatedDataset":
        """Materialise two map-style datasets of ``(input, label)`` pairs as tensors.

        Every item is read once (``dataset[i]``; inputs must be tensors or arrays of one
        shape, e.g. torchvision datasets with ``transform=ToTensor()``).  The simulator
        indexes these tensors directly, which is much faster than a DataLoader for the
        small models of FL experiments; it costs ``n * prod(input_shape)`` floats of
        memory (CIFAR-10: 600 MB in fp32).
        """
        xs_tr, ys_tr = _materialise(train, "train", dtype)
        xs_te, ys_te = _materialise(test, "test", dtype)
        top = int(max(ys_tr.max(), ys_te.max()))
        if num_classes is None:
            num_classes = top + 1
        elif top >= num_classes:
            raise ValueError(f"num_classes={num_classes} but a label is {top} (labels must be 0..{num_classes - 1})")
        idx = None
        if client_indices is not None:
            idx = [torch.as_tensor(list(c), dtype=torch.int64) for c in client_indices]
        return cls(name, xs_tr, ys_tr, xs_te, ys_te, int(num_classes), idx)


def _label(y, split: str, i: int) -> int:
    """A class index from an int, a whole float, a numpy scalar or a one-element tensor;
    anything else (1.7, "cat", a vector) is refused with the item's place."""
    one = (isinstance(y, torch.Tensor) and y.numel() == 1) or (isinstance(y, np.ndarray) and y.size == 1)
    value = y.item() if one else y
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not (math.isfinite(value) and value == int(value))):
        raise ValueError(f"{split}[{i}] has label {y!r}; labels must be integer class indices 0..C-1 "
                         "(map names or other values to indices first)")
    if value < 0:
        raise ValueError(f"{split}[{i}] has label {value!r}; labels must be integer class indices 0..C-1")
    return int(value)


def _materialise(dataset, split: str, dtype):
    n = len(dataset)
    if n == 0:
        raise ValueError(f"the {split} dataset is empty")
    xs, ys = [], []
    for i in range(n):
        item = dataset[i]
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise ValueError(f"{split}[{i}] must be an (input, label) pair, got {type(item).__name__}")
        x, y = item[0], item[1]
        xs.append(torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x, dtype=dtype))
        ys.append(_label(y, split, i))
    try:
        x = torch.stack(xs)
    except RuntimeError as exc:
        raise ValueError(f"the {split} inputs do not share one shape (use a transform that makes them equal): "
                         f"{exc}") from None
    return x, torch.tensor(ys, dtype=torch.int64)
