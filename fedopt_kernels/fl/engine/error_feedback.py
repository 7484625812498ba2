"""Error feedback for biased codecs, each client's residual kept in the run's
:class:`~fedopt_kernels.fl.engine.client_state.ClientStateStore`.

Seide et al. 2014 (1-bit SGD); Karimireddy et al., "Error Feedback Fixes SignSGD", ICML
2019 (EF-SGD).  Client ``i`` keeps a residual ``e_i`` (zero before its first round); with
its update ``D_i``::

    a_i = e_i + D_i,    it sends C(a_i),    e_i <- a_i - decode(C(a_i))

(python_ref/compression.py, ``error_feedback``).  The residuals are the store's rows
under one name: a row exists only for a client that took part (memory grows with
participation, not with the population), it spills to a memory-mapped file with the
store, and a checkpoint holds the stored values, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import torch

from ...compression import Codec
from .client_state import ClientStateStore

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Error feedback around ``codec`` with residuals in ``store`` under ``name``.

    Args:
        codec: the round's :class:`~fedopt_kernels.compression.Codec`.
        store: the run's per-client state; ``name`` is registered in it (fp32 rows of
            ``numel`` values: the residual is kept exactly unless the store is compact).
        numel: the model's number of values.
    """

    def __init__(self, codec: Codec, store: ClientStateStore, numel: int, *, name: str = "ef_residual",
                 device="cpu"):
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a Codec, got {type(codec).__name__}")
        self.codec, self.store, self.numel, self.name = codec, store, int(numel), name
        store.register(name, self.numel, dtype=torch.float32, device=device)

    def encode(self, client: int, update: torch.Tensor, key: int = 0, *, backend=None, out=None):
        """Client ``client``'s reply for ``update`` (its residual folded in), and the
        residual stored for its next round (``backend``: the encode's kernels; ``out``:
        :meth:`Codec.encode`'s)."""
        if update.numel() != self.numel:
            raise ValueError(f"update must have {self.numel} values, got {update.numel()}")
        a = self.store.get(self.name, client) + update.reshape(-1).to(torch.float32)
        reply = self.codec.encode(a, key, client, backend=backend, out=out)
        self.store.put(self.name, client, a - self.codec.decode(reply, self.numel, key).to(a.device))
        return reply

    def residual(self, client: int) -> torch.Tensor:
        return self.store.get(self.name, client)
