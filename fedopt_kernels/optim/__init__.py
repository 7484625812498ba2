"""``torch.optim`` classes: the FedNAR local optimizer."""

from .fednar import FedNAR

__all__ = ["FedNAR"]
