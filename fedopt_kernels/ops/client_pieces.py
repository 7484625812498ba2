"""Clients given as pieces: per-layer arrays read in place instead of a ``[C, N]`` copy.

A server receives each client's model (or update) as separate per-layer arrays -- a
Flower reply's ``ArrayRecord``, a ``{name: tensor}`` update.  Aggregating them as the
rows of a ``[C, N]`` tensor first copies every reply: ``O(C N)`` memory and a write and
a read of all of it.  :class:`ClientPieces` describes the clients as they arrived --
client ``i``'s vector is the concatenation of its pieces, optionally subtracted from a
base (``D_i = x_global - x_i``, the update, from the client's model) -- and
:func:`~fedopt_kernels.ops.aggregate` reads them in place: on the CPU backend the
kernel walks a clients x pieces pointer table, reading a chunk of a row where it lies
inside one piece and staging it in a cache-resident buffer where it straddles two; the
subtraction from the base is done in registers as the row is read (fp32, fp64), or
while staging (fp16, bf16: in float, rounded once).  The extra memory is ``O(N)`` (the
result) plus a few chunks per thread, and the results are bit for bit those of the
copied rows.

:func:`~fedopt_kernels.ops.client_dots` and :func:`~fedopt_kernels.ops.weighted_sum`
(FedLAW's passes) read them the same way.  Where a backend has no in-place reader
(reference, Triton, CUDA: on an accelerator the replies must cross to the device
anyway), the ops stack the rows first (:meth:`ClientPieces.stack`): the same values,
``O(C N)`` memory.  Row by row, ``pieces[i]`` gives client ``i``'s vector alone
(``O(N)``), which is how SCAFFOLD's control update reads them.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from . import validation as V

__all__ = ["ClientPieces"]


class ClientPieces:
    """``C`` clients, each as the same sequence of ``L`` pieces (contiguous tensors of
    any shape; piece ``p`` has the same number of elements for every client), read in
    place.  Client ``i``'s vector is ``cat([t.reshape(-1) for t in pieces[i]])`` of
    length ``N``, or ``subtract_from - that`` when ``subtract_from`` (``[N]``) is
    given.  Every piece and ``subtract_from`` share one floating dtype and device.

    Behaves as a read-only sequence of the ``C`` vectors (``len``, indexing: each a
    new ``[N]`` tensor); :func:`~fedopt_kernels.ops.aggregate` and the server
    optimizers' ``step`` take it in place of a ``[C, N]`` tensor.
    """

    __slots__ = ("pieces", "subtract_from", "num_clients", "num_pieces", "numel", "dtype", "device", "_numels",
                 "_stacked")

    def __init__(self, pieces: Sequence[Sequence[torch.Tensor]], *, subtract_from: Optional[torch.Tensor] = None,
                 name: str = "pieces"):
        if isinstance(pieces, torch.Tensor) or not isinstance(pieces, Sequence):
            raise TypeError(f"{name} must be a sequence (one entry per client) of sequences of tensors, got "
                            f"{type(pieces).__name__}")
        if len(pieces) == 0:
            raise ValueError(f"{name} must hold at least one client")
        clients = []
        for i, client in enumerate(pieces):
            if isinstance(client, torch.Tensor) or not isinstance(client, Sequence):
                raise TypeError(f"{name}[{i}] must be a sequence of tensors (the client's pieces), got "
                                f"{type(client).__name__}")
            clients.append(list(client))
        first = clients[0]
        if not first:
            raise ValueError(f"{name}[0] must hold at least one piece")
        numels = []
        for p, t in enumerate(first):
            V.check_tensor(t, f"{name}[0][{p}]")
            numels.append(t.numel())
        dtype, device = first[0].dtype, first[0].device
        for i, client in enumerate(clients):
            if len(client) != len(first):
                raise ValueError(f"{name}[{i}] has {len(client)} pieces, {name}[0] has {len(first)}")
            for p, t in enumerate(client):
                label = f"{name}[{i}][{p}]"
                if i:
                    V.check_tensor(t, label)
                V.refuse_dtensor(t, label, who="aggregate")
                if t.dtype != dtype or t.device != device:
                    raise ValueError(f"{label} is {t.dtype} on {t.device}, {name}[0][0] is {dtype} on {device}: "
                                     "every piece must share one dtype and device")
                if not t.is_contiguous():
                    raise ValueError(f"{label} must be contiguous (pieces are read in place as flat arrays)")
                if t.numel() != numels[p]:
                    raise ValueError(f"{label} has {t.numel()} elements, {name}[0][{p}] has {numels[p]}: piece "
                                     f"{p} must have the same size for every client")
        N = sum(numels)
        if subtract_from is not None:
            V.check_tensor(subtract_from, "subtract_from", dims=1)
            V.refuse_dtensor(subtract_from, "subtract_from", who="aggregate")
            if (subtract_from.shape[0] != N or subtract_from.dtype != dtype or subtract_from.device != device
                    or not subtract_from.is_contiguous()):
                raise ValueError(f"subtract_from must be a contiguous [{N}] {dtype} tensor on {device} (the pieces' "
                                 f"length, dtype and device), got {tuple(subtract_from.shape)} "
                                 f"{subtract_from.dtype} on {subtract_from.device}")
        self.pieces: List[List[torch.Tensor]] = clients
        self.subtract_from = subtract_from
        self.num_clients, self.num_pieces, self.numel = len(clients), len(first), N
        self.dtype, self.device = dtype, device
        self._numels = numels
        self._stacked: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.num_clients

    def flat(self) -> List[torch.Tensor]:
        """Every piece, client by client (the ``fedopt_C::aggregate_pieces`` order)."""
        return [t for client in self.pieces for t in client]

    def row(self, i: int, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Client ``i``'s vector (``[N]``, into ``out`` if given): one copy, or one
        subtraction from ``subtract_from``, per piece."""
        if out is None:
            out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        offset = 0
        for t, k in zip(self.pieces[i], self._numels):
            dst = out[offset:offset + k]
            if self.subtract_from is None:
                dst.copy_(t.reshape(-1))
            else:
                torch.sub(self.subtract_from[offset:offset + k], t.reshape(-1), out=dst)
            offset += k
        return out

    def __iter__(self):
        return (self.row(i) for i in range(self.num_clients))

    def __getitem__(self, i: int) -> torch.Tensor:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"ClientPieces indices must be ints, got {type(i).__name__}")
        if not -self.num_clients <= i < self.num_clients:
            raise IndexError(f"client {i} of {self.num_clients}")
        return self.row(i % self.num_clients)

    def stack(self, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ``[C, N]`` rows (``O(C N)`` memory: for backends without an in-place reader),
        into ``out`` if given (``[C, N]`` of this dtype and device: a buffer kept between rounds)."""
        if out is None:
            out = torch.empty(self.num_clients, self.numel, dtype=self.dtype, device=self.device)
        for i in range(self.num_clients):
            self.row(i, out=out[i])
        return out

    def stacked(self) -> torch.Tensor:
        """:meth:`stack`, made once and kept (a second aggregation pass reads it again)."""
        if self._stacked is None:
            self._stacked = self.stack()
        return self._stacked

    def select(self, indices: Sequence[int]) -> "ClientPieces":
        """The clients ``indices`` (at least one), in that order: the same pieces, no copy."""
        return ClientPieces([self.pieces[i] for i in indices], subtract_from=self.subtract_from)

    def prepend(self, vector: torch.Tensor) -> "ClientPieces":
        """``vector`` (``[N]``, contiguous, of the pieces' dtype and device) as a first
        client, cut into views of the pieces' shapes; only without ``subtract_from``
        (the vector is taken as it is)."""
        if self.subtract_from is not None:
            raise ValueError("prepend: ClientPieces with subtract_from would subtract the prepended vector too")
        views, offset = [], 0
        for t, k in zip(self.pieces[0], self._numels):
            views.append(vector[offset:offset + k].view(t.shape))
            offset += k
        return ClientPieces([views] + self.pieces)

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor read (the pieces and ``subtract_from``): for memory-overlap checks."""
        return self.flat() + ([self.subtract_from] if self.subtract_from is not None else [])

    def __repr__(self) -> str:
        base = ", subtract_from" if self.subtract_from is not None else ""
        return (f"ClientPieces({self.num_clients} clients x {self.num_pieces} pieces, N={self.numel}, {self.dtype} "
                f"on {self.device}{base})")
