r"""Byzantine-robust aggregation of client vectors: coordinate-wise median and trimmed
mean, Krum, Multi-Krum, Bulyan, the geometric median (RFA), centered clipping and norm
bounding.  Definitions and sources: python_ref/robust.py (the float64 oracle).

How each is computed (``C`` clients of ``N`` values, ``m`` of them kept):

* **median, trimmed mean** -- one backend op, ``coordinate_select``
  (:mod:`fedopt_kernels.backends`): one pass over the clients per coordinate,
  the ``m`` kept values sorted in registers / local memory in the acc dtype (fp32 for
  fp16/bf16 data), reduced in a fixed order (deterministic).  Unweighted, as [Yin18]
  defines them.
* **Krum, Multi-Krum, Bulyan's selection** -- from the clients' Gram matrix
  ``G_ij = <x_i, x_j>`` (:func:`client_gram`: one pass over the data, ``[C, C]`` in
  float64 -- on the CPU backend each block of 256 columns summed in the acc dtype, the
  blocks in float64, ``fedopt_C::client_gram``), pairwise squared distances
  ``G_ii + G_jj - 2 G_ij`` on that ``[C, C]`` matrix (never a ``[C, C, N]``
  intermediate), the selection as ``[C]``-sized tensor ops on the device, then ONE pass
  of the fused weighted ``aggregate`` over the selected clients (Bulyan:
  ``coordinate_select`` in its closest-to-median mode).
* **geometric median, centered clipping** -- the iterate is kept as coefficients over
  the clients, ``v = a r + sum_j c_j x_j`` (``r`` the reference point), so every
  distance ``||v - x_i||^2`` is a quadratic form in ``G`` (and ``<x_i, r>``,
  ``||r||^2``, taken in the same Gram pass): the iterations are ``[C]``-sized, no pass
  over the data and no host sync inside them (a converged iteration freezes the
  coefficients on the device instead of leaving a Python loop); then ONE ``aggregate``
  pass writes ``v``.
* **norm bounding** -- ``aggregate``'s own two-pass form: the first pass gives every
  ``||x_i||^2``, the radius and the factors are computed on the device, and the second
  pass (skipped on the device when no factor changed a weight) writes the result.

Clients given as :class:`ClientPieces` (a Flower reply's per-layer arrays, subtracted
from the global model) are read in place by the CPU backend -- ``coordinate_select``,
``client_gram`` and ``aggregate`` all have a pieces form there -- and stacked into
``[C, N]`` rows once for the other backends (:func:`reads_pieces`).

Clients holding NaN/Inf are left out, as :func:`~fedopt_kernels.ops.aggregate` leaves
them out; for Krum, Multi-Krum and Bulyan they count among the ``f`` faulty clients
(python_ref/robust.py states the rule).  Parameters are checked on the host against
``C`` before anything is read or written; what depends on the data (how many clients
were left out) is decided on the device, and :attr:`RobustStats.bound_met` says whether
the rule's bound still held.  No host sync anywhere (the CPU backend reads its small
flags on the host, which is the host).  Every kernel is reached through the ops layer's
one dispatcher, so under ``torch.compile`` (``fullgraph=True``) a rule is one graph
whose kernels are the routed ops ``fedopt_C::routed_coordinate_select``,
``routed_client_gram`` and ``routed_aggregate``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import backends
from ..backends.gram import GRAM_ACC_OPS, GRAM_BATCH, GRAM_BLOCK, GRAM_CHUNK  # noqa: F401 - the bounds' constants
from . import _dispatch, validation as V
from .aggregate import aggregate_runner, check_clients, check_out, check_weights
from .client_pieces import ClientPieces

__all__ = ["RobustStats", "client_gram", "reads_pieces", "coordinate_median", "trimmed_mean", "krum", "multi_krum",
           "bulyan", "geometric_median", "centered_clip", "norm_bounded_mean"]

# coordinate_select's modes (the backend contract: fedopt_kernels.backends)
MODE_TRIM = 0  # mean of the sorted values [k, m - k)
MODE_CLOSEST = 1  # mean of the `count` values closest to the median
NORM_EPS = 1e-6  # norm-bound epsilon, as aggregate's max_client_norm


class RobustStats(NamedTuple):
    """What a robust aggregation did, as tensors on the data's device (no host sync).

    * ``excluded`` ``[C]`` bool: clients left out because they hold NaN/Inf.
    * ``selected`` ``[C]`` bool: clients whose values entered the result (Krum's,
      Multi-Krum's, Bulyan's selection; every kept client for the other rules).
    * ``weights`` ``[C]`` float64 or None: the weights of the final weighted sum
      (Krum / Multi-Krum / geometric median / centered clipping: the coefficients of
      the clients in the result; norm bounding: the bounded weights); None for the
      coordinate-wise rules.
    * ``bound_met``: 0-d bool, the rule's requirement held after the exclusions
      (Krum: ``e <= f`` non-finite clients; Bulyan likewise; the others: at least one
      client kept).
    * ``iterations``: 0-d int64, iterations run (geometric median, centered clipping),
      else 0.
    * ``all_excluded``: 0-d bool, every client was left out (the result is zeros, or
      the reference point for centered clipping).
    * ``client_sq_norms``: ``[C]`` float64 ``||x_i||^2`` where the rule has them
      anyway (the Gram matrix's diagonal: Krum, Multi-Krum, Bulyan, geometric median,
      centered clipping; norm bounding: its first pass's, in the acc dtype), else None
      (the coordinate-wise rules).  NaN/Inf for a client left out for holding them.
    """

    excluded: torch.Tensor
    selected: torch.Tensor
    weights: Optional[torch.Tensor]
    bound_met: torch.Tensor
    iterations: torch.Tensor
    all_excluded: torch.Tensor
    client_sq_norms: Optional[torch.Tensor] = None


# ----------------------------------------------------------------------------- common

def _check_int(value, name: str, *, low: int, high: Optional[int] = None, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {rng}{why}, got {value}")
    return value


def _backend_name(backend, device) -> str:
    V.check_backend(backend)
    return backends.resolve_name(backend, device.type)  # raises if it cannot run here


def reads_pieces(backend: Optional[str], device: torch.device) -> bool:
    """Whether the robust rules read :class:`ClientPieces` in place on ``backend`` (the
    CPU backend: ``coordinate_select_pieces``, ``client_gram_pieces``,
    ``aggregate_pieces``), rather than stacking them into ``[C, N]`` rows first."""
    return _backend_name(backend, torch.device(device)) == "cpu"


def _rows(clients, backend=None, *, pieces_ok: bool = True):
    """Validated clients as ``(X, C, N, dtype, device)``; ``X`` a ``[C, N]`` tensor, a
    list of rows, or :class:`ClientPieces` where the backend reads them in place
    (:func:`reads_pieces`; else stacked once)."""
    rows, C, N, dtype, device = check_clients(clients)
    if isinstance(rows, ClientPieces) and not (pieces_ok and reads_pieces(backend, device)):
        rows = rows.stacked()
    return rows, C, N, dtype, device


def client_gram(clients, extra: Optional[torch.Tensor] = None, *, float64_products: bool = False,
                backend: Optional[str] = None) -> torch.Tensor:
    """``G = X X^T`` as a float64 ``[C, C]`` tensor, one pass over the data, symmetric
    by construction.  With ``extra`` (an ``[N]`` vector) the result is the
    ``[C + 1, C + 1]`` Gram matrix of the clients and ``extra`` (its last row:
    ``<x_i, extra>`` and ``||extra||^2``), still one pass.

    How, by backend (every one deterministic: fixed blocks added in a fixed order):

    * ``reference``: float64 products of float64 blocks of :data:`GRAM_CHUNK` columns
      (products of fp32/fp16/bf16 values are exact in float64).
    * ``cpu``: ``fedopt_C::client_gram`` (:class:`ClientPieces` read in place): each
      block of 256 columns summed in the acc dtype, the blocks added in float64, so
      ``|G_ij - <x_i, x_j>| <= (gamma_k(u_acc) + gamma_n(2^-53)) sum_l |x_il x_jl|`` with
      ``k`` = :data:`GRAM_ACC_OPS` (10 for fp32/fp16/bf16 data, 13 for fp64) and ``n``
      the number of blocks plus chunks (csrc/cpu/robust_kernels.h); an ``extra`` of
      another dtype than the clients takes the next form.
    * ``triton``, ``cuda``: the same blocks by batched products on the device
      (:func:`~fedopt_kernels.backends.gram.gram_blocks`; ``k = 256``).

    ``float64_products``: the blocks in float64 instead of the acc dtype (products of
    fp32/fp16/bf16 values exact, ``k = 13`` roundings of ``2^-53``: a float64 Gram's
    accuracy; triton and cuda take the reference form) -- for the rules whose result
    moves with every distance (the geometric median's and centered clipping's weights
    ``1/||v - x_i||``), where the selecting rules (Krum, Multi-Krum, Bulyan) only
    compare them.

    The relative error of a distance ``G_ii + G_jj - 2 G_ij`` is that bound over
    ``||x_i - x_j||^2``: clients far closer to each other than to the origin lose
    digits (by the 2^-24 of fp32 on the CPU, where float64 lost them by 2^-53)."""
    X, C, N, dtype, device = check_clients(clients)
    name = _backend_name(backend, device)
    if extra is not None:  # one more row, of its own dtype (a backend's kernel may not take it: then torch's form)
        if isinstance(X, ClientPieces):
            X = X.stacked()
        X = list(X.contiguous() if isinstance(X, torch.Tensor) else X) + [extra.contiguous()]
    return _dispatch.kernel("client_gram", name, device)(X, bool(float64_products))


def _gram_parts(G: torch.Tensor):
    """Kept clients (finite ``G_ii``), and ``G`` with the left-out clients' rows and
    columns zeroed (their NaN never reaches a product)."""
    kept = torch.isfinite(torch.diagonal(G))
    both = kept[:, None] & kept[None, :]
    Gk = torch.where(both, G, torch.zeros((), dtype=G.dtype, device=G.device))
    return kept, Gk


def sq_distances_from_gram(G: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``[C, C]`` ``||x_i - x_j||^2 = G_ii + G_jj - 2 G_ij`` (clamped at 0, 0 on the
    diagonal); ``+inf`` where a client is left out."""
    d = torch.diagonal(G)
    D = (d[:, None] + d[None, :] - 2 * G).clamp_min(0)
    D.fill_diagonal_(0)
    inf = torch.full((), float("inf"), dtype=G.dtype, device=G.device)
    return torch.where(kept[:, None] & kept[None, :], D, inf)


def _krum_scores(D: torch.Tensor, candidates: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """Score of each candidate: the sum of its ``neighbours`` (0-d int64, capped at the
    other candidates' number) smallest squared distances to the other candidates;
    ``+inf`` for the others."""
    C = D.shape[0]
    inf = torch.full((), float("inf"), dtype=D.dtype, device=D.device)
    eye = torch.eye(C, dtype=torch.bool, device=D.device)
    pair = candidates[:, None] & candidates[None, :] & ~eye
    nearest = torch.sort(torch.where(pair, D, inf), dim=1).values
    k = torch.minimum(neighbours.clamp_min(0), candidates.sum() - 1)
    take = torch.arange(C, device=D.device)[None, :] < k
    s = torch.where(take, nearest, torch.zeros((), dtype=D.dtype, device=D.device)).sum(dim=1)
    return torch.where(candidates, s, inf)


def _lowest(scores: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[C]`` bool: the ``count`` lowest scores (ties: the lower index), finite ones only."""
    order = torch.sort(scores, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(scores.shape[0], device=scores.device)
    return (rank < count) & torch.isfinite(scores)


def _weighted_mean(X, C, N, dtype, device, coef: torch.Tensor, out, backend):
    """``out = sum_i coef_i x_i`` by the fused ``aggregate`` pass (coef float64 on the
    device; a client with coefficient 0 is never multiplied)."""
    run = aggregate_runner(backend, device)
    acc = V.acc_dtype(dtype)
    run(X, coef.to(acc).contiguous(), 1.0, out, None)
    return out


def _base_weights(weights, C, device) -> torch.Tensor:
    if weights is None:
        return torch.ones(C, dtype=torch.float64, device=device)
    return check_weights(weights, C, device, torch.float64)


def _zero(device):
    return torch.zeros((), dtype=torch.long, device=device)


# ------------------------------------------------------------ coordinate-wise rules

def _coordinate(clients, mode: int, count_of, out, backend):
    X, C, N, dtype, device = _rows(clients, backend)
    out = check_out(out, N, dtype, device, who="robust aggregation")
    run = _dispatch.kernel("coordinate_select", _backend_name(backend, device), device)
    keep = torch.ones(C, dtype=torch.bool, device=device)
    bad = run(X, keep, count_of(keep.sum()), mode, out, None)
    # a second pass without the non-finite clients, skipped on the device if none
    kept = ~bad
    run(X, kept, count_of(kept.sum()), mode, out, ~bad.any().reshape(1))
    m = kept.sum()
    stats = RobustStats(bad, kept, None, m > 0, _zero(device), m == 0)
    return out, stats


def coordinate_median(clients, *, out: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """Coordinate-wise median of the kept clients ([Yin18]; unweighted, the mean of the
    two middle values for an even count).  Returns ``(out, RobustStats)``."""
    return _coordinate(clients, MODE_TRIM, lambda m: ((m - 1) // 2).clamp_min(0).reshape(1), out,
                       backend)


def trimmed_mean(clients, beta: float, *, out: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """Coordinate-wise beta-trimmed mean ([Yin18]; unweighted): per coordinate the
    ``k = floor(beta m)`` largest and smallest of the ``m`` kept values are dropped and
    the rest averaged.  ``beta`` in ``[0, 0.5)``.  Returns ``(out, RobustStats)``."""
    beta = V.check_real(beta, "beta", low=0.0, high=0.5, high_open=True)
    return _coordinate(clients, MODE_TRIM,
                       lambda m: torch.floor(m.double() * beta).long().reshape(1), out, backend)


# ------------------------------------------------------------- Krum family

def _check_f(f, C: int, need: int, mult: int, rule: str) -> int:
    f = _check_int(f, "f", low=0)
    if C < mult * f + need:
        most = (f"f <= {(C - need) // mult} here" if C >= need else
                f"it needs at least {need} clients whatever f")
        raise ValueError(f"f = {f} is too large for {C} clients: {rule} needs C >= {mult} f + {need} ({most})")
    return f


def multi_krum(clients, f: int, m: Optional[int] = None, *, weights=None, out: Optional[torch.Tensor] = None,
               backend: Optional[str] = None):
    """Multi-Krum ([Blanchard17]): the ``m`` clients with the lowest Krum scores
    (``C - f - 2`` nearest neighbours), averaged -- plainly as in the paper, or with
    ``weights`` renormalised over the selected clients.  Needs ``C > 2 f + 2``;
    ``m`` in ``[1, C]`` (default ``C - f``).  Returns ``(out, RobustStats)``."""
    X, C, N, dtype, device = _rows(clients, backend)
    f = _check_f(f, C, 3, 2, "Krum")
    m = C - f if m is None else _check_int(m, "m", low=1, high=C)
    w = _base_weights(weights, C, device)
    out = check_out(out, N, dtype, device, who="robust aggregation")
    V.check_backend(backend)
    aggregate_runner(backend, device)  # the backend can run here, before any pass
    G = client_gram(X, backend=backend)
    kept, Gk = _gram_parts(G)
    D = sq_distances_from_gram(Gk, kept)
    scores = _krum_scores(D, kept, torch.full((), C - f - 2, dtype=torch.long, device=device))
    selected = _lowest(scores, torch.full((), m, dtype=torch.long, device=device))
    sw = torch.where(selected, w, torch.zeros((), dtype=w.dtype, device=device))
    total = sw.sum()
    coef = torch.where(total > 0, sw / torch.where(total > 0, total, torch.ones_like(total)), sw)
    _weighted_mean(X, C, N, dtype, device, coef, out, backend)
    e = (~kept).sum()
    return out, RobustStats(~kept, selected, coef, e <= f, _zero(device), e == C, torch.diagonal(G).clone())


def krum(clients, f: int, *, out: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """Krum ([Blanchard17]): the one client with the lowest score.  Needs ``C > 2f + 2``."""
    return multi_krum(clients, f, 1, out=out, backend=backend)


def bulyan(clients, f: int, *, out: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """Bulyan ([ElMhamdi18]): ``theta = C - 2f`` clients picked one by one by Krum over
    those not yet picked, then per coordinate the mean of the ``theta - 2f`` picked
    values closest to their median.  Needs ``C >= 4f + 3``.  Unweighted, as the paper.
    Returns ``(out, RobustStats)``."""
    X, C, N, dtype, device = _rows(clients, backend)
    f = _check_f(f, C, 3, 4, "Bulyan")
    out = check_out(out, N, dtype, device, who="robust aggregation")
    run = _dispatch.kernel("coordinate_select", _backend_name(backend, device), device)
    G = client_gram(X, backend=backend)
    kept, Gk = _gram_parts(G)
    D = sq_distances_from_gram(Gk, kept)
    chosen = torch.zeros(C, dtype=torch.bool, device=device)
    inf = torch.full((), float("inf"), dtype=D.dtype, device=device)
    for t in range(C - 2 * f):
        remaining = kept & ~chosen
        scores = _krum_scores(D, remaining, torch.full((), C - t - f - 2, dtype=torch.long, device=device))
        best = torch.argmin(torch.where(remaining, scores, inf))
        pick = torch.zeros(C, dtype=torch.bool, device=device)
        pick[best] = remaining.any()
        chosen = chosen | pick
    theta = chosen.sum()
    run(X, chosen, (theta - 2 * f).clamp_min(1).reshape(1), MODE_CLOSEST, out, None)
    e = (~kept).sum()
    return out, RobustStats(~kept, chosen, None, e <= f, _zero(device), e == C, torch.diagonal(G).clone())


# ------------------------------------------------------------ iterative rules

def _quad(Gk, c):
    """``c^T G c`` and ``G c``."""
    Gc = Gk @ c
    return torch.dot(c, Gc), Gc


def geometric_median(clients, weights=None, *, nu: float = 1e-6, tol: float = 1e-5, max_iter: int = 4,
                     out: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """The geometric median ``argmin_v sum_i alpha_i ||v - x_i||`` by RFA's smoothed
    Weiszfeld iterations ([Pillutla22]), from the weighted mean::

        beta_i = alpha_i / max(nu, ||v - x_i||),   v <- sum_i beta_i x_i / sum_i beta_i

    stopping after the first iteration whose objective changed by at most
    ``tol * g(v_new)`` (decided on the device: later iterations leave ``v`` as it is) or
    after ``max_iter``.  ``alpha`` = ``weights`` (uniform if None) renormalised over the
    kept clients.  Every ``||v - x_i||`` comes from the Gram matrix in float64 (``v``
    held as coefficients over the clients), so the iterations read no data; one
    ``aggregate`` pass writes ``v``.  Returns ``(out, RobustStats)`` (``iterations``:
    how many ran)."""
    X, C, N, dtype, device = _rows(clients, backend)
    nu = V.check_real(nu, "nu", low=0.0, low_open=True)
    tol = V.check_real(tol, "tol", low=0.0)
    max_iter = _check_int(max_iter, "max_iter", low=0)
    w = _base_weights(weights, C, device)
    out = check_out(out, N, dtype, device, who="robust aggregation")
    V.check_backend(backend)
    aggregate_runner(backend, device)
    G = client_gram(X, float64_products=True, backend=backend)  # the weights move with every distance
    kept, Gk = _gram_parts(G)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    a = torch.where(kept, w, zero)
    total = a.sum()
    a = torch.where(total > 0, a / torch.where(total > 0, total, torch.ones_like(total)), zero)
    diag = torch.diagonal(Gk)

    def dists(c):
        cGc, Gc = _quad(Gk, c)
        return (diag - 2 * Gc + cGc).clamp_min(0).sqrt()

    c = a.clone()
    g = torch.dot(a, dists(c))
    active = total > 0
    iterations = _zero(device)
    for _ in range(max_iter):
        b = torch.where(kept, a / torch.clamp(dists(c), min=nu), zero)
        bs = b.sum()
        c_new = torch.where(bs > 0, b / torch.where(bs > 0, bs, torch.ones_like(bs)), zero)
        g_new = torch.dot(a, dists(c_new))
        c = torch.where(active, c_new, c)
        iterations = iterations + active.long()
        done = (g - g_new).abs() <= tol * g_new
        g = torch.where(active, g_new, g)
        active = active & ~done
    _weighted_mean(X, C, N, dtype, device, c, out, backend)
    return out, RobustStats(~kept, kept & (a > 0), c, kept.any(), iterations, ~kept.any(), torch.diagonal(G).clone())


def centered_clip(clients, tau: float, *, iterations: int = 1, reference: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """Centered clipping ([Karimireddy21]), ``iterations`` times from ``reference``
    (the previous round's aggregate; zeros if None)::

        v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||)

    over the ``n`` kept clients (unweighted, as the paper).  ``v`` is held as
    ``a r + sum_j c_j x_j``: the distances come from the Gram matrix of the clients and
    ``r`` (one float64 pass), the iterations read no data, one ``aggregate`` pass and
    one ``[N]`` add write ``v``.  Returns ``(out, RobustStats)``."""
    # the Gram matrix with the reference point reads rows (its pieces form has no extra row)
    X, C, N, dtype, device = _rows(clients, backend, pieces_ok=reference is None)
    tau = V.check_real(tau, "tau", low=0.0, low_open=True)
    iterations = _check_int(iterations, "iterations", low=1)
    if reference is not None:
        V.check_tensor(reference, "reference", dims=1)
        if reference.shape[0] != N or reference.device != device:
            raise ValueError(f"reference must be a [{N}] tensor on {device} (the previous aggregate), got "
                             f"{tuple(reference.shape)} on {reference.device}")
    out = check_out(out, N, dtype, device, who="robust aggregation")
    V.check_backend(backend)
    aggregate_runner(backend, device)
    if reference is None:
        G = client_gram(X, float64_products=True, backend=backend)  # the clip factors move with every distance
        d = torch.zeros(C, dtype=torch.float64, device=device)
        R = torch.zeros((), dtype=torch.float64, device=device)
        a = torch.zeros((), dtype=torch.float64, device=device)
    else:
        Gx = client_gram(X, extra=reference, float64_products=True, backend=backend)
        G, d, R = Gx[:C, :C], Gx[C, :C], Gx[C, C]
        a = torch.ones((), dtype=torch.float64, device=device)
    kept, Gk = _gram_parts(G)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    d = torch.where(kept, d, zero)
    n = kept.sum()
    n_safe = n.clamp_min(1).double()
    c = torch.zeros(C, dtype=torch.float64, device=device)
    diag = torch.diagonal(Gk)
    for _ in range(iterations):
        cGc, Gc = _quad(Gk, c)
        sq = diag - 2 * a * d - 2 * Gc + a * a * R + 2 * a * torch.dot(c, d) + cGc
        norm = sq.clamp_min(0).sqrt()
        s = torch.where(norm > tau, tau / torch.where(norm > 0, norm, torch.ones_like(norm)),
                        torch.ones_like(norm))
        s = torch.where(kept, s, zero)
        S = s.sum() / n_safe
        a = a * (1 - S)
        c = c * (1 - S) + s / n_safe
    acc = out.dtype if out.dtype == V.acc_dtype(dtype) else V.acc_dtype(dtype)
    buf = out if out.dtype == acc else torch.empty(N, dtype=acc, device=device)
    _weighted_mean(X, C, N, dtype, device, c, buf, backend)
    if reference is not None:
        buf.addcmul_(reference.to(acc), a.to(acc))
    if buf is not out:
        out.copy_(buf)
    return out, RobustStats(~kept, kept, c, n > 0, torch.full((), iterations, dtype=torch.long, device=device),
                            n == 0, torch.diagonal(G).clone())


def norm_bounded_mean(clients, weights=None, *, radius: Optional[float] = None,
                      median_factor: Optional[float] = None, out: Optional[torch.Tensor] = None,
                      backend: Optional[str] = None):
    """Norm bounding ([Sun19]): ``sum_i w_i min(1, M / (||x_i|| + 1e-6)) x_i`` with
    ``M = radius`` or ``M = median_factor * median_i ||x_i||`` (kept clients; exactly
    one of the two), ``w`` = ``weights`` (uniform ``1/C`` if None) with the non-finite
    clients' weight moved to the others as :func:`~fedopt_kernels.ops.aggregate` does.
    Two passes of the fused aggregation (norms, then the bounded sum; the second
    skipped on the device when no client is bounded or left out).  Returns
    ``(out, RobustStats)``; ``stats.weights`` are the bounded weights."""
    X, C, N, dtype, device = _rows(clients, backend)
    if (radius is None) == (median_factor is None):
        raise ValueError("norm_bounded_mean takes exactly one of radius (a fixed bound) and median_factor (a "
                         "multiple of the clients' median norm)")
    if radius is not None:
        radius = V.check_real(radius, "radius", low=0.0, low_open=True)
    else:
        median_factor = V.check_real(median_factor, "median_factor", low=0.0, low_open=True)
    acc = V.acc_dtype(dtype)
    w = (torch.full((C,), 1.0 / C, dtype=torch.float64, device=device) if weights is None
         else check_weights(weights, C, device, torch.float64))
    out = check_out(out, N, dtype, device, who="robust aggregation")
    V.check_backend(backend)
    run = aggregate_runner(backend, device)
    w_acc = w.to(acc)
    q, _ = run(X, w_acc, 1.0, out, None)
    q = q.double()
    kept = torch.isfinite(q)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    kw = torch.where(kept, w, zero)
    kt = kw.sum()
    eff = torch.where(kt > 0, kw * (w.sum() / torch.where(kt > 0, kt, torch.ones_like(kt))), zero)
    norms = torch.where(kept, q, zero).sqrt()
    if radius is not None:
        M = torch.full((), radius, dtype=torch.float64, device=device)
    else:
        m = kept.sum()
        v = torch.sort(torch.where(kept, norms, torch.full((), float("inf"), dtype=torch.float64,
                                                              device=device))).values
        lo = v[((m - 1) // 2).clamp(0, C - 1)]
        hi = v[(m // 2).clamp(0, C - 1)]
        M = median_factor * torch.where(m % 2 == 1, lo, (lo + hi) / 2)
    eff = eff * torch.clamp(M / (norms + NORM_EPS), max=1.0)
    eff = torch.where(kept, eff, zero)
    eff_acc = eff.to(acc)
    same = (eff_acc == w_acc).all()
    run(X, eff_acc, 1.0, out, same.reshape(1))
    return out, RobustStats(~kept, kept, eff, kept.any(), _zero(device), ~kept.any(), q)
