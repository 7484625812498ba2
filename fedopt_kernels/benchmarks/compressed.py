"""Benchmark of the compressed decode-aggregate against the fp32 floor and against
"decode, then aggregate".

For each codec the same C replies of N values are aggregated:

* ``fused <codec>``: :func:`fedopt_kernels.ops.compressed.decode_aggregate` (the codes and
  scales read in place, the statistics in the same pass; ``nonfinite="propagate"``, as
  the aggregate benchmark's ``fused``; ``checked=True``, as a round calls it after
  validating the replies) over the replies as the simulator's round holds them: a block
  codec's encoded straight into the round's
  :class:`~fedopt_kernels.compression.reply_arena.ReplyArena` (``encode(out=)``); top-k's
  as its encode allocates them;
* ``fused <codec>, replies one by one``: the same over the replies as the plain encode
  returns them, each its own allocation (as a server holds replies it deserialised one
  by one);
* ``encode <codec>``: the clients' side, the C updates encoded one after the other (the
  backend's fused encode; ``GB/s``: each update's ``4 N`` bytes read and its reply written);
* ``check_reply <codec>``: that validation of the C replies (scales, indices), alone;
* ``decode then aggregate <codec>``: NVFlare's / FLSim's way -- every reply dequantized
  into a dense fp32 copy in eager torch, then the copies summed with their weights
  (``torch.stack`` + ``torch.mv``), no statistics;
* ``floor`` (``torch.sum(X, dim=0)`` of the fp32 ``[C, N]``, DESIGN.md section 4): the
  fp32 memory floor of the same run; ``vs floor`` is its time over each candidate's.  It
  sums into a preallocated ``out=`` as the fused candidates do (a fresh 4N-byte result
  per call made the floor ~20% slower: 83 against 67 ms, 1 thread, Zen 5, and flattered
  every ratio by as much).  ``X`` is one torch allocation, as the simulator's fp32 update
  rows are;
* ``floor, 2 MiB pages``: the same sum with ``X`` in a
  :func:`~fedopt_kernels.compression.reply_arena.host_buffer` advised for huge pages --
  the arena's page treatment given to the floor too; ``vs floor, 2 MiB pages`` is its
  time over each candidate's.

Targets (issue 42): int8 >= 2.5x and 4-bit >= 4x the fp32 floor.  ``bytes/reply`` and
``vs fp32 bytes`` say what travels.  ``GB/s`` (floor and fused rows): the bytes each must
move at least -- every reply read once (``X``: ``4 C N``; fused: ``C`` times the reply's
bytes) and ``out``'s ``4 N`` written once -- over its time; write-allocate (the line of a
plain store read first: another ``4 N``) is not counted.  Where both sides run at the same
GB/s (memory-bound), ``vs floor`` is the ratio of those bytes (C = 20: int8 3.46x, int4
5.87x).  Timed interleaved, medians, from memory ("cold").
"""

from __future__ import annotations

from typing import Optional

import torch

from ..compression import Codec
from ..compression.reply_arena import ReplyArena, host_buffer
from ..ops import compressed as C
from .timing import interleaved

FLOOR = "floor (torch.sum dim 0, fp32)"
FLOOR_HUGE = "floor, 2 MiB pages"
ONE_BY_ONE = ", replies one by one"
CODECS = (("int8", Codec("int8", block=256)), ("int4", Codec("int4", block=256)), ("fp8", Codec("fp8", block=256)),
          ("topk 1%", Codec("topk", fraction=0.01)))


def _eager_decode(reply: C.CompressedUpdate) -> torch.Tensor:
    """A dense fp32 copy of one reply, as eager torch writes it (NVFlare / FLSim)."""
    n = reply.numel
    if reply.codec == "topk":
        out = torch.zeros(n, dtype=torch.float32, device=reply.codes.device)
        out[reply.indices] = reply.codes
        return out
    if reply.codec == "int4":
        b = reply.codes.view(torch.int8).to(torch.int16)
        q = torch.stack([(b << 12) >> 12, b >> 4], dim=1).reshape(-1)[:n].to(torch.float32)
    else:
        q = reply.codes.to(torch.float32)
    return reply.scales.repeat_interleave(reply.block)[:n] * q


def bench_compressed(C_: int, N: int, *, label: str, backend: Optional[str] = None, device="cpu",
                     repeats: int = 7) -> list:
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(C_, N, generator=g).to(device)
    w = torch.rand(C_, generator=g).to(device)
    w = w / w.sum()
    out = torch.empty(N, device=device)
    floor_out = torch.empty(N, device=device)
    candidates = {FLOOR: lambda: torch.sum(X, dim=0, out=floor_out)}
    host = device.type == "cpu"
    if host:  # the floor given the arena's pages (its own out too)
        X_huge = host_buffer(4 * C_ * N).view(torch.float32).view(C_, N).copy_(X)
        huge_out = host_buffer(4 * N).view(torch.float32)
        candidates[FLOOR_HUGE] = lambda: torch.sum(X_huge, dim=0, out=huge_out)
    sizes = {}
    for name, codec in CODECS:
        replies = [codec.encode(X[i]) for i in range(C_)]
        sizes[name] = replies[0].nbytes()
        held = replies
        if host and codec.name != "topk":  # the round's replies, as the simulator writes them
            arena = ReplyArena()
            arena.start_round(reserve=C_ * (sizes[name] + 128))
            layout = C.block_reply_layout(codec.name, N, codec.block)
            held = [codec.encode(X[i], out=tuple(arena.take(count, dtype) for dtype, count in layout))
                    for i in range(C_)]

        def fused(r):
            return lambda: C.decode_aggregate(r, w, out=out, nonfinite="propagate", backend=backend, checked=True)

        candidates[f"fused {name}"] = fused(held)
        if held is not replies:
            candidates[f"fused {name}{ONE_BY_ONE}"] = fused(replies)
        candidates[f"encode {name}"] = (lambda c=codec: [c.encode(X[i], backend=backend) for i in range(C_)])
        candidates[f"check_reply {name}"] = (lambda r=replies: [C.check_reply(x, N) for x in r])
        candidates[f"decode then aggregate {name}"] = (
            lambda r=replies: torch.mv(torch.stack([_eager_decode(x) for x in r]).t(), w))
    times = interleaved(candidates, repeats=repeats, device=device, cold_cache=True)
    rows = []
    for name, seconds in times.items():
        codec = next((c for c, _ in CODECS if name.endswith(" " + c) or name.endswith(" " + c + ONE_BY_ONE)), None)
        nbytes = sizes[codec] if codec else 4 * N
        if name in (FLOOR, FLOOR_HUGE) or name.startswith("fused "):
            moved = C_ * nbytes + 4 * N
        elif name.startswith("encode "):
            moved = C_ * (4 * N + nbytes)  # each update read, its reply written
        else:
            moved = float("nan")
        rows.append({"benchmark": f"compressed aggregate {label}", "case": name, "ms": seconds * 1e3,
                     "vs floor": times[FLOOR] / seconds,
                     "vs floor, 2 MiB pages": times[FLOOR_HUGE] / seconds if host else float("nan"),
                     "params/s": C_ * N / seconds, "bytes/reply": nbytes, "vs fp32 bytes": 4 * N / nbytes,
                     "GB/s": moved / seconds / 1e9})
    return rows
