"""A round's replies read into what the server round takes.

``D_i = x_global - x_i`` read where the replies lie (a CPU server, ``read_in_place``:
:class:`~fedopt_kernels.ops.ClientPieces` over the replies' arrays, subtracted as the
kernel reads them), else one pass per array into ``[C, N]`` rows -- ``D_i`` straight
from the client's bytes (CPU), or the client models (FedLAW, or an accelerator:
subtracted there after one transfer); and the clients' floating buffers as ``[C, M]``
rows when every reply carries them.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from flwr.app import ArrayRecord

from .records import arrayrecords_as_pieces, stack_arrayrecords

__all__ = ["ReplyReader"]


class ReplyReader:
    """Reads the replies of a strategy's rounds (see the module docstring) for the
    global model ``x_global`` of ``layout`` and ``buffers_layout``; ``keep_base``: the
    updates are read again after the step (SCAFFOLD), so in-place replies are
    subtracted from a snapshot of ``x_global`` instead of ``x_global`` itself."""

    def __init__(self, x_global: torch.Tensor, layout, buffers_layout, read_in_place: bool = True):
        self.x_global, self.layout, self.buffers_layout = x_global, layout, buffers_layout
        self.read_in_place = bool(read_in_place)
        self.keep_base = False
        self._rows: Optional[torch.Tensor] = None  # reusable [C, N] CPU buffer (the copying path)
        self._snapshot: Optional[torch.Tensor] = None

    def results(self, records: List[ArrayRecord], names: List[str], updates: bool):
        """The replies as updates (``updates``) or as the client models."""
        device = self.x_global.device
        on_cpu = device.type == "cpu"
        if on_cpu and self.read_in_place:
            pieces = arrayrecords_as_pieces(records, self.layout, names=names,
                                            subtract_from=self.base() if updates else None)
            if pieces is not None:
                return pieces
        C, N = len(records), self.layout.numel
        if self._rows is None or tuple(self._rows.shape) != (C, N):
            self._rows = None  # free the old one first
            self._rows = torch.empty(C, N, dtype=self.layout.dtype, pin_memory=device.type == "cuda")
        rows = stack_arrayrecords(records, self.layout, out=self._rows, names=names,
                                  subtract_from=self.x_global if (updates and on_cpu) else None)
        U = rows if on_cpu else rows.to(device, non_blocking=True)
        return torch.sub(self.x_global, U, out=U) if updates and not on_cpu else U

    check = None  # screening checks the replies' arrays against the model's layout (.compression's reader: codes)

    def base(self) -> torch.Tensor:
        """What replies read in place are subtracted from: ``x_global`` itself, read by
        the aggregation before the step moves it; with ``keep_base`` a snapshot
        (``O(N)``, one buffer kept)."""
        if not self.keep_base:
            return self.x_global
        if self._snapshot is None:
            self._snapshot = torch.empty_like(self.x_global)
        return self._snapshot.copy_(self.x_global)

    def buffers(self, records: List[ArrayRecord]) -> Optional[torch.Tensor]:
        """The clients' floating buffers; None when there are none or a reply lacks them
        (the server's are kept)."""
        L = self.buffers_layout
        if len(L) == 0 or not all(all(s.name in r for s in L.slots) for r in records):
            return None
        B = stack_arrayrecords(records, L)
        return B.to(self.x_global.device) if self.x_global.device.type != "cpu" else B
