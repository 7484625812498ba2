"""Parameter shapes of the models the benchmarks and tests use (no torchvision needed)."""

from __future__ import annotations

import math


def resnet18_shapes(num_classes: int = 10) -> list:
    """``[p.shape for p in torchvision.models.resnet18(num_classes=...).parameters()]``.

    62 tensors; 11,181,642 parameters for 10 classes (the CIFAR-10 setting of the
    FedNAR paper).
    """
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            cin = in_ch if block == 0 else out_ch
            shapes += [(out_ch, cin, 3, 3), (out_ch,), (out_ch,), (out_ch, out_ch, 3, 3), (out_ch,), (out_ch,)]
            if block == 0 and (stride != 1 or cin != out_ch):
                shapes += [(out_ch, cin, 1, 1), (out_ch,), (out_ch,)]
        in_ch = out_ch
    shapes += [(num_classes, 512), (num_classes,)]
    return shapes


def small_cnn_shapes() -> list:
    """A small CNN: 3 conv layers and 2 linear layers, 10 tensors, 90,506 parameters."""
    return [(32, 3, 3, 3), (32,), (64, 32, 3, 3), (64,), (64, 64, 3, 3), (64,),
            (128, 256), (128,), (10, 128), (10,)]


def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)
