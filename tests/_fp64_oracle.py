"""The fp64 oracle of the kernel test matrix, written from the formulas alone.

The ``reference`` backend IS ``python_ref``; comparing it with ``python_ref`` checks
nothing.  So every backend, the reference one included, is compared with this module:
a second formulation in float64 that imports nothing from ``python_ref`` or
``fedopt_kernels``.  Where the two differ in form they agree in value:

* norms are ``math.fsum`` of squares (exactly rounded sums), not a dot product;
* the FedNAR direction is written per mode as the FedNAR paper states it (eq. 3-5), not through one
  shared ``scale * ...`` expression;
* results are rounded once to the data dtype at the end, as a kernel that accumulates
  in fp32 and stores the data dtype does up to one rounding of the stored value.

Every function takes and returns CPU tensors (inputs on any device are copied).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from _asserts import acc_of as acc_dtype  # the accumulation dtype the kernels promise

EPS = 1e-6  # the clip's epsilon: s = min(1, A / (n + eps)), as torch.nn.utils.clip_grad_norm_


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64).reshape(-1)


def sq_norm(vectors: Sequence[torch.Tensor]) -> float:
    """``sum_k ||v_k||^2`` in fp64 (each tensor's sum of squares, then ``math.fsum`` over
    the tensors): ~1e-16 relative, far inside any tolerance of the fp32 kernels."""
    sums = [float((f64(v) * f64(v)).sum()) for v in vectors]
    if any(not math.isfinite(x) for x in sums):
        return sum(sums)  # inf or nan, as a plain sum gives
    return math.fsum(sums)


def nar_step(params: List[torch.Tensor], grads: List[torch.Tensor], bufs: Optional[List[torch.Tensor]], *,
             lr: float, weight_decay: float, max_norm: float, mode: str = "co", momentum: float = 0.0,
             grad_scale: Optional[float] = None, found_inf: bool = False):
    """One FedNAR step over all tensors as ONE vector (FedNAR eq. 3-5).

    co:   n = ||g + wd x||, s = min(1, A/(n+eps)), d = s (g + wd x)
    grad: n = ||g||,        s = min(1, A/(n+eps)), d = s g + wd x
    none: n = ||g|| reported (and a non-finite n skips), s = 1, d = g + wd x
    momentum mu != 0: b <- mu b + d, x <- x - lr b; else x <- x - lr d.
    A non-finite n (or found_inf) leaves every x and b unchanged.

    Returns ``(new_params, new_bufs, norm, scale, skipped)``; params and bufs in their
    dtypes (CPU), norm/scale as Python floats.
    """
    x = [f64(p) for p in params]
    g = [f64(t) for t in grads]
    if grad_scale is not None:
        g = [t / grad_scale for t in g]
    if mode == "co":
        total = sq_norm([gk + weight_decay * xk for gk, xk in zip(g, x)])
    elif mode in ("grad", "none"):
        total = sq_norm(g)
    else:
        raise ValueError(mode)
    n = math.sqrt(total) if math.isfinite(total) else total
    if mode == "none":
        s = 1.0
    else:
        s = min(1.0, max_norm / (n + EPS)) if math.isfinite(n) else float("nan")
    skipped = (not math.isfinite(n)) or found_inf
    new_x, new_b = [], []
    for k, (xk, gk) in enumerate(zip(x, g)):
        if mode == "co":
            d = s * (gk + weight_decay * xk)
        elif mode == "grad":
            d = s * gk + weight_decay * xk
        else:
            d = gk + weight_decay * xk
        if momentum != 0.0:
            b = momentum * f64(bufs[k]) + d
            nx = xk - lr * b
        else:
            b = None
            nx = xk - lr * d
        if skipped:
            nx, b = xk, (None if b is None else f64(bufs[k]))
        new_x.append(nx.to(params[k].dtype).reshape(params[k].shape))
        if b is not None:
            new_b.append(b.to(bufs[k].dtype).reshape(bufs[k].shape))
    if momentum == 0.0 and bufs:
        new_b = [b.detach().cpu().clone() for b in bufs]
    return new_x, new_b, n, s, skipped


def aggregate(X, weights, gamma=1.0):
    """``out = gamma * sum_i a_i X_i`` with the weights as given, ``q_i = ||X_i||^2``,
    ``Q = ||sum_i a_i X_i||^2`` (FedLAW eq. 3 and 8).  A client of
    weight exactly 0 adds nothing, even if its values are not finite.  fp64, CPU."""
    rows = list(X.unbind(0)) if isinstance(X, torch.Tensor) else list(X)
    a = [float(w) for w in f64(torch.as_tensor(weights))]
    N = rows[0].numel()
    total = torch.zeros(N, dtype=torch.float64)
    for ai, row in zip(a, rows):
        if ai != 0.0:
            total += ai * f64(row)
    q = torch.tensor([sq_norm([r]) for r in rows], dtype=torch.float64)
    return float(gamma) * total, q, sq_norm([total])


def robust_weights(weights, q, *, max_client_norm: Optional[float] = None):
    """The effective weights: clients with a non-finite ``q_i`` get 0 and the others are
    scaled up so the total is unchanged; norm bounding multiplies by
    ``min(1, M / (sqrt(q_i) + eps))`` afterwards (no renormalisation)."""
    w = [float(x) for x in f64(torch.as_tensor(weights))]
    bad = [not math.isfinite(float(x)) for x in q]
    kept = [0.0 if b else x for x, b in zip(w, bad)]
    ratio = sum(w) / sum(kept) if sum(kept) != 0 else 0.0
    eff = [x * ratio for x in kept]
    if max_client_norm is not None:
        eff = [e * min(1.0, max_client_norm / (math.sqrt(float(qi)) + EPS)) if not b else 0.0
               for e, qi, b in zip(eff, q, bad)]
    return torch.tensor(eff, dtype=torch.float64), torch.tensor(bad)


def weighted_sum_grads(X, weights, gamma, G):
    """``d/da_i = gamma <G, X_i>``, ``d/dgamma = <G, sum_i a_i X_i>`` for
    ``out = gamma sum_i a_i X_i`` (written from the chain rule, fp64)."""
    rows = list(X.unbind(0)) if isinstance(X, torch.Tensor) else list(X)
    Gd = f64(G)
    dots = [math.fsum((f64(r) * Gd).tolist()) for r in rows]
    a = [float(x) for x in f64(torch.as_tensor(weights))]
    return (torch.tensor([float(gamma) * d for d in dots], dtype=torch.float64),
            math.fsum(ai * d for ai, d in zip(a, dots)))
