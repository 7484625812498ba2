"""Host-side chunk and pointer tables of the Triton kernels (layout and chunk rule:
``backends/_chunks.py``, the twin of csrc/include/fedopt/chunks.h).

Only the list forms have tables: ``nar_step_`` / ``nar_sq_norm`` / ``nar_apply_`` over
a list of tensors, ``server_update_`` and a list of clients in the aggregation.  The
``[C, N]`` forms (``nar_step_batched_``, a 2-D client tensor) are table-free: a program
finds its row and chunk from ``program_id`` and the base pointers.

A table is built from tensor *metadata* only (addresses, sizes, element size), never
from values, so building one never synchronises with the device.  Tables are cached:
an optimizer calls with the same tensors every step.  The cache is keyed by the device
and the table's content (the addresses and sizes it is a pure function of), never by
stream or call site, so a hit can never be stale and any stream may use it:

* a miss copies the table from pinned memory with a non-blocking copy on the current
  stream and records an event after it;
* a hit on another stream first makes that stream wait for the event (no host sync;
  once the event has completed it is dropped), and the first hit from each such
  stream records it on the table's memory (``Tensor.record_stream``), as the CUDA
  extension's cache does: evicting the entry then cannot hand the memory back to the
  upload stream's pool while a kernel queued on the other stream still reads it;
* during CUDA-graph capture a hit needs no wait -- ``torch.cuda.graph`` (and the
  cudagraph trees of ``torch.compile(mode="reduce-overhead")``) synchronise the device
  before capture begins -- and the entry is pinned for the life of the process, since
  the graph replays its address; a miss during capture raises (a captured upload would
  replay from a freed host buffer): run the same call once before capturing.

The cache holds at most ``CACHE_SIZE`` entries (least recently used evicted) plus the
captured ones, and a lock makes it safe to call from several threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .. import _chunks
from .._chunks import ROW_COLS, chunk_size_for

CACHE_SIZE = 64
_lock = threading.Lock()
_cache: "OrderedDict[tuple, _Entry]" = OrderedDict()
# Entries used while a CUDA graph was being captured: the graph replays their device
# addresses, so they must outlive any LRU eviction.  Keyed by content like the cache,
# so capturing the same call again does not grow it; ``clear_cache(captured=True)``
# releases them once the graphs are gone.
_captured: dict = {}
stats = {"hits": 0, "misses": 0, "stream_waits": 0}


@dataclass
class _Entry:
    value: object
    stream: Optional[int]  # cuda_stream of the upload (None on CPU)
    ready: Optional[object]  # torch.cuda.Event recorded after the upload, until known complete
    tensors: tuple = ()  # the device tensors of the table (what other streams must record)
    used_by: set = field(default_factory=set)  # other streams already recorded on them


def clear_cache(captured: bool = False) -> None:
    with _lock:
        _cache.clear()
        if captured:
            _captured.clear()
        for k in stats:
            stats[k] = 0


def cache_len() -> int:
    with _lock:
        return len(_cache)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _to_device(rows: list, device: torch.device, cols: int):
    """``(device tensor, upload event or None)`` of ``rows``."""
    host = torch.tensor(rows, dtype=torch.int64).reshape(-1, cols)
    if device.type == "cpu":
        return host, None
    if _capturing(device):
        raise RuntimeError(
            "fedopt_kernels (triton backend): a pointer table would have to be uploaded while a CUDA graph "
            "is being captured; run the same call once before capturing (warm-up) so the table is cached")
    dev = host.pin_memory().to(device, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return dev, event


def _order_for_current_stream(entry: _Entry, device: torch.device) -> None:
    """Make the current stream see ``entry``'s upload, and keep the table's memory
    alive for it (see the module docstring)."""
    if _capturing(device):
        return
    stream = torch.cuda.current_stream(device)
    if stream.cuda_stream == entry.stream:
        return  # same stream: ordered already, and the allocator's own stream
    if stream.cuda_stream not in entry.used_by:
        for t in entry.tensors:
            t.record_stream(stream)
        entry.used_by.add(stream.cuda_stream)
    if entry.ready is None:
        return
    if entry.ready.query():
        entry.ready = None
        return
    stream.wait_event(entry.ready)
    stats["stream_waits"] += 1


def _cached(key: tuple, device: torch.device, build):
    """The table of ``key`` (``build(upload)`` makes it on a miss)."""
    with _lock:
        entry = _cache.get(key) or _captured.get(key)
        if entry is not None:
            if key in _cache:
                _cache.move_to_end(key)
            stats["hits"] += 1
            if device.type == "cuda":
                _order_for_current_stream(entry, device)
                if _capturing(device):
                    _captured[key] = entry
            return entry.value
        stats["misses"] += 1
        events, tensors = [], []

        def upload(rows, cols):
            dev, event = _to_device(rows, device, cols)
            tensors.append(dev)
            if event is not None:
                events.append(event)
            return dev

        value = build(upload)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        # every upload of one build is on the same stream: the last event covers them all
        _cache[key] = _Entry(value, stream, events[-1] if events else None, tuple(tensors))
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
        return value


@dataclass(frozen=True)
class NarTable:
    chunks: torch.Tensor  # [n_chunks, ROW_COLS] int64, on the device
    groups: torch.Tensor  # [num_groups, 2] int64 (pbegin, pend), on the device
    n_chunks: int
    num_groups: int
    max_group_chunks: int
    chunk_size: int


def nar_table(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              bufs: Sequence[torch.Tensor]) -> NarTable:
    """Table of ``nar_step_`` (and ``nar_sq_norm`` / ``nar_apply_``): one group."""
    device = params[0].device
    xa = tuple(p.data_ptr() for p in params)
    ga = tuple(g.data_ptr() for g in grads)
    ba = tuple(b.data_ptr() for b in bufs) if bufs else (0,) * len(xa)
    numels = tuple(p.numel() for p in params)
    esize = params[0].element_size()
    key = ("nar", device, esize, xa, ga, ba, numels)

    def build(upload):
        chunk = chunk_size_for(sum(numels))
        rows, ranges = _chunks.build_rows(list(zip(xa, ga, ba)), (esize,) * 3, numels, (0,) * len(numels), 1,
                                          chunk)
        n_chunks = len(rows) // ROW_COLS
        return NarTable(chunks=upload(rows, ROW_COLS), groups=upload(ranges, 2), n_chunks=n_chunks, num_groups=1,
                        max_group_chunks=n_chunks, chunk_size=chunk)

    return _cached(key, device, build)


@dataclass(frozen=True)
class ClientTable:
    addrs: torch.Tensor  # [C, 2] int64 (client address, flags), on the device


def client_table(clients: Sequence[torch.Tensor]) -> ClientTable:
    """Addresses of a list of client vectors and whether each is 16-byte aligned."""
    device = clients[0].device
    addrs = tuple(c.data_ptr() for c in clients)
    key = ("clients", device, addrs)

    def build(upload):
        rows = []
        for a in addrs:
            rows += (a, _chunks.FLAG_ALIGNED16 if a % _chunks.ALIGN_BYTES == 0 else 0)
        return ClientTable(upload(rows, 2))

    return _cached(key, device, build)


@dataclass(frozen=True)
class ServerTable:
    chunks: torch.Tensor  # [n_chunks, ROW_COLS] int64, on the device
    n_chunks: int
    chunk_size: int


def server_table(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                 exp_avg: Sequence[torch.Tensor], exp_avg_sq: Sequence[torch.Tensor]) -> ServerTable:
    """Table of ``server_update_``: ``exp_avg`` / ``exp_avg_sq`` are empty lists when the
    rule has no such state (their pointers are then 0)."""
    device = params[0].device
    T = len(params)
    xa = tuple(p.data_ptr() for p in params)
    da = tuple(d.data_ptr() for d in updates)
    ma = tuple(m.data_ptr() for m in exp_avg) if exp_avg else (0,) * T
    va = tuple(v.data_ptr() for v in exp_avg_sq) if exp_avg_sq else (0,) * T
    numels = tuple(p.numel() for p in params)
    esize, dsize = params[0].element_size(), updates[0].element_size()
    key = ("server", device, esize, dsize, xa, da, ma, va, numels)

    def build(upload):
        chunk = chunk_size_for(sum(numels))
        rows, _ = _chunks.build_rows(list(zip(xa, da, ma, va)), (esize, dsize, esize, esize), numels, (0,) * T, 1,
                                     chunk)
        return ServerTable(chunks=upload(rows, ROW_COLS), n_chunks=len(rows) // ROW_COLS, chunk_size=chunk)

    return _cached(key, device, build)
