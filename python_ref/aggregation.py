"""Weighted aggregation of client vectors with global weight shrinking (the oracle).

Source: Li et al., "Revisiting Weighted Aggregation in Federated Learning with Neural
Networks", ICML 2023 ([FedLAW] in the README's references): eq. (3) is the weighted average
``sum_i lambda_i w_i``, eq. (8) shrinks it by the global weight shrinking factor
``gamma``.  The statistics computed alongside (every ``||X_i||^2`` and ``||out||^2``) are
fedopt_kernels' own, for FedExP, ASNES and the robustness checks.

    out = gamma * sum_i a_i X_i
    q_i = ||X_i||^2                      (each client)
    Q   = ||sum_i a_i X_i||^2            (before gamma)

A client whose weight is exactly zero contributes exactly zero (its values are never
multiplied, so ``0 * nan`` cannot poison ``out``); its ``q_i`` is still reported.

Backward (FedLAW learns gamma and the weights on a proxy set), with G = dL/d out::

    dL/da_i   = gamma * <G, X_i>
    dL/dgamma = <G, sum_i a_i X_i>
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from .fednar import accurate_dot, compute_dtype

Clients = Union[torch.Tensor, Sequence[torch.Tensor]]


def as_rows(clients: Clients) -> list:
    """The clients as a list of 1-D tensors (rows of a ``[C, N]`` tensor, or as given)."""
    if isinstance(clients, torch.Tensor):
        return list(clients.unbind(0))
    return list(clients)


def aggregate(clients: Clients, weights: torch.Tensor, gamma=1.0):
    """Return ``(out, q, Q)`` in the compute dtype (fp32, or fp64 for fp64 clients)."""
    rows = as_rows(clients)
    dtype = compute_dtype(rows[0].dtype)
    a = weights.to(dtype)
    total = torch.zeros(rows[0].numel(), dtype=dtype, device=rows[0].device)
    q = []
    for i, row in enumerate(rows):
        x = row.to(dtype)
        q.append(accurate_dot(x, x))
        total = total + torch.where(a[i] != 0, a[i] * x, torch.zeros_like(x))
    q = torch.stack(q) if q else torch.zeros(0, dtype=dtype, device=weights.device)
    Q = accurate_dot(total, total)
    out = torch.as_tensor(gamma, dtype=dtype, device=total.device) * total
    return out, q, Q


def client_dots(clients: Clients, g: torch.Tensor) -> torch.Tensor:
    """``[<X_i, g> for each client i]`` in the compute dtype."""
    rows = as_rows(clients)
    dtype = compute_dtype(rows[0].dtype)
    gg = g.to(dtype)
    if not rows:
        return torch.zeros(0, dtype=dtype, device=g.device)
    return torch.stack([accurate_dot(r.to(dtype), gg) for r in rows])


def weighted_sum_backward(clients: Clients, weights: torch.Tensor, gamma, grad_out: torch.Tensor):
    """Gradients ``(dL/da, dL/dgamma)`` of ``out = gamma * sum_i a_i X_i`` ."""
    dots = client_dots(clients, grad_out)  # <G, X_i>
    dtype = dots.dtype
    gamma = torch.as_tensor(gamma, dtype=dtype, device=dots.device)
    grad_weights = gamma * dots
    grad_gamma = torch.dot(weights.to(dtype), dots)  # <G, sum_i a_i X_i>
    return grad_weights, grad_gamma


def robust_weights(weights: torch.Tensor, client_sq_norms: torch.Tensor, *, exclude_nonfinite: bool = True,
                   max_client_norm=None, eps: float = 1e-6):
    """Effective weights after excluding non-finite clients and norm bounding.

    * A client with a non-finite ``||X_i||^2`` is excluded (weight 0) and the remaining
      weights are rescaled so that their sum equals the original sum.  If every client
      is excluded all weights are 0.
    * Norm bounding scales client ``i``'s contribution by ``min(1, M / (||X_i|| + eps))``
      (the weights are *not* renormalised afterwards: bounding shrinks updates).

    Returns ``(effective_weights, excluded)``.
    """
    dtype = client_sq_norms.dtype
    w = weights.to(dtype)
    excluded = ~torch.isfinite(client_sq_norms) if exclude_nonfinite else torch.zeros_like(w, dtype=torch.bool)
    kept = torch.where(excluded, torch.zeros_like(w), w)
    total, kept_total = w.sum(), kept.sum()
    ratio = torch.where(kept_total != 0, total / kept_total, torch.zeros_like(total))
    eff = kept * ratio
    if max_client_norm is not None:
        norms = torch.sqrt(torch.where(excluded, torch.zeros_like(client_sq_norms), client_sq_norms))
        eff = eff * torch.clamp(max_client_norm / (norms + eps), max=1.0)
    return eff, excluded
