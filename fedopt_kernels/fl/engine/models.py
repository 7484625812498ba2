"""Models of the simulator: an MLP, FedLAW's SimpleCNN, and any ``nn.Module`` of yours.

:func:`build_model` makes a registered model for a dataset's input shape and number of
classes; :func:`register_model` adds your own factory by name.  The simulator also
takes a ready ``nn.Module`` (or a zero-argument callable returning one) directly, and
the command line ``--model package.module:function`` (called with the input shape and
the number of classes).
"""

from __future__ import annotations

import math
from typing import Callable, List, Sequence

import torch
from torch import nn

from ..registry import Registry

__all__ = ["MLP", "SimpleCNN", "build_model", "register_model", "model_names"]


class MLP(nn.Module):
    """Flatten, then ``Linear -> ReLU`` for every hidden width, then a linear classifier.

    FedLAW's MLP ([FedLAW] appendix D.3) is ``hidden=(200, 200)``.
    """

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (200, 200)):
        super().__init__()
        layers: List[nn.Module] = [nn.Flatten()]
        width = int(in_features)
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class SimpleCNN(nn.Module):
    """FedLAW's SimpleCNN ([FedLAW] appendix D.3), adapted to the input size.

    For CIFAR (3x32x32): ``conv(3,32,3) -> ReLU -> maxpool 2 -> conv(32,64,3) -> ReLU ->
    maxpool 2 -> conv(64,64,3) -> ReLU -> fc(64*4*4, 64) -> ReLU -> fc(64, classes)``
    (unpadded convolutions, exactly the paper).  For small images (side < 32, e.g. the
    8x8 digits) the convolutions are padded (``padding=1``) so the two poolings still
    fit: 8 -> 4 -> 2, and the first linear layer is ``fc(64*2*2, 64)``.
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int = 32, width: int = 32,
                 padding: int = None):
        super().__init__()
        if padding is None:
            padding = 0 if image_size >= 32 else 1
        w1, w2 = int(width), 2 * int(width)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, w1, 3, padding=padding), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(w1, w2, 3, padding=padding), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(w2, w2, 3, padding=padding), nn.ReLU(),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, in_channels, image_size, image_size)).numel()
        if flat == 0:
            raise ValueError(f"SimpleCNN: images of side {image_size} are too small for its three convolutions")
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(flat, w2), nn.ReLU(), nn.Linear(w2, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def _mlp(input_shape, num_classes, hidden=(200, 200), **_):
    return MLP(math.prod(input_shape), num_classes, hidden)


def _cnn(input_shape, num_classes, width=32, **_):
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ValueError(f"the CNN needs square [C, H, W] images, the dataset has inputs of shape {tuple(input_shape)}")
    return SimpleCNN(input_shape[0], num_classes, input_shape[1], width=width)


def _logreg(input_shape, num_classes, **_):
    return MLP(math.prod(input_shape), num_classes, hidden=())


_MODELS = Registry("model", {"mlp": _mlp, "cnn": _cnn, "logreg": _logreg})


def register_model(name: str, factory: Callable[..., nn.Module], *, overwrite: bool = False) -> None:
    """Register ``factory(input_shape, num_classes, **options) -> nn.Module`` as ``name``."""
    _MODELS.register(name, factory, overwrite=overwrite)


def model_names() -> List[str]:
    return _MODELS.names()


def build_model(name: str, input_shape, num_classes: int, **options) -> nn.Module:
    """A freshly initialised registered model, or ``"package.module:function"`` called as
    ``function(input_shape, num_classes)`` (initialisation follows torch's global RNG:
    seed it, or use the simulator, which seeds it from its own seed)."""
    factory = _MODELS.resolve(name)
    if name not in _MODELS:
        options = {}
    model = factory(tuple(input_shape), int(num_classes), **options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {name!r} returned {type(model).__name__}, not an nn.Module")
    return model
