"""Sharded parameters (``DTensor``: FSDP2's ``fully_shard``, tensor parallelism) in the
FedNAR step: one norm over the WHOLE model, the update local to each shard.

FedNAR clips on the norm of the full vector.  With parameters sharded over ranks, each
rank holds a piece of every sharded tensor, so the step is cut as
:func:`~fedopt_kernels.ops.nar_step_groups_` cuts any call (a norm pass, then an update
pass with the total), with one addition in between:

1. each rank sums the squares of its local shards (the backends' ``nar_sq_norm`` on
   ``to_local()`` views: no copy, no gather);
2. those partial sums are all-reduced (SUM) over the mesh dimensions along which the
   tensors are sharded -- once per distinct (mesh, placements), in a fixed order, the
   same collective on every rank; a dimension along which they are replicated is not
   summed (every rank there holds the same values), and a plain (non-DTensor) tensor
   counts once, as every rank holds all of it.  This is what
   ``torch.nn.utils.clip_grad_norm_`` computes for DTensors;
3. every rank updates its local shards with that total: the same norm, scale and skip
   decision everywhere, and no host synchronisation beyond the collective itself.

A gradient must have its parameter's placements (FSDP2's reduce-scattered gradients
do).  A ``Partial`` placement (a gradient not yet reduced) is refused: its local values
are addends, not a shard, so no local norm exists.
"""

from __future__ import annotations

import sys
from typing import List, NamedTuple, Sequence, Tuple

import torch


def is_dtensor(t) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``.  Without importing torch.distributed:
    no DTensor can exist before its module was imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def any_dtensor(tensors) -> bool:
    return any(is_dtensor(t) for t in tensors)


class ShardedGroup(NamedTuple):
    """A group's tensors with one sharding: local (plain) tensors and the process groups
    over which their squared norms are summed (empty: replicated or not distributed)."""

    params: List[torch.Tensor]
    grads: List[torch.Tensor]
    bufs: List[torch.Tensor]
    reduce_over: Tuple  # process groups, one per sharded mesh dimension
    key: Tuple  # identifies the sharding (same key: same collectives)


def _sharding(t, name: str):
    """``(key, process groups)`` of a DTensor's sharding; ``((), ())`` for a plain tensor."""
    if not is_dtensor(t):
        return (), ()
    from torch.distributed.tensor import Partial, Replicate, Shard

    groups, kinds = [], []
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Partial):
            raise ValueError(f"{name} is a DTensor with a Partial placement on mesh dimension {dim}: its local "
                             "values are not a shard of the tensor, so its norm cannot be taken locally; "
                             "redistribute it to Shard or Replicate first")
        if isinstance(placement, Shard):
            groups.append(t.device_mesh.get_group(dim))
            kinds.append(("shard", dim))
        elif not isinstance(placement, Replicate):
            raise ValueError(f"{name} is a DTensor with an unsupported placement {placement!r}")
    return (id(t.device_mesh), tuple(kinds)), tuple(groups)


def _local(t, like, name: str, like_name: str):
    """``t``'s local tensor; ``t`` must be a DTensor sharded as ``like`` when ``like`` is one."""
    if not is_dtensor(like):
        if is_dtensor(t):
            raise ValueError(f"{name} is a DTensor but {like_name} is not")
        return t
    if not is_dtensor(t):
        raise ValueError(f"{name} must be a DTensor sharded like {like_name} (a {tuple(like.placements)} "
                         f"DTensor), got a plain tensor")
    _sharding(t, name)  # refuses a Partial placement, naming it
    if t.device_mesh != like.device_mesh or tuple(t.placements) != tuple(like.placements):
        raise ValueError(f"{name} has placements {tuple(t.placements)} but {like_name} has "
                         f"{tuple(like.placements)} (a gradient must be sharded as its parameter)")
    return t.to_local()


def split_by_sharding(params: Sequence, grads: Sequence, bufs: Sequence, prefix: str = "") -> List[ShardedGroup]:
    """The tensors of one group cut by sharding, in first-seen order, as local tensors
    (``bufs``: empty, or one momentum buffer per param)."""
    out: dict = {}
    for i, p in enumerate(params):
        key, reduce_over = _sharding(p, f"{prefix}params[{i}]")
        if i >= len(grads):
            break  # the caller reports the length mismatch
        group = out.get(key)
        if group is None:
            group = out[key] = ShardedGroup([], [], [], reduce_over, key)
        group.params.append(p.to_local() if is_dtensor(p) else p)
        group.grads.append(_local(grads[i], p, f"{prefix}grads[{i}]", f"{prefix}params[{i}]"))
        if bufs:
            buf = bufs[i]
            group.bufs.append(buf.to_local() if is_dtensor(buf) else buf)
    return list(out.values())


def all_reduce_sum_(sq: torch.Tensor, reduce_over: Tuple) -> torch.Tensor:
    """Sum ``sq`` (a 0-d partial sum of squares) over every process group of
    ``reduce_over``, in place, and return it."""
    import torch.distributed as dist

    for group in reduce_over:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq
