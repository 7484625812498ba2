"""Byzantine-robust aggregation rules (the oracle): float64, written from the papers'
definitions with no shortcut the kernels take (no Gram matrix, no coefficient form of an
iterate, no sorting network): distances from the differences themselves, sorts and sums
in float64 over the values as given.

Sources (the papers themselves are not in /work/shared/papers; the definitions are the
published ones):

* [Yin18] Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates", ICML 2018 -- coordinate-wise median and
  coordinate-wise beta-trimmed mean (Def. 1, 2): for each coordinate, remove the
  ``k = floor(beta m)`` largest and ``k`` smallest of the ``m`` values and average the
  remaining ``m - 2k``.  Unweighted in the paper, so unweighted here.  The median of an
  even number of values is the mean of the two middle ones.
* [Blanchard17] Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with
  Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017 -- Krum: the score of
  client ``i`` is the sum of its squared distances to its ``n - f - 2`` closest other
  clients; Krum picks the lowest score (needs ``n > 2f + 2``).  Multi-Krum averages the
  ``m`` clients with the lowest scores.
* [ElMhamdi18] El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed
  Learning in Byzantium", ICML 2018 -- Bulyan (needs ``n >= 4f + 3``): select
  ``theta = n - 2f`` clients by applying Krum repeatedly to the clients not yet selected,
  then per coordinate average the ``beta = theta - 2f`` selected values closest to the
  coordinate-wise median of the selected set.
* [Pillutla22] Pillutla, Kakade, Harchaoui, "Robust Aggregation for Federated Learning"
  (RFA), IEEE TSP 2022 -- the geometric median ``argmin_v sum_i alpha_i ||v - x_i||`` by
  smoothed Weiszfeld iterations ``beta_i = alpha_i / max(nu, ||v - x_i||)``,
  ``v = sum_i beta_i x_i / sum_i beta_i``, started at the weighted mean.
* [Karimireddy21] Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
  Optimization", ICML 2021 -- centered clipping:
  ``v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||)``, repeated ``L`` times
  from a reference point ``v_0`` (the previous aggregate, or zero).
* [Sun19] Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor Federated Learning?"
  2019 -- norm bounding: each update scaled to ``x_i min(1, M / ||x_i||)`` before the
  weighted mean; ``M`` fixed or (a multiple of) the median of the clients' norms.

fedopt_kernels' conventions (not the papers'), stated once here and kept by every backend:

* A client holding NaN/Inf is left out.  For Krum, Multi-Krum and Bulyan it counts as one
  of the ``f`` faulty clients: with ``e`` such clients the rule runs on the
  ``n' = C - e`` others with ``f' = f - e``, which keeps the number of neighbours
  ``C - f - 2`` of every score (capped at ``n' - 1`` when ``e > f``; the bound is then
  not met and the result says so).
* Ties (equal scores, equal distances) go to the lower client index / the lower value.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch


def _f64(X) -> torch.Tensor:
    if isinstance(X, torch.Tensor):
        return X.double()
    return torch.stack([x.double() for x in X])


def finite_clients(X) -> torch.Tensor:
    """``[C]`` bool: client ``i`` holds no NaN/Inf."""
    X = _f64(X)
    return torch.isfinite(X).all(dim=1) if X.shape[1] else torch.ones(X.shape[0], dtype=torch.bool)


def _kept(X, kept) -> torch.Tensor:
    return finite_clients(X) if kept is None else kept


def _sorted_kept(X, kept) -> torch.Tensor:
    """The kept clients' values, each column sorted ascending (``[m, N]``, float64)."""
    X = _f64(X)
    return torch.sort(X[_kept(X, kept)], dim=0).values


def trimmed_mean(X, beta: float, kept: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[Yin18] coordinate-wise beta-trimmed mean over the kept clients (zeros if none)."""
    v = _sorted_kept(X, kept)
    m = v.shape[0]
    if m == 0:
        return torch.zeros(v.shape[1], dtype=torch.float64)
    k = math.floor(beta * m)
    return v[k:m - k].sum(dim=0) / (m - 2 * k)


def _median_sorted(v: torch.Tensor) -> torch.Tensor:
    m = v.shape[0]
    return v[(m - 1) // 2] if m % 2 else (v[m // 2 - 1] + v[m // 2]) / 2


def coordinate_median(X, kept: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[Yin18] coordinate-wise median over the kept clients (mean of the two middle
    values for an even count; zeros if none)."""
    v = _sorted_kept(X, kept)
    if v.shape[0] == 0:
        return torch.zeros(v.shape[1], dtype=torch.float64)
    return _median_sorted(v)


def sq_distances(X) -> torch.Tensor:
    """``[C, C]`` ``||x_i - x_j||^2`` computed directly from the differences (a
    ``[C, C, N]`` intermediate: the oracle may, the kernels do not)."""
    X = _f64(X)
    return ((X[:, None, :] - X[None, :, :]) ** 2).sum(dim=2)


def krum_scores(D: torch.Tensor, candidates: Sequence[int], neighbours: int) -> dict:
    """[Blanchard17] score of each candidate: the sum of its ``neighbours`` smallest
    squared distances to the other candidates."""
    scores = {}
    for i in candidates:
        d = sorted(float(D[i, j]) for j in candidates if j != i)
        scores[i] = math.fsum(d[:max(0, min(neighbours, len(d)))])
    return scores


def _by_score(scores: dict) -> List[int]:
    return sorted(scores, key=lambda i: (scores[i], i))  # ties: the lower index


def _plain_mean(X: torch.Tensor, chosen: Sequence[int], weights=None) -> torch.Tensor:
    if not chosen:
        return torch.zeros(X.shape[1], dtype=torch.float64)
    if weights is None:
        return X[list(chosen)].sum(dim=0) / len(chosen)
    w = torch.as_tensor([float(weights[i]) for i in chosen], dtype=torch.float64)
    return (w[:, None] * X[list(chosen)]).sum(dim=0) / w.sum()


def multi_krum(X, f: int, m: int, weights=None, kept: Optional[torch.Tensor] = None):
    """[Blanchard17] the ``m`` kept clients with the lowest Krum scores (``n - f - 2``
    neighbours, see the module's convention) and their mean (weighted by ``weights``
    renormalised over the selected clients when given, else plain as in the paper).
    ``m = 1`` is Krum.  Returns ``(out, selected_indices)``."""
    X = _f64(X)
    C = X.shape[0]
    keep = _kept(X, kept)
    cand = [i for i in range(C) if keep[i]]
    scores = krum_scores(sq_distances(X), cand, C - f - 2)
    chosen = sorted(_by_score(scores)[:m])
    return _plain_mean(X, chosen, weights), chosen


def bulyan_selection(X, f: int, kept: Optional[torch.Tensor] = None) -> List[int]:
    """[ElMhamdi18] ``theta = n - 2f`` clients, each picked by Krum over the clients not
    yet picked (the remaining set has ``C - t`` members at step ``t``, faulty ones
    included, so Krum there uses ``C - t - f - 2`` neighbours)."""
    X = _f64(X)
    C = X.shape[0]
    keep = _kept(X, kept)
    D = sq_distances(X)
    remaining = [i for i in range(C) if keep[i]]
    chosen = []
    for t in range(C - 2 * f):
        if not remaining:
            break
        best = _by_score(krum_scores(D, remaining, C - t - f - 2))[0]
        chosen.append(best)
        remaining.remove(best)
    return sorted(chosen)


def bulyan(X, f: int, kept: Optional[torch.Tensor] = None):
    """[ElMhamdi18] Bulyan: per coordinate the mean of the ``beta = theta - 2f`` selected
    values closest to the selected set's median (ties: the lower value).  Returns
    ``(out, selected_indices)``."""
    X = _f64(X)
    chosen = bulyan_selection(X, f, kept)
    theta, N = len(chosen), X.shape[1]
    if theta == 0:
        return torch.zeros(N, dtype=torch.float64), chosen
    beta = max(1, theta - 2 * f)
    v = torch.sort(X[chosen], dim=0).values
    # per column, the values ordered by distance to the median, ties by value (v is
    # sorted, so a stable sort of the distances keeps the lower value first)
    order = torch.sort((v - _median_sorted(v)).abs(), dim=0, stable=True).indices
    out = torch.gather(v, 0, order)[:beta].sum(dim=0) / beta
    return out, chosen


def geometric_median(X, weights=None, *, nu: float = 1e-6, tol: float = 1e-5, max_iter: int = 4,
                     kept: Optional[torch.Tensor] = None):
    """[Pillutla22] smoothed Weiszfeld from the weighted mean; stops after an iteration
    whose objective ``g(v) = sum_i alpha_i ||v - x_i||`` changed by at most
    ``tol * g(v_new)``, or after ``max_iter`` iterations.  ``alpha`` = ``weights``
    (uniform if None) normalised over the kept clients.  Returns ``(v, iterations)``."""
    X = _f64(X)
    C = X.shape[0]
    keep = _kept(X, kept)
    a = torch.ones(C, dtype=torch.float64) if weights is None else torch.as_tensor(
        [float(w) for w in weights], dtype=torch.float64)
    a = torch.where(keep, a, torch.zeros_like(a))
    if a.sum() == 0:
        return torch.zeros(X.shape[1], dtype=torch.float64), 0
    a = a / a.sum()
    rows = [i for i in range(C) if keep[i]]
    v = sum(float(a[i]) * X[i] for i in rows)

    def dist(v, i):
        return float(torch.linalg.vector_norm(v - X[i]))

    def objective(v):
        return math.fsum(float(a[i]) * dist(v, i) for i in rows)

    g = objective(v)
    it = 0
    for it in range(1, max_iter + 1):
        b = {i: float(a[i]) / max(nu, dist(v, i)) for i in rows}
        total = math.fsum(b.values())
        v = sum(b[i] / total * X[i] for i in rows)
        g_new = objective(v)
        done = abs(g - g_new) <= tol * g_new
        g = g_new
        if done:
            break
    return v, it


def centered_clip(X, tau: float, iterations: int = 1, reference=None, kept: Optional[torch.Tensor] = None):
    """[Karimireddy21] ``iterations`` steps of centered clipping from ``reference`` (zeros
    if None) over the kept clients (``n`` = their number)."""
    X = _f64(X)
    keep = _kept(X, kept)
    rows = [i for i in range(X.shape[0]) if keep[i]]
    v = torch.zeros(X.shape[1], dtype=torch.float64) if reference is None else reference.double().clone()
    if not rows:
        return v
    for _ in range(iterations):
        step = torch.zeros_like(v)
        for i in rows:
            d = X[i] - v
            norm = float(torch.linalg.vector_norm(d))
            step = step + d * (1.0 if norm <= tau else tau / norm)
        v = v + step / len(rows)
    return v


def norm_bounded_mean(X, weights=None, *, radius: Optional[float] = None, median_factor: Optional[float] = None,
                      eps: float = 1e-6, kept: Optional[torch.Tensor] = None):
    """[Sun19] ``sum_i w_i min(1, M / (||x_i|| + eps)) x_i`` over the kept clients, ``w``
    renormalised to the original total over them (fedopt_kernels' exclusion rule), and
    ``M = radius`` or ``M = median_factor * median_i ||x_i||`` (kept clients; mean of the
    two middle norms for an even count).  Returns ``(out, M)``."""
    X = _f64(X)
    C = X.shape[0]
    keep = _kept(X, kept)
    w = torch.ones(C, dtype=torch.float64) / C if weights is None else torch.as_tensor(
        [float(v) for v in weights], dtype=torch.float64)
    total = w.sum()
    w = torch.where(keep, w, torch.zeros_like(w))
    if w.sum() == 0:
        return torch.zeros(X.shape[1], dtype=torch.float64), float("nan")
    w = w * (total / w.sum())
    norms = [float(torch.linalg.vector_norm(X[i])) if keep[i] else 0.0 for i in range(C)]
    if radius is None:
        ks = sorted(norms[i] for i in range(C) if keep[i])
        m = len(ks)
        med = ks[(m - 1) // 2] if m % 2 else (ks[m // 2 - 1] + ks[m // 2]) / 2
        radius = median_factor * med
    out = torch.zeros(X.shape[1], dtype=torch.float64)
    for i in range(C):
        if keep[i]:
            out = out + float(w[i]) * min(1.0, radius / (norms[i] + eps)) * X[i]
    return out, radius
