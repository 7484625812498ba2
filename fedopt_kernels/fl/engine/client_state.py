"""Per-client state that grows with participation, not with the population.

Some algorithms keep a vector per client between its rounds: SCAFFOLD's control variate
``c_i``, a client's carried local momentum.  A dense ``[num_clients, N]`` tensor costs
``num_clients * N`` numbers before the first round (10^5 clients of a 1M-parameter
model: 400 GB); most clients of a cross-device population never take part.
:class:`ClientStateStore` keeps a row only for a client that has been written, under a
name per kind of state; a client never written reads as zeros (the algorithms' start
value), at no cost.

Storage:

* in memory (default): one tensor per (name, client) row;
* ``dtype``: rows kept in a compact dtype (``torch.bfloat16`` / ``torch.float16``),
  read back as the compute dtype -- half the memory, and rounding of the stored values
  (so the run's numbers change: off by default);
* ``spill_dir``: rows kept in memory-mapped files ``<spill_dir>/<name>.bin`` (one slot
  per client that took part, grown geometrically), paged in by the OS when read -- the
  resident memory is the round's rows, not the participants'.

:meth:`ClientStateStore.state_dict` holds the rows of the clients written, sorted by
client (tensors and ints only, ``torch.load(weights_only=True)``), so a checkpoint's
size follows participation too and a resumed run reads back exactly the values it
saved (bit for bit: the rows are stored values, not recomputed).
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

__all__ = ["ClientStateStore"]

_COMPACT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class _Rows:
    """The rows of one name: client -> row (in memory) or client -> slot (memory map)."""

    def __init__(self, numel: int, dtype: torch.dtype, compute_dtype: torch.dtype, device, path: Optional[str]):
        self.numel, self.dtype, self.compute_dtype, self.device, self.path = numel, dtype, compute_dtype, device, path
        self.rows: Dict[int, torch.Tensor] = {}  # in memory
        self.slots: Dict[int, int] = {}  # memory map
        self._map: Optional[torch.Tensor] = None  # [capacity, numel] over the file
        if path is not None:
            open(path, "wb").close()  # a fresh file: the store's content is its state, nothing older

    def __contains__(self, client: int) -> bool:
        return client in (self.rows if self.path is None else self.slots)

    def clients(self) -> List[int]:
        return sorted(self.rows if self.path is None else self.slots)

    def _grow(self, capacity: int) -> None:
        itemsize = self.dtype.itemsize
        os.truncate(self.path, capacity * self.numel * itemsize)
        raw = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(capacity, self.numel * itemsize))
        self._map = torch.from_numpy(raw).view(self.dtype)

    def stored(self, client: int) -> torch.Tensor:
        """The stored row (storage dtype, on the CPU for a memory map)."""
        return self.rows[client] if self.path is None else self._map[self.slots[client]]

    def put(self, client: int, value: torch.Tensor) -> None:
        if self.path is None:
            row = self.rows.get(client)
            if row is None:
                self.rows[client] = value.detach().to(device=self.device, dtype=self.dtype, copy=True)
            else:
                row.copy_(value)
            return
        slot = self.slots.get(client)
        if slot is None:
            slot = len(self.slots)
            capacity = 0 if self._map is None else self._map.shape[0]
            if slot >= capacity:
                self._grow(max(16, 2 * capacity))
            self.slots[client] = slot
        self._map[slot].copy_(value.detach())

    def nbytes(self) -> int:
        return len(self.rows if self.path is None else self.slots) * self.numel * self.dtype.itemsize


class ClientStateStore:
    """Named per-client tensors, kept only for clients that have been written.

    Args:
        dtype: the storage dtype of every row (None: each name's compute dtype, which
            keeps values bit for bit; ``torch.bfloat16`` / ``torch.float16``: compact).
        spill_dir: a directory for memory-mapped row files (created if missing; None:
            rows in memory).

    Example::

        store = ClientStateStore()
        store.register("c_i", numel=4)
        store.get("c_i", 7)                 # tensor([0., 0., 0., 0.]): never written
        store.put("c_i", 7, torch.ones(4))
        store.clients("c_i")                # [7]
    """

    def __init__(self, *, dtype: Optional[torch.dtype] = None, spill_dir: Optional[str] = None):
        if dtype is not None and dtype not in _COMPACT:
            raise ValueError(f"dtype must be one of {', '.join(str(d) for d in _COMPACT)} or None, got {dtype!r}")
        if spill_dir is not None:
            if not isinstance(spill_dir, (str, os.PathLike)):
                raise ValueError(f"spill_dir must be a directory path or None, got {spill_dir!r}")
            os.makedirs(spill_dir, exist_ok=True)
        self.dtype = dtype
        self.spill_dir = None if spill_dir is None else os.fspath(spill_dir)
        self._names: Dict[str, _Rows] = {}

    def register(self, name: str, numel: int, *, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        """Declare per-client tensors ``name`` of ``numel`` elements, computed in ``dtype``
        on ``device`` (what :meth:`get` returns)."""
        if not isinstance(name, str) or not name or not name.replace("_", "").isalnum():
            raise ValueError(f"name must be a non-empty identifier (letters, digits, _), got {name!r}")
        if name in self._names:
            raise ValueError(f"per-client state {name!r} is already registered")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        path = None if self.spill_dir is None else os.path.join(self.spill_dir, f"{name}.bin")
        self._names[name] = _Rows(numel, self.dtype or dtype, dtype, torch.device(device), path)

    def _rows(self, name: str) -> _Rows:
        try:
            return self._names[name]
        except KeyError:
            raise KeyError(f"no per-client state {name!r} (registered: {sorted(self._names)})") from None

    @property
    def names(self) -> List[str]:
        return list(self._names)

    def has(self, name: str, client: int) -> bool:
        return int(client) in self._rows(name)

    def clients(self, name: str) -> List[int]:
        """The clients holding a row of ``name``, sorted."""
        return self._rows(name).clients()

    def get(self, name: str, client: int, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Client ``client``'s ``name`` in the compute dtype on the device (zeros if never
        written); a copy when the row is stored compactly or spilled, else the stored row
        itself unless ``out`` is given."""
        rows = self._rows(name)
        client = int(client)
        if client not in rows:
            if out is None:
                return torch.zeros(rows.numel, dtype=rows.compute_dtype, device=rows.device)
            return out.zero_()
        row = rows.stored(client)
        if out is not None:
            return out.copy_(row)
        if row.dtype == rows.compute_dtype and row.device == rows.device and rows.path is None:
            return row
        return row.to(device=rows.device, dtype=rows.compute_dtype, copy=True)

    def gather(self, name: str, clients: Sequence[int]) -> torch.Tensor:
        """``[len(clients), numel]``: the clients' rows (zeros for those never written)."""
        rows = self._rows(name)
        out = torch.zeros(len(clients), rows.numel, dtype=rows.compute_dtype, device=rows.device)
        for i, cid in enumerate(clients):
            if int(cid) in rows:
                out[i].copy_(rows.stored(int(cid)))
        return out

    def put(self, name: str, client: int, value: torch.Tensor) -> None:
        """Store ``value`` (``[numel]``) as client ``client``'s ``name``."""
        rows = self._rows(name)
        if value.numel() != rows.numel:
            raise ValueError(f"{name}: a row has {rows.numel} elements, got a tensor of {value.numel()}")
        rows.put(int(client), value.reshape(-1))

    def nbytes(self, name: Optional[str] = None) -> int:
        """Bytes the rows take (of ``name``, or of all names): on disk when spilled."""
        names = [name] if name is not None else list(self._names)
        return sum(self._rows(n).nbytes() for n in names)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """``{name: {"clients": int64 [K] sorted, "rows": [K, numel] storage dtype}}`` (copies)."""
        out = {}
        for name, rows in self._names.items():
            clients = rows.clients()
            stack = (torch.stack([rows.stored(c).cpu() for c in clients]) if clients
                     else torch.zeros(0, rows.numel, dtype=rows.dtype))
            out[name] = {"clients": torch.tensor(clients, dtype=torch.int64), "rows": stack.clone()}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Replace the rows of the names in ``state`` (from :meth:`state_dict`, or part of
        it: each owner of a name may load its own); the other names keep theirs.  Every
        name is checked before any is replaced."""
        for name in state:
            if name not in self._names:
                raise ValueError(f"the per-client state has {name!r}, which is not registered here "
                                 f"(registered: {sorted(self._names)})")
            rows, entry = self._names[name], state[name]
            if tuple(entry["rows"].shape) != (entry["clients"].numel(), rows.numel):
                raise ValueError(f"{name}: rows of shape {tuple(entry['rows'].shape)} for "
                                 f"{entry['clients'].numel()} clients of {rows.numel} elements")
        for name, entry in state.items():
            rows = self._names[name]
            fresh = _Rows(rows.numel, rows.dtype, rows.compute_dtype, rows.device, rows.path)
            for cid, row in zip(entry["clients"].tolist(), entry["rows"]):
                fresh.put(int(cid), row)
            self._names[name] = fresh

    def load_dense(self, name: str, dense: torch.Tensor) -> None:
        """Load a dense ``[num_clients, numel]`` table (an older checkpoint's): rows that
        are all (positive) zero bits are left out, as they read back the same."""
        rows = self._rows(name)
        fresh = _Rows(rows.numel, rows.dtype, rows.compute_dtype, rows.device, rows.path)
        bits = dense.detach().cpu().contiguous()
        nonzero = (bits.view(torch.int32 if bits.dtype.itemsize == 4 else torch.int16 if bits.dtype.itemsize == 2
                             else torch.int64) != 0).any(dim=1) if bits.numel() else torch.zeros(0, dtype=torch.bool)
        for cid in nonzero.nonzero().flatten().tolist():
            fresh.put(cid, bits[cid])
        self._names[name] = fresh

    def items(self, name: str) -> Iterable:
        """``(client, row)`` pairs of ``name`` in client order (rows in the compute dtype)."""
        for cid in self.clients(name):
            yield cid, self.get(name, cid)
