"""Process-group plumbing of the distributed aggregation.

* :func:`exchange` -- ONE host-side exchange per call (``all_gather_object`` over a
  CPU-capable group): every rank's client count, vector length, dtype, device type and
  local validation error.  Every rank then takes the same decision: all go on, or all
  raise (a rank that raised alone would leave the others waiting in a collective).
  Nothing here reads device memory, so a CUDA step stays free of host syncs.
* :func:`gather_rows` -- ``[C_r, m]`` per rank -> ``[C, m]`` in rank order (padded
  ``all_gather``: uneven counts are known from the exchange).
* :func:`send` / :func:`recv` / :func:`broadcast` by group rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["Plan", "RankInputError", "exchange", "gather_rows", "send", "recv", "broadcast", "all_reduce",
           "group_rank", "group_size", "broadcast_object"]


def _group(group):
    return dist.group.WORLD if group is None else group


def group_rank(group) -> int:
    return dist.get_rank(_group(group))


def group_size(group) -> int:
    return dist.get_world_size(_group(group))


def _global(group, r: int) -> int:
    g = _group(group)
    return r if g is dist.group.WORLD else dist.get_global_rank(g, r)


def check_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs torch.distributed: call torch.distributed.init_process_group() first "
                           "(torchrun sets the environment it reads)")


_object_groups: dict = {}


def object_group(group):
    """A group with the same ranks that carries CPU tensors (pickled objects).

    A group whose backend includes gloo (``"gloo"``, ``"cpu:gloo,cuda:nccl"``) is used as
    it is; for an NCCL-only group a gloo group over the same ranks is made once (every
    member creates it at its first exchange) so the exchange never touches the GPU.
    """
    g = _group(group)
    config = getattr(dist, "get_backend_config", dist.get_backend)  # "cpu:gloo,cuda:nccl" for a mixed group
    backend = str(config(g)).lower()
    if "gloo" in backend or "mpi" in backend:
        return g
    key = id(g)
    cached = _object_groups.get(key)
    if cached is None or cached[0] is not g:
        ranks = dist.get_process_group_ranks(g)
        cached = _object_groups[key] = (g, dist.new_group(ranks=ranks, backend="gloo",
                                                          use_local_synchronization=True))
    return cached[1]


class RankInputError(ValueError):
    """Another rank of the group rejected its inputs (that rank raised the original
    error); raised on every other rank so none is left waiting in a collective."""


@dataclass(frozen=True)
class Plan:
    """What every rank agreed on for one distributed aggregation."""

    rank: int
    world: int
    counts: Tuple[int, ...]  # clients per rank, in rank order
    N: int
    extras: Tuple[Any, ...]  # each rank's extra payload, in rank order

    @property
    def C(self) -> int:
        return sum(self.counts)

    @property
    def start(self) -> int:
        """Global index of this rank's first client (global order: rank order, then
        each rank's own order)."""
        return sum(self.counts[:self.rank])

    @property
    def stop(self) -> int:
        return self.start + self.counts[self.rank]


def exchange(group, *, what: str, count: int, N: Optional[int], dtype, device_type: Optional[str],
             error: Optional[BaseException], extra: Any = None) -> Plan:
    """Share this rank's metadata (and validation error) with the group; return the
    :class:`Plan`, or raise on EVERY rank if any rank failed or the ranks disagree."""
    check_initialized(what)
    rank, world = group_rank(group), group_size(group)
    mine = {"count": int(count), "N": N, "dtype": str(dtype), "device": device_type,
            "error": None if error is None else f"{type(error).__name__}: {error}", "extra": extra}
    infos: List[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(infos, mine, group=object_group(group))
    failed = [(r, info["error"]) for r, info in enumerate(infos) if info["error"] is not None]
    if failed:
        if error is not None:
            raise error
        r, msg = failed[0]
        raise RankInputError(f"{what}: rank {r} of the group rejected its inputs ({msg}); every rank stops")
    for key, label in (("N", "vector length"), ("dtype", "dtype"), ("device", "device type")):
        values = [info[key] for info in infos]
        if any(v != values[0] for v in values):
            raise ValueError(f"{what}: the ranks disagree on the {label}: " + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(values)))
    counts = tuple(info["count"] for info in infos)
    if sum(counts) == 0:
        raise ValueError(f"{what}: no rank holds a client (counts {list(counts)})")
    return Plan(rank=rank, world=world, counts=counts, N=infos[0]["N"], extras=tuple(i["extra"] for i in infos))


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=_group(group))


def gather_rows(local: torch.Tensor, plan: Plan, group) -> torch.Tensor:
    """``[C_r, m]`` on every rank -> ``[C, m]`` (rank order) on every rank: one padded
    ``all_gather`` of ``world * max(C_r) * m`` elements."""
    m = local.shape[1]
    most = max(plan.counts)
    send_buf = torch.zeros(most, m, dtype=local.dtype, device=local.device)
    send_buf[:local.shape[0]] = local
    recv_buf = torch.empty(plan.world * most, m, dtype=local.dtype, device=local.device)
    _all_gather_single(recv_buf, send_buf, group)
    recv_buf = recv_buf.view(plan.world, most, m)
    parts = [recv_buf[r, :c] for r, c in enumerate(plan.counts) if c]
    return torch.cat(parts) if parts else recv_buf.new_empty(0, m)


def send(tensor: torch.Tensor, dst: int, group) -> None:
    dist.send(tensor, _global(group, dst), group=_group(group))


def recv(tensor: torch.Tensor, src: int, group) -> None:
    dist.recv(tensor, _global(group, src), group=_group(group))


def broadcast(tensor: torch.Tensor, src: int, group) -> None:
    dist.broadcast(tensor, _global(group, src), group=_group(group))


def broadcast_object(obj: Any, src: int, group) -> Any:
    """``obj`` of group rank ``src`` on every rank (host side, over the CPU-capable
    :func:`object_group`: no device memory is read)."""
    box = [obj]
    dist.broadcast_object_list(box, src=_global(group, src), group=object_group(group))
    return box[0]


def all_reduce(tensor: torch.Tensor, group) -> None:
    dist.all_reduce(tensor, group=_group(group))

