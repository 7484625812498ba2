"""``nar_step_groups_``: one FedNAR step with ONE clip norm over several param groups,
dtypes and devices (public functional op).

The FedNAR authors clip once over ``model.parameters()`` ([FedNAR]'s released code): every
tensor of every group is one vector, while each group keeps its own lr, weight decay and
momentum.  A call is cut into *parts*, one per (group, device, dtype) in first-seen
order; then

1. each part's backend sums the squares of its clipped-on vector (``nar_sq_norm``: one
   read of g, and of x in mode co);
2. the parts' sums are added in part order in float32 (float64 if any tensor is
   float64) on the first part's device -- a fixed order, so the result is
   deterministic, and no host synchronisation (cross-device copies of 0-d tensors are
   queued on the streams);
3. each part's backend runs the update pass with that total as its norm^2
   (``nar_apply_``: one read of x, g (b), one write of x (b)), so every part derives
   the same norm, the same scale and the same skip decision from the same bits.

That is one norm pass and one update pass over all the data, in two launches per part.
A call with a single part runs the fused step of :func:`~fedopt_kernels.ops.nar_step_`
itself (``_nar.step``), whose result ``nar_apply_(nar_sq_norm(...))`` equals bitwise.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Union

import torch

from ..backends.hyper import split
from . import _dispatch, _dtensor, validation as V
from .. import defaults as D
from ._nar import NarStats, check_clip, checked_lists, step

Hyper = Union[float, torch.Tensor]


class NarGroup(NamedTuple):
    """One param group of :func:`nar_step_groups_`: its tensors (any floating dtypes and
    devices) and its own hyperparameters (``lr``/``weight_decay``: numbers ``>= 0`` or
    0-d floating tensors; ``momentum_buffers`` one zero-initialised tensor per param when
    ``momentum != 0``)."""

    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    lr: Hyper
    weight_decay: Hyper = 0.0
    momentum: float = 0.0
    momentum_buffers: Optional[Sequence[torch.Tensor]] = None


class _Part(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    params: List[torch.Tensor]
    grads: List[torch.Tensor]
    bufs: List[torch.Tensor]
    lr: Hyper
    weight_decay: Hyper
    momentum: float
    reduce_over: tuple = ()  # process groups summing this part's squares (sharded tensors, see _dtensor)


def _as_group(group, k: int) -> NarGroup:
    if isinstance(group, NarGroup):
        return group
    if isinstance(group, dict):
        unknown = set(group) - set(NarGroup._fields)
        if unknown:
            raise ValueError(f"groups[{k}] has unknown keys {sorted(unknown)}; expected {NarGroup._fields}")
        missing = {"params", "grads", "lr"} - set(group)
        if missing:
            raise ValueError(f"groups[{k}] is missing {sorted(missing)}")
        return NarGroup(**group)
    raise TypeError(f"groups[{k}] must be a NarGroup or a dict, got {type(group).__name__}")


def _check_group_hyper(value, name: str) -> Hyper:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"{name} as a tensor must be a 0-d floating tensor, got shape {tuple(value.shape)} "
                             f"and dtype {value.dtype}")
        return value
    return V.check_real(value, name, low=0.0)


def _check_one_element(t, name: str) -> Optional[torch.Tensor]:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise ValueError(f"{name} must be None or a one-element tensor")
    return t.reshape(())


def _moved(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t`` on ``device`` in ``dtype``.  A copy TO a CUDA device is queued on the stream
    (no host sync); a copy from CUDA to the CPU must block: a non-blocking one returns
    before the data has landed, and the CPU kernel reading it next would see garbage.
    A host value bound for CUDA is pinned first (from pageable memory CUDA may make
    the copy wait for the stream)."""
    t = t.to(dtype=dtype or t.dtype)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device=device, non_blocking=device.type == "cuda")


def _to(h, device: torch.device, dtype: Optional[torch.dtype] = None):
    """A tensor hyperparameter (or GradScaler flag) on ``device`` (see :func:`_moved`);
    numbers and None pass through."""
    if not isinstance(h, torch.Tensor):
        return h
    return _moved(h, device, dtype)


def _add_parts(parts: List[_Part], params, grads, momentum_buffers, lr, wd, momentum: float, name: str,
               reduce_over: tuple) -> None:
    """Append the parts of one group's tensors (cut by device and dtype) to ``parts``."""
    bufs: list = []
    fast_bufs = momentum == 0.0 or momentum_buffers is not None
    if (fast_bufs and V.lists_match_fast(params, grads, momentum_buffers if momentum != 0.0 else None)
            and params[0].device.type in ("cpu", "cuda")):
        # the common case (one dtype and device, contiguous, matching): one part
        p0 = params[0]
        bufs = list(momentum_buffers) if momentum != 0.0 else []
        parts.append(_Part(p0.device, p0.dtype, list(params), list(grads), bufs, lr, wd, momentum, reduce_over))
        return
    params = V.check_tensor_list(params, f"{name}params")
    grads = V.check_tensor_list(grads, f"{name}grads")
    V.check_untracked(params, f"{name}params", written=True)
    V.check_untracked(grads, f"{name}grads", written=False)
    V.check_untracked(momentum_buffers or [], f"{name}momentum_buffers", written=True)
    if len(grads) != len(params):
        raise ValueError(f"{name}grads has {len(grads)} tensors but {name}params has {len(params)}")
    for i, p in enumerate(params):
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}params[{i}] is on {p.device}; the step runs on cpu and cuda tensors")
        V.check_like(grads[i], p, f"{name}grads[{i}]", f"{name}params[{i}]")
    if momentum != 0.0:
        if momentum_buffers is None:
            raise ValueError(f"{name}momentum_buffers is required when momentum != 0 "
                             "(one zero-initialised tensor per param)")
        bufs = V.check_tensor_list(momentum_buffers, f"{name}momentum_buffers")
        if len(bufs) != len(params):
            raise ValueError(f"{name}momentum_buffers has {len(bufs)} tensors but {name}params has "
                             f"{len(params)}")
        for i, p in enumerate(params):
            V.check_like(bufs[i], p, f"{name}momentum_buffers[{i}]", f"{name}params[{i}]")
    index: dict = {}
    for i, p in enumerate(params):
        key = (p.device, p.dtype)
        if key not in index:
            index[key] = len(parts)
            parts.append(_Part(p.device, p.dtype, [], [], [], lr, wd, momentum, reduce_over))
        part = parts[index[key]]
        part.params.append(p)
        part.grads.append(grads[i])
        if bufs:
            part.bufs.append(bufs[i])


def _parts(groups: Sequence, plain_names: bool = False) -> List[_Part]:
    """Validate ``groups`` and cut them into parts; raises naming the argument, before
    anything is modified (``plain_names``: one group passed by ``nar_step_``, whose
    arguments are named ``params``, ``lr``... as there)."""
    if isinstance(groups, (torch.Tensor, dict)) or not isinstance(groups, Sequence):
        raise TypeError(f"groups must be a list of NarGroup (or dicts), got {type(groups).__name__}")
    parts: List[_Part] = []
    for k, raw in enumerate(groups):
        g = _as_group(raw, k)
        name = "" if plain_names else f"groups[{k}]."
        lr = _check_group_hyper(g.lr, f"{name}lr")
        wd = _check_group_hyper(g.weight_decay, f"{name}weight_decay")
        momentum = V.check_real(g.momentum, f"{name}momentum", low=0.0, high=1.0, high_open=True)
        if _dtensor.any_dtensor(g.params):  # sharded: the local tensors, by sharding
            for piece in _dtensor.split_by_sharding(V.check_tensor_list(g.params, f"{name}params"),
                                                    V.check_tensor_list(g.grads, f"{name}grads"),
                                                    list(g.momentum_buffers or []) if momentum != 0.0 else [],
                                                    prefix=name):
                bufs = piece.bufs if g.momentum_buffers is not None else None
                _add_parts(parts, piece.params, piece.grads, bufs, lr, wd, momentum, name, piece.reduce_over)
        else:
            _add_parts(parts, g.params, g.grads, g.momentum_buffers, lr, wd, momentum, name, ())
    if not parts:
        raise ValueError("groups must contain at least one tensor")
    return parts


def nar_step_groups_(
    groups: Sequence[Union[NarGroup, dict]],
    *,
    max_norm: float = D.LOCAL["max_norm"],
    mode: str = D.LOCAL["nar"],
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
    _plain_names: bool = False,
) -> NarStats:
    r"""One fused FedNAR step, in place, with ONE norm over all tensors of all ``groups``.

    With group ``k``'s tensors flattened into ``x_k``, ``g_k`` ([FedNAR]
    Algorithm 2; ``eps = 1e-6``; python_ref/fednar.py)::

        mode="co"   v_k = g_k + wd_k x_k ;  n = ||(v_1, ..., v_K)|| ;  s = min(1, A / (n + eps))
                    x_k <- x_k - lr_k s v_k
        mode="grad" n = ||(g_1, ..., g_K)|| ;  s as above ;  x_k <- x_k - lr_k (s g_k + wd_k x_k)
        mode="none" s = 1 ;  x_k <- x_k - lr_k (g_k + wd_k x_k)
        momentum_k = beta > 0:  b_k <- beta b_k + d_k ;  x_k <- x_k - lr_k b_k

    This is the authors' released recipe with a no-decay group: ``0.5 wd ||x||^2`` on the
    decayed parameters in the loss, one ``clip_grad_norm_`` over all parameters, SGD with
    per-group lr.  Tensors may mix fp16/bf16/fp32/fp64 and devices (as
    ``clip_grad_norm_`` allows): squares are accumulated in float32 (float64 for float64
    tensors) per part and the parts' sums combined in a fixed order in float32 (float64 if
    any tensor is float64) on the first tensor's device.  A non-finite norm, or a
    non-zero ``found_inf``, skips EVERY group: all params and buffers keep their bits.

    Args:
        groups: :class:`NarGroup` s (or dicts with its fields).  A tensor ``lr`` or
            ``weight_decay`` may live on any device; it is copied to each part's device
            without a host synchronisation (except a CUDA value a CPU part reads: that
            copy waits for it).
        max_norm: the clip threshold ``A > 0`` (``inf`` disables clipping).
        mode: ``"co"``, ``"grad"`` or ``"none"``.
        grad_scale, found_inf: a GradScaler's scale and inf flag (one element each, any
            device): grads are divided by the scale; a non-zero flag skips the step.
        backend: as for :func:`~fedopt_kernels.ops.nar_step_` (resolved per device).

    Returns:
        :class:`~fedopt_kernels.ops.NarStats` of the shared norm: 0-d tensors on the first
        tensor's device, float32 (float64 if any tensor is float64).
    """
    parts = _parts(groups, plain_names=_plain_names)
    max_norm, mode_id = check_clip(max_norm, mode, backend)  # once: the step below trusts them
    grad_scale = _check_one_element(grad_scale, "grad_scale")
    found_inf = _check_one_element(found_inf, "found_inf")
    if len(parts) == 1 and not parts[0].reduce_over:
        p = parts[0]
        bufs = p.bufs or None
        params, grads, fast, _ = checked_lists(p.params, p.grads, p.momentum, bufs)  # one part: not mixed
        return step(params, grads, fast, lr=_to(p.lr, p.device), weight_decay=_to(p.weight_decay, p.device),
                    max_norm=max_norm, mode_id=mode_id, momentum=p.momentum, momentum_buffers=bufs,
                    grad_scale=_to(grad_scale, p.device), found_inf=_to(found_inf, p.device), backend=backend)
    return _step_parts(parts, max_norm, mode_id, grad_scale, found_inf, backend)


def _step_parts(parts: List[_Part], max_norm: float, mode_id: int, grad_scale, found_inf,
                backend: Optional[str]) -> NarStats:
    """Steps 1-3 of the module docstring over validated parts."""
    home = parts[0].device
    stat_dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    prepared = []
    for p in parts:
        acc = V.acc_dtype(p.dtype)
        lr, wd = split(_to(p.lr, p.device, acc)), split(_to(p.weight_decay, p.device, acc))
        gs, fi = _to(grad_scale, p.device, acc), _to(found_inf, p.device)
        # resolved for every part before any pass: a backend that cannot run raises here
        norm_pass = _dispatch.kernel("nar_sq_norm", backend, p.device)
        update_pass = _dispatch.kernel("nar_apply_", backend, p.device)
        prepared.append((p, acc, lr, wd, gs, fi, norm_pass, update_pass))

    total = None
    sharded: dict = {}  # the sums of the sharded parts' squares, by process groups: reduced below
    for p, acc, lr, wd, gs, fi, norm_pass, _ in prepared:
        sq = norm_pass(p.params, p.grads, *wd, mode_id, gs)
        sq = _moved(sq, home, stat_dtype)
        if p.reduce_over:
            sharded[p.reduce_over] = sq if p.reduce_over not in sharded else sharded[p.reduce_over] + sq
        else:
            total = sq if total is None else total + sq
    for reduce_over, sq in sharded.items():  # first-seen order: the same collectives on every rank
        sq = _dtensor.all_reduce_sum_(sq.clone(), reduce_over)
        total = sq if total is None else total + sq

    result = None
    for p, acc, lr, wd, gs, fi, _, update_pass in prepared:
        sq = _moved(total, p.device, acc)
        stats = update_pass(p.params, p.grads, p.bufs, sq, *lr, *wd, max_norm, mode_id, p.momentum, gs, fi)
        if result is None and acc == stat_dtype:
            result = stats
    return NarStats(*(_moved(t, home) for t in result))
