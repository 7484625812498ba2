"""fedopt_kernels: fused kernels and optimizers for federated learning on PyTorch."""

__version__ = "0.1.0"

from . import backends, ops  # noqa: E402,F401
