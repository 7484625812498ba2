"""The selftest's second oracle: the formulas of every op written out in float64.

The ``reference`` backend is python_ref, so comparing the kernels with it alone
cannot notice a formula that python_ref itself gets wrong.  These functions restate
the math independently -- nothing here imports python_ref or calls an op -- on CPU
float64 copies of the inputs, and the selftest compares every backend (the reference
one included) with them.

Every function takes tensors on any device in any dtype and returns CPU float64
tensors (flat) and Python floats; rounding to the data dtype is the caller's
tolerance, not done here.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence

import torch

EPS = 1e-6  # the clip's epsilon, as torch.nn.utils.clip_grad_norm_ (added to the norm, inside the division)


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64).reshape(-1)


def sq_norm(vectors: Sequence[torch.Tensor]) -> float:
    """``sum_k ||v_k||^2`` (``math.fsum`` over the tensors: rounding far below any
    tolerance of a float32 kernel); inf or nan when a value is not finite."""
    sums = [float((f64(v) ** 2).sum()) for v in vectors]
    return math.fsum(sums) if all(math.isfinite(x) for x in sums) else sum(sums)


class NarGroup64(NamedTuple):
    """One param group: tensors, its lr and weight decay, momentum and buffers."""

    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    lr: float
    weight_decay: float
    momentum: float = 0.0
    bufs: Optional[Sequence[torch.Tensor]] = None


class NarResult64(NamedTuple):
    params: List[List[torch.Tensor]]  # per group, per tensor (flat float64)
    bufs: List[List[torch.Tensor]]  # per group, per tensor; [] without momentum
    norm: float
    scale: float
    skipped: bool


def nar_step(groups: Sequence[NarGroup64], *, max_norm: float, mode: str) -> NarResult64:
    """FedNAR ([FedNAR] eq. 3-5) with ONE norm over every tensor of every group:

    co:   n = ||(g_k + wd_k x_k)_k||,  s = min(1, A / (n + eps)),  d_k = s (g_k + wd_k x_k)
    grad: n = ||(g_k)_k||,             s as above,                 d_k = s g_k + wd_k x_k
    none: n = ||(g_k)_k|| (reported),  s = 1,                      d_k = g_k + wd_k x_k
    momentum beta_k > 0: b_k <- beta_k b_k + d_k, x_k <- x_k - lr_k b_k; else x_k <- x_k - lr_k d_k.
    A non-finite n skips the step: x and b unchanged.
    """
    xs = [[f64(p) for p in gr.params] for gr in groups]
    gs = [[f64(g) for g in gr.grads] for gr in groups]
    if mode == "co":
        clipped_on = [g + gr.weight_decay * x for gr, xg, gg in zip(groups, xs, gs) for x, g in zip(xg, gg)]
    elif mode in ("grad", "none"):
        clipped_on = [g for gg in gs for g in gg]
    else:
        raise ValueError(f"mode must be co, grad or none, got {mode!r}")
    total = sq_norm(clipped_on)
    n = math.sqrt(total) if math.isfinite(total) else total
    skipped = not math.isfinite(n)
    s = 1.0 if mode == "none" else (min(1.0, max_norm / (n + EPS)) if not skipped else math.nan)
    new_x, new_b = [], []
    for gr, xg, gg in zip(groups, xs, gs):
        gx, gb = [], []
        for k, (x, g) in enumerate(zip(xg, gg)):
            wd = gr.weight_decay
            d = s * (g + wd * x) if mode == "co" else (s * g + wd * x if mode == "grad" else g + wd * x)
            if gr.momentum != 0.0:
                b = gr.momentum * f64(gr.bufs[k]) + d
                step = b
            else:
                b, step = None, d
            if skipped:
                gx.append(x)
                if b is not None:
                    gb.append(f64(gr.bufs[k]))
            else:
                gx.append(x - gr.lr * step)
                if b is not None:
                    gb.append(b)
        new_x.append(gx)
        new_b.append(gb)
    return NarResult64(new_x, new_b, n, s, skipped)


class AggregateResult64(NamedTuple):
    out: torch.Tensor
    client_sq_norms: torch.Tensor
    sq_norm: float


def aggregate(rows: Sequence[torch.Tensor], weights: Sequence[float], gamma: float) -> AggregateResult64:
    """[FedLAW] eq. 3, 8: ``out = gamma sum_i a_i X_i``, ``q_i = ||X_i||^2``,
    ``Q = ||sum_i a_i X_i||^2`` (before gamma).  A weight of exactly 0 adds nothing,
    even for a client holding NaN (that is how an excluded client is left out)."""
    N = rows[0].numel()
    total = torch.zeros(N, dtype=torch.float64)
    for a, row in zip(weights, rows):
        if a != 0.0:
            total += float(a) * f64(row)
    q = torch.tensor([sq_norm([r]) for r in rows], dtype=torch.float64)
    return AggregateResult64(gamma * total, q, sq_norm([total]))


def robust_weights(weights: Sequence[float], q: torch.Tensor) -> List[float]:
    """The aggregation's NaN guard: clients with a non-finite ``||X_i||^2`` get weight 0
    and the others are rescaled so the total stays the same."""
    bad = [not math.isfinite(float(x)) for x in q]
    kept = [0.0 if b else float(w) for w, b in zip(weights, bad)]
    kept_total = sum(kept)
    ratio = sum(float(w) for w in weights) / kept_total if kept_total != 0 else 0.0
    return [k * ratio for k in kept]


def client_dots(rows: Sequence[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
    """``[<X_i, g>]`` (a product and a sum: float64 ``torch.dot`` goes through BLAS,
    which on a busy CPU costs milliseconds per call)."""
    gg = f64(g)
    return torch.tensor([float((f64(r) * gg).sum()) for r in rows], dtype=torch.float64)


def weighted_sum_grads(rows: Sequence[torch.Tensor], weights: Sequence[float], gamma: float, G: torch.Tensor):
    """``dL/da_i = gamma <G, X_i>``, ``dL/dgamma = <G, sum_i a_i X_i>``."""
    dots = client_dots(rows, G)
    grad_w = gamma * dots
    grad_gamma = float(sum(float(a) * float(d) for a, d in zip(weights, dots)))
    return grad_w, grad_gamma


def server_update(rule: str, x, d, m, v, *, lr: float, gamma: float, beta1: float, beta2: float, tau: float,
                  nesterov: bool):
    """One element-wise server step on flat float64 vectors (Reddi et al. Algorithm 2,
    [FedLAW] eq. 4); returns ``(x, m, v)`` (``m``/``v`` None where the rule has none).

    sgd:      x <- gamma (x - lr D)
    momentum: b <- beta1 b + D ; x <- x - lr b   (nesterov: x <- x - lr (beta1 b + D))
    adagrad:  m <- beta1 m + (1 - beta1) D ; v <- v + D^2
    adam:     m as adagrad ;                 v <- beta2 v + (1 - beta2) D^2
    yogi:     m as adagrad ;                 v <- v - (1 - beta2) D^2 sign(v - D^2)
              (adaptive rules) x <- x - lr m / (sqrt(v) + tau)
    """
    x, d = f64(x), f64(d)
    if rule == "sgd":
        return gamma * (x - lr * d), None, None
    m = f64(m)
    if rule == "momentum":
        m = beta1 * m + d
        return x - lr * (beta1 * m + d if nesterov else m), m, None
    v = f64(v)
    m = beta1 * m + (1 - beta1) * d
    if rule == "adagrad":
        v = v + d * d
    elif rule == "adam":
        v = beta2 * v + (1 - beta2) * d * d
    elif rule == "yogi":
        v = v - (1 - beta2) * d * d * torch.sign(v - d * d)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    return x - lr * m / (torch.sqrt(v) + tau), m, v
