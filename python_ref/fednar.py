"""FedNAR local step, written as literally as possible (the oracle).

Source: Li et al., "FedNAR: Federated Optimization with Normalized Annealing
Regularization", NeurIPS 2023 ([FedNAR] in the README's references), Algorithm 2 with the
learning-rate and weight-decay functions of eq. (3) and (4); the gradient-clipping
baseline is eq. (5).  Notation: ``l`` is the local lr,
``wd`` the weight decay in the PyTorch-SGD sense (the paper's ``u_t = l_t * wd``),
``A`` the max norm and ``eps = 1e-6`` as in ``torch.nn.utils.clip_grad_norm_``.

Mode ``"co"`` (FedNAR, eq. 3-4)::

    v = g + wd * x                 # g + (u_t / l_t) x
    n = ||v||_2                    # over ALL tensors of the group, flattened together
    s = min(1, A / (n + eps))
    x <- x - l * s * v             # = (1 - s u_t) x - (s l_t) g

Mode ``"grad"`` (gradient clipping, eq. 5; decay outside the clip)::

    n = ||g||_2 ;  s = min(1, A / (n + eps))
    x <- x - l * (s * g + wd * x)  # = (1 - l wd) x - l s g

Mode ``"none"`` (plain SGD with weight decay): ``n = ||g||_2`` is still computed (it is
reported and detects non-finite gradients) but ``s = 1``.

In every mode the step direction is ``d`` (``s * v`` for co, ``s * g + wd * x``
otherwise).  Optional heavy-ball momentum (not in the paper, PyTorch-SGD form with no
dampening): ``b <- beta * b + d ; x <- x - l * b``.

Mixed precision: an optional ``grad_scale`` (the loss scale of
``torch.amp.GradScaler``) divides ``g`` before anything else, and a non-zero
``found_inf`` skips the step, so that the norm is the norm of the *unscaled*
gradient.

Skipping: if ``found_inf`` is set or ``n`` is not finite, nothing is updated (params and
momentum buffers keep their exact bits) and ``skipped`` is True.

Everything here is computed in float32 (float64 for float64 tensors) and cast back to
the tensors' dtype at the end, which is also what the fused kernels do.

Several param groups (:func:`nar_step_groups_`, the default of ``FedNAR``) share ONE
norm, as ``clip_grad_norm_(model.parameters())`` in the released recipe: with group
``k``'s own ``l_k``, ``wd_k``::

    v_k = g_k + wd_k * x_k ;  n = ||(v_1, ..., v_K)||_2 ;  s = min(1, A / (n + eps))
    x_k <- x_k - l_k * s * v_k

(a no-decay group is ``wd_k = 0`` inside the same norm).  :func:`nar_sq_norm` and
:func:`nar_apply_` are the two halves of a step that such a shared norm is built from.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

EPS = 1e-6
MODES = ("co", "grad", "none")


class NarStats(NamedTuple):
    """Statistics of one FedNAR step, as 0-d tensors on the params' device."""

    norm: torch.Tensor  # the norm that was clipped on (||v|| for co, ||g|| otherwise)
    scale: torch.Tensor  # s = min(1, A / (norm + eps)); 1 in mode "none"
    skipped: torch.Tensor  # bool: the step was not applied


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic precision used for a tensor dtype: float64 stays, the rest is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accurate_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``<a, b>`` summed in float64 and returned in ``a``'s dtype.

    The oracle must be more accurate than the kernels it judges: a plain float32 sum of
    ~1e7 squares (a ResNet-18 gradient) drifts by ~1e-4 relative on CPU, far more than
    any fused kernel's fixed-order sum.
    """
    return torch.dot(a.reshape(-1).double(), b.reshape(-1).double()).to(a.dtype)


def nar_update(
    x: torch.Tensor,
    g: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    max_norm: float,
    mode: str = "co",
    momentum: float = 0.0,
    b: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
):
    """One FedNAR step on a single flat vector (no in-place updates).

    ``x``, ``g`` (and ``b`` when momentum is used) are 1-D tensors in the compute
    dtype.  Returns ``(x_new, b_new, NarStats)``; on a skip ``x_new is``-equal in value
    to ``x`` and ``b_new`` to ``b``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    wd = torch.as_tensor(weight_decay, dtype=x.dtype, device=x.device)
    if grad_scale is not None:
        g = g / grad_scale.to(x.dtype)
    # co, eq. (3)-(4): clip the sum of gradient and decay; grad, eq. (5): the gradient only
    v = g + wd * x if mode == "co" else g
    norm = torch.sqrt(accurate_dot(v, v))
    return _update_with_norm(x, g, b, norm, lr=lr, weight_decay=wd, max_norm=max_norm, mode=mode,
                             momentum=momentum, found_inf=found_inf)


def _clip_scale(norm: torch.Tensor, max_norm: float, mode: str) -> torch.Tensor:
    """``s = min(1, A / (n + eps))`` in modes co/grad, 1 in mode none."""
    if mode == "none":
        return torch.ones_like(norm)
    return torch.clamp(max_norm / (norm + EPS), max=1.0)


def _update_with_norm(x, g, b, norm, *, lr, weight_decay, max_norm, mode, momentum, found_inf):
    """The update of :func:`nar_update` once the norm ``n`` is known (``g`` unscaled
    already): ``d = s v`` (co) or ``s g + wd x``; ``x - lr d`` or through the momentum
    buffer; nothing changes when ``n`` is not finite or ``found_inf`` is set."""
    lr = torch.as_tensor(lr, dtype=x.dtype, device=x.device)
    wd = torch.as_tensor(weight_decay, dtype=x.dtype, device=x.device)
    scale = _clip_scale(norm, max_norm, mode)
    d = scale * (g + wd * x) if mode == "co" else scale * g + wd * x
    if momentum != 0.0:
        b_new = momentum * b + d
        x_new = x - lr * b_new
    else:
        b_new = b
        x_new = x - lr * d
    skipped = ~torch.isfinite(norm)
    if found_inf is not None:
        skipped = skipped | (found_inf.to(norm.device) != 0)
    x_new = torch.where(skipped, x, x_new)
    if b_new is not None and b is not None:
        b_new = torch.where(skipped, b, b_new)
    return x_new, b_new, NarStats(norm, scale, skipped)


def nar_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    lr,
    weight_decay,
    max_norm: float,
    mode: str = "co",
    momentum: float = 0.0,
    momentum_buffers: Optional[Sequence[torch.Tensor]] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> NarStats:
    """In-place FedNAR step over a list of tensors taken together as ONE vector.

    The tensors are flattened and concatenated (in list order), :func:`nar_update` is
    applied to that vector, and the result is written back into ``params`` (and
    ``momentum_buffers``).  ``lr`` and ``weight_decay`` may be floats or 0-d tensors.
    """
    params, grads = list(params), list(grads)
    if not params:
        raise ValueError("params must contain at least one tensor")
    dtype = compute_dtype(params[0].dtype)
    x = torch.cat([p.reshape(-1).to(dtype) for p in params])
    g = torch.cat([t.reshape(-1).to(dtype) for t in grads])
    use_momentum = momentum != 0.0
    b = None
    if use_momentum:
        b = torch.cat([t.reshape(-1).to(dtype) for t in momentum_buffers])
    x_new, b_new, stats = nar_update(
        x, g, lr=lr, weight_decay=weight_decay, max_norm=max_norm, mode=mode,
        momentum=momentum, b=b, grad_scale=grad_scale, found_inf=found_inf,
    )
    _scatter_(params, x_new)
    if use_momentum:
        _scatter_(momentum_buffers, b_new)
    return stats


def nar_sq_norm(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    weight_decay,
    mode: str = "co",
    grad_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``sum_j v_j^2`` over all elements of the tensors of one (dtype, device) part of a
    step, ``v = g / grad_scale + wd x`` in mode co and ``g / grad_scale`` otherwise:
    the first half of :func:`nar_step_` for a norm shared with other calls.  Summed in
    float64 and returned as a 0-d tensor of the compute dtype."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    dtype = compute_dtype(params[0].dtype) if params else torch.float32
    return _sq_sum_f64(params, grads, weight_decay, mode, grad_scale).to(dtype)


def _sq_sum_f64(params, grads, weight_decay, mode, grad_scale) -> torch.Tensor:
    """``sum v^2`` in float64 (one dot over all ``v`` concatenated, as
    :func:`accurate_dot` in :func:`nar_update`), each ``v`` computed in its tensor's
    compute dtype."""
    device = params[0].device if params else torch.device("cpu")
    vs = [torch.zeros(0, dtype=torch.float64, device=device)]
    for x, g in zip(params, grads):
        dtype = compute_dtype(x.dtype)
        x, g = x.reshape(-1).to(dtype), g.reshape(-1).to(dtype)
        if grad_scale is not None:
            g = g / grad_scale.to(device=x.device, dtype=dtype)
        v = g + torch.as_tensor(weight_decay, dtype=dtype, device=x.device) * x if mode == "co" else g
        vs.append(v.double().to(device))
    v = torch.cat(vs)
    return torch.dot(v, v)


def nar_apply_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    sq_norm: torch.Tensor,
    *,
    lr,
    weight_decay,
    max_norm: float,
    mode: str = "co",
    momentum: float = 0.0,
    momentum_buffers: Optional[Sequence[torch.Tensor]] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> NarStats:
    """The second half of :func:`nar_step_`: the update with the norm taken from
    ``sq_norm`` (``n = sqrt(sq_norm)``, the squared norm of the WHOLE clipped vector,
    possibly summed over other calls) instead of from these tensors alone."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    params, grads = list(params), list(grads)
    dtype = compute_dtype(params[0].dtype) if params else sq_norm.dtype
    device = params[0].device if params else sq_norm.device
    norm = torch.sqrt(sq_norm.to(device=device, dtype=dtype))
    hyper = dict(lr=lr, weight_decay=weight_decay, max_norm=max_norm, mode=mode, momentum=momentum,
                 found_inf=found_inf)
    empty = torch.zeros(0, dtype=dtype, device=device)
    # the stats (independent of momentum), also when there is no param
    stats = _update_with_norm(empty, empty, None, norm, **{**hyper, "momentum": 0.0})[2]
    for i, (p, t) in enumerate(zip(params, grads)):
        x, g = p.reshape(-1).to(dtype), t.reshape(-1).to(dtype)
        if grad_scale is not None:
            g = g / grad_scale.to(device=device, dtype=dtype)
        b = momentum_buffers[i].reshape(-1).to(dtype) if momentum != 0.0 else None
        x_new, b_new, stats = _update_with_norm(x, g, b, norm, **hyper)
        p.copy_(x_new.view_as(p))
        if b is not None:
            momentum_buffers[i].copy_(b_new.view_as(p))
    return stats


def nar_step_groups_(
    groups: Sequence[dict],
    *,
    max_norm: float,
    mode: str = "co",
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> NarStats:
    """One FedNAR step with ONE norm over several param groups.

    Group ``k`` is a dict with ``params``, ``grads``, ``lr``, ``weight_decay`` and
    optionally ``momentum`` / ``momentum_buffers``; its tensors may have any floating
    dtype and device.  All tensors of all groups form one vector::

        v_k = g_k + wd_k x_k                  (mode co; g_k in modes grad/none)
        n   = ||(v_1, ..., v_K)||_2           one norm over everything
        s   = min(1, A / (n + eps))           one scale (1 in mode none)
        x_k <- x_k - lr_k s v_k               (co; grad/none: x_k - lr_k (s g_k + wd_k x_k))

    and a non-finite ``n`` (or ``found_inf``) skips every group.  This is
    ``clip_grad_norm_(all params, A)`` followed by SGD with per-group lr in the released
    recipe.  Squares are summed in float64; the norm and scale are returned in float32,
    or float64 if any tensor is float64.
    """
    tensors = [t for grp in groups for t in grp["params"]]
    stat_dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    device = tensors[0].device if tensors else torch.device("cpu")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for grp in groups:
        sq = sq + _sq_sum_f64(list(grp["params"]), list(grp["grads"]), grp["weight_decay"], mode, grad_scale)
    sq = sq.to(stat_dtype)
    stats = None
    for grp in groups:
        for i, (x, g) in enumerate(zip(grp["params"], grp["grads"])):
            bufs = grp.get("momentum_buffers")
            st = nar_apply_([x], [g], sq.to(x.device), lr=grp["lr"], weight_decay=grp["weight_decay"],
                            max_norm=max_norm, mode=mode, momentum=grp.get("momentum", 0.0),
                            momentum_buffers=None if bufs is None else [bufs[i]], grad_scale=grad_scale,
                            found_inf=found_inf)
            if stats is None:
                stats = st
    if stats is None:
        return nar_apply_([], [], sq, lr=0.0, weight_decay=0.0, max_norm=max_norm, mode=mode,
                          found_inf=found_inf)
    norm = torch.sqrt(sq.to(device))
    return NarStats(norm, _clip_scale(norm, max_norm, mode), stats.skipped.to(device))


def nar_step_batched_(
    X: torch.Tensor,
    G: torch.Tensor,
    *,
    lr,
    weight_decay,
    max_norm: float,
    mode: str = "co",
    momentum: float = 0.0,
    momentum_buffers: Optional[torch.Tensor] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> NarStats:
    """Row-wise FedNAR: row ``i`` of the ``[C, N]`` tensors is client ``i``'s model.

    Each row has its own norm, scale and skip flag (stats of shape ``[C]``); ``lr`` and
    ``weight_decay`` may be floats, 0-d tensors or ``[C]`` tensors.  Literally a loop of
    :func:`nar_update` over the rows.
    """
    C = X.shape[0]
    dtype = compute_dtype(X.dtype)

    def row_value(h, i):
        if isinstance(h, torch.Tensor) and h.dim() == 1:
            return h[i]
        return h

    norms, scales, skips = [], [], []
    for i in range(C):
        b = momentum_buffers[i].to(dtype) if momentum != 0.0 else None
        x_new, b_new, st = nar_update(
            X[i].to(dtype), G[i].to(dtype), lr=row_value(lr, i),
            weight_decay=row_value(weight_decay, i), max_norm=max_norm, mode=mode,
            momentum=momentum, b=b, grad_scale=grad_scale, found_inf=found_inf,
        )
        X[i].copy_(x_new)
        if momentum != 0.0:
            momentum_buffers[i].copy_(b_new)
        norms.append(st.norm)
        scales.append(st.scale)
        skips.append(st.skipped)
    if C == 0:
        empty = X.new_empty((0,), dtype=dtype)
        return NarStats(empty, empty.clone(), torch.zeros(0, dtype=torch.bool, device=X.device))
    return NarStats(torch.stack(norms), torch.stack(scales), torch.stack(skips))


def _scatter_(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (casting to their dtype)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
