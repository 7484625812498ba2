"""Every rank's compressed client replies on every rank, in rank order.

The simulator over ranks (``--distributed --compress``) has each rank encode and screen
its own clients' updates; the server step then needs every reply of the round.  As
DiLoCo's quantized exchange (:mod:`.quantized_exchange`) does for one reply per worker,
the codes are all-gathered, not summed: codes on per-client scales cannot be added on
the wire.  One host exchange of the small things (each rank's client ids and the
clients it left out, with their reasons), then one padded all-gather per array
(:func:`~.comm.gather_rows`): the codes (fp8 as their bytes, ``uint8``), and the scales
(block codecs) or the top-k indices.  Every reply of a codec has the same shape for a
model of ``numel`` values (``wire_numel`` codes, ``ceil(wire_numel / block)`` scales,
``k = topk_count(wire_numel, fraction)`` values and indices), and only screened replies
travel, so the rows stack.  Each rank then forms the same round from the same replies
in the same order -- the fused decode-aggregate, or the decoded rows under a robust rule
or DP -- with the server optimizer's own step: bit for bit the single-process round, with
no reduction between ranks.

Bytes between ranks: each rank receives the other ranks' replies, ``(W - 1) / W`` of the
round's ``bytes_up`` each, padded to the largest rank's count.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..ops import compressed as C
from . import comm
from .comm import Plan

__all__ = ["all_gather_replies"]

Reply = Tuple[int, C.CompressedUpdate]
LeftOut = Tuple[int, str, str]


def _rows(replies: Sequence[C.CompressedUpdate], field: str, width: int, dtype, device) -> torch.Tensor:
    if not replies:
        return torch.empty(0, width, dtype=dtype, device=device)
    ts = [getattr(r, field) for r in replies]
    if field == "codes" and ts[0].dtype == torch.float8_e4m3fn:
        ts = [t.view(torch.uint8) for t in ts]
    return torch.stack(ts)


def all_gather_replies(good: Sequence[Reply], left_out: Sequence[LeftOut], codec, numel: int, group=None,
                       *, device="cpu") -> Tuple[List[Reply], List[LeftOut]]:
    """``(replies, left_out)`` of every rank (collective): ``good`` (this rank's screened
    ``(client, reply)`` of ``codec`` -- a :class:`~fedopt_kernels.compression.Codec` --
    for a model of ``numel`` values) and ``left_out`` (``(client, reason, detail)``),
    concatenated in rank order on every rank."""
    world = comm.group_size(group)
    meta = [None] * world
    dist.all_gather_object(meta, ([int(c) for c, _ in good], [tuple(b) for b in left_out]),
                           group=comm.object_group(group))
    counts = tuple(len(cids) for cids, _ in meta)
    clients = [c for cids, _ in meta for c in cids]
    left = [tuple(b) for _, bad in meta for b in bad]
    if not clients:
        return [], left
    n = codec.wire_numel(numel)
    plan = Plan(rank=comm.group_rank(group), world=world, counts=counts, N=n, extras=())
    mine = [r for _, r in good]
    if codec.name == "topk":
        k = C.topk_count(n, codec.fraction)
        values = comm.gather_rows(_rows(mine, "codes", k, torch.float32, device), plan, group)
        indices = comm.gather_rows(_rows(mine, "indices", k, torch.int64, device), plan, group)
        replies = [C.CompressedUpdate("topk", n, v, indices=i) for v, i in zip(values, indices)]
    else:
        width = C.code_numel(codec.name, n)
        code_dtype = torch.int8 if codec.name == "int8" else torch.uint8
        codes = comm.gather_rows(_rows(mine, "codes", width, code_dtype, device), plan, group)
        scales = comm.gather_rows(_rows(mine, "scales", C.num_scales(n, codec.block), torch.float32, device),
                                  plan, group)
        if codec.name == "fp8":
            codes = codes.view(torch.float8_e4m3fn)
        replies = [C.CompressedUpdate(codec.name, n, c, scales=s, block=codec.block) for c, s in zip(codes, scales)]
    return list(zip(clients, replies)), left
