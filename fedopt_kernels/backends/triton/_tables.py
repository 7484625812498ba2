"""Host-side pointer and chunk tables of the Triton kernels (the idea of
csrc/include/fedopt/chunks.h, with the tensors' addresses in the table).

A table is built from tensor *metadata* only (addresses, sizes, element size), never
from values, so building one never synchronises with the device.  It is moved to the
device with a non-blocking copy from pinned memory (on CPU, under the Triton
interpreter, it stays a CPU tensor).

Tables are cached: an optimizer calls with the same tensors every step, and a table is
a pure function of the addresses and sizes in its key, so a hit can never be stale
(a tensor freed and another allocated at the same address with the same size gives the
same table, which is then also right).  On CUDA the key includes the stream, so a
table is first used on the stream its copy was queued on.

Chunk table of the FedNAR kernels (one row of ``NAR_COLS`` int64 per chunk)::

    [x_addr, g_addr, b_addr, len, group, pbegin, pend, 0]

``*_addr`` already point at the chunk's first element; ``len <= chunk_size``; the
chunk's group owns partials ``[pbegin, pend)`` (its chunks are contiguous, in list
order).  Chunks start at multiples of ``chunk_size`` (a power of two >= 8192) inside
their tensor, so a chunk address is 16-byte aligned iff its tensor's is.

Chunk table of the server update (``SERVER_COLS`` int64 per chunk, same chunking)::

    [x_addr, d_addr, m_addr, v_addr, len, 0, 0, 0]

Its pointers have two element types: ``d`` (the mean update) is in the acc dtype,
``x``, ``m``, ``v`` in the params' dtype, so each column advances by its own element
size.  ``m_addr`` / ``v_addr`` are 0 where the rule has no such state.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

NAR_COLS = 8
SERVER_COLS = 8  # 5 used; 64-byte rows like NAR_COLS
# Chunk size: a power of two, at least MIN_CHUNK elements, large enough that a call
# has at most about TARGET_CHUNKS chunks plus one per tensor (the tail chunks).
MIN_CHUNK = 8192
TARGET_CHUNKS = 1024
# Beyond this many partials in one group, the update kernel stops re-combining them in
# every program and a one-program-per-group finalize kernel does it once.
MAX_REDUNDANT_PARTIALS = 4096
ALIGN_BYTES = 16

_CACHE_SIZE = 64
_cache: "OrderedDict[tuple, object]" = OrderedDict()
# Tables used while a CUDA graph was being captured: the graph replays their device
# addresses, so they must outlive any LRU eviction (kept for the life of the process).
_captured: dict = {}
stats = {"hits": 0, "misses": 0}


def clear_cache() -> None:
    _cache.clear()
    stats["hits"] = stats["misses"] = 0


def chunk_size_for(total: int) -> int:
    """The chunk size of a call over ``total`` elements (power of two >= MIN_CHUNK)."""
    want = -(-total // TARGET_CHUNKS)
    size = MIN_CHUNK
    while size < want:
        size *= 2
    return size


def _stream_key(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return None


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _to_device(rows: list, device: torch.device, cols: int) -> torch.Tensor:
    host = torch.tensor(rows, dtype=torch.int64).reshape(-1, cols)
    if device.type == "cpu":
        return host
    if _capturing(device):
        # A captured host-to-device copy would be replayed from a pinned buffer that is
        # freed after this call.  Tables come from the cache once warmed up, so the fix
        # is the warm-up that CUDA-graph capture needs anyway.
        raise RuntimeError(
            "fedopt_kernels (triton backend): a pointer table would have to be uploaded while a CUDA graph "
            "is being captured; run the same call once before capturing (warm-up) so the table is cached")
    return host.pin_memory().to(device, non_blocking=True)


def _cached(key: tuple, build):
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        stats["hits"] += 1
        if _capturing(key[1]):  # every key starts with (kind, device, ...)
            _captured[key] = hit
        return hit
    stats["misses"] += 1
    value = build()
    _cache[key] = value
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return value


@dataclass(frozen=True)
class NarTable:
    chunks: torch.Tensor  # [n_chunks, NAR_COLS] int64, on the device
    groups: torch.Tensor  # [num_groups, 2] int64 (pbegin, pend), on the device
    n_chunks: int
    num_groups: int
    max_group_chunks: int
    chunk_size: int
    aligned: bool  # every address is 16-byte aligned: the ALIGNED kernel variant runs


def _build_nar(xa, ga, ba, numels, group_of, num_groups, esize, device) -> NarTable:
    """Chunk the segments (addresses ``xa/ga/ba``, sizes ``numels``) group by group."""
    total = sum(numels)
    chunk = chunk_size_for(total)
    rows: list = []
    group_rows = []
    aligned = True
    t = 0
    T = len(numels)
    for gi in range(num_groups):
        pbegin = len(rows) // NAR_COLS
        first = len(rows)
        while t < T and group_of[t] == gi:
            n = numels[t]
            x0, g0, b0 = xa[t], ga[t], ba[t]
            if n and ((x0 | g0 | b0) % ALIGN_BYTES):
                aligned = False
            for start in range(0, n, chunk):
                off = start * esize
                rows += (x0 + off, g0 + off, (b0 + off) if b0 else 0, min(chunk, n - start), gi, 0, 0, 0)
            t += 1
        pend = len(rows) // NAR_COLS
        for r in range(first, len(rows), NAR_COLS):  # fill in the group's partial range
            rows[r + 5] = pbegin
            rows[r + 6] = pend
        group_rows += (pbegin, pend)
    n_chunks = len(rows) // NAR_COLS
    max_group = max((group_rows[2 * i + 1] - group_rows[2 * i] for i in range(num_groups)), default=0)
    return NarTable(
        chunks=_to_device(rows, device, NAR_COLS),
        groups=_to_device(group_rows, device, 2),
        n_chunks=n_chunks, num_groups=num_groups, max_group_chunks=max_group, chunk_size=chunk,
        aligned=aligned)


def nar_table(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              bufs: Sequence[torch.Tensor]) -> NarTable:
    """Table of ``nar_step_``: all tensors form group 0."""
    device = params[0].device
    xa = tuple(p.data_ptr() for p in params)
    ga = tuple(g.data_ptr() for g in grads)
    ba = tuple(b.data_ptr() for b in bufs) if bufs else (0,) * len(xa)
    numels = tuple(p.numel() for p in params)
    esize = params[0].element_size()
    key = ("nar", device, _stream_key(device), esize, xa, ga, ba, numels)
    return _cached(key, lambda: _build_nar(xa, ga, ba, numels, (0,) * len(numels), 1, esize, device))


def nar_batched_table(X: torch.Tensor, G: torch.Tensor, B: Optional[torch.Tensor]) -> NarTable:
    """Table of ``nar_step_batched_``: row ``i`` of the ``[C, N]`` tensors is group ``i``."""
    device = X.device
    C, N = X.shape
    esize = X.element_size()
    bptr = B.data_ptr() if B is not None else 0
    key = ("nar_batched", device, _stream_key(device), esize, X.data_ptr(), G.data_ptr(), bptr, C, N)

    def build():
        row = N * esize
        xa = [X.data_ptr() + i * row for i in range(C)]
        ga = [G.data_ptr() + i * row for i in range(C)]
        ba = [bptr + i * row if bptr else 0 for i in range(C)]
        return _build_nar(xa, ga, ba, [N] * C, list(range(C)), C, esize, device)

    return _cached(key, build)


@dataclass(frozen=True)
class ClientTable:
    addrs: torch.Tensor  # [C] int64 client row addresses, on the device
    aligned: bool


def client_table(clients) -> ClientTable:
    """Addresses of the client rows (a list of 1-D tensors or the rows of a 2-D one)."""
    if isinstance(clients, torch.Tensor):
        C, N = clients.shape
        device = clients.device
        row = N * clients.element_size()
        base = clients.data_ptr()
        key = ("clients2d", device, _stream_key(device), base, C, row)
        addrs = None
    else:
        device = clients[0].device
        addrs = tuple(c.data_ptr() for c in clients)
        key = ("clients", device, _stream_key(device), addrs)

    def build():
        a = addrs if addrs is not None else [base + i * row for i in range(C)]
        aligned = all(x % ALIGN_BYTES == 0 for x in a)
        return ClientTable(_to_device(list(a), device, 1).reshape(-1), aligned)

    return _cached(key, build)


@dataclass(frozen=True)
class ServerTable:
    chunks: torch.Tensor  # [n_chunks, SERVER_COLS] int64, on the device
    n_chunks: int
    chunk_size: int
    aligned: bool  # every address of every column is 16-byte aligned


def _build_server(xa, da, ma, va, numels, esize, dsize, device) -> ServerTable:
    chunk = chunk_size_for(sum(numels))
    rows: list = []
    aligned = True
    for x0, d0, m0, v0, n in zip(xa, da, ma, va, numels):
        if not n:
            continue  # an empty tensor has no chunk (and its address may be anything)
        # One misaligned pointer of any column (typically an update view at an odd
        # offset of the flat mean vector) sends the whole call to the unaligned variant.
        if (x0 | d0 | m0 | v0) % ALIGN_BYTES:
            aligned = False
        for start in range(0, n, chunk):
            off, doff = start * esize, start * dsize
            rows += (x0 + off, d0 + doff, (m0 + off) if m0 else 0, (v0 + off) if v0 else 0,
                     min(chunk, n - start), 0, 0, 0)
    return ServerTable(chunks=_to_device(rows, device, SERVER_COLS), n_chunks=len(rows) // SERVER_COLS,
                       chunk_size=chunk, aligned=aligned)


def server_table(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                 exp_avg: Sequence[torch.Tensor], exp_avg_sq: Sequence[torch.Tensor]) -> ServerTable:
    """Table of ``server_update_``: ``exp_avg`` / ``exp_avg_sq`` are empty lists when the
    rule has no such state."""
    device = params[0].device
    T = len(params)
    xa = tuple(p.data_ptr() for p in params)
    da = tuple(d.data_ptr() for d in updates)
    ma = tuple(m.data_ptr() for m in exp_avg) if exp_avg else (0,) * T
    va = tuple(v.data_ptr() for v in exp_avg_sq) if exp_avg_sq else (0,) * T
    numels = tuple(p.numel() for p in params)
    esize, dsize = params[0].element_size(), updates[0].element_size()
    key = ("server", device, _stream_key(device), esize, dsize, xa, da, ma, va, numels)
    return _cached(key, lambda: _build_server(xa, da, ma, va, numels, esize, dsize, device))
