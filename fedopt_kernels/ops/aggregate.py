"""``aggregate``: fused weighted aggregation of client vectors with its statistics."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

from ..backends.hyper import split
from . import _dispatch, validation as V
from .checked_weights import CheckedWeights
from .client_pieces import ClientPieces

Clients = Union[torch.Tensor, Sequence[torch.Tensor], ClientPieces]
NONFINITE = ("exclude", "propagate")


class AggregateStats(NamedTuple):
    """Statistics of one aggregation, as tensors on the data's device (no host sync).

    * ``client_sq_norms`` ``[C]``: ``||X_i||^2`` of every client as sent.
    * ``sq_norm``: ``||sum_i w_i X_i||^2`` of what was aggregated (effective weights),
      before ``gamma``.
    * ``excluded`` ``[C]`` bool: clients left out because they hold NaN/Inf.
    * ``weights`` ``[C]``: the effective weights used (after exclusion, renormalisation
      and norm bounding).
    * ``all_excluded``: bool, every client was excluded (``out`` is then all zeros and a
      server step must be skipped).
    """

    client_sq_norms: torch.Tensor
    sq_norm: torch.Tensor
    excluded: torch.Tensor
    weights: torch.Tensor
    all_excluded: torch.Tensor


def check_clients(clients: Clients, name: str = "clients"):
    """Validate ``clients``; return ``(rows_for_backend, C, N, dtype, device)``.

    A ``DTensor`` is refused by name: aggregation averages whole client vectors (the
    full, unsharded state), and the kernels would only see one rank's shard of it.
    :class:`ClientPieces` (validated when built) are returned as they are: the backend
    calls (:mod:`._dispatch`) read them."""
    if isinstance(clients, ClientPieces):
        return clients, clients.num_clients, clients.numel, clients.dtype, clients.device
    if isinstance(clients, torch.Tensor):
        V.refuse_dtensor(clients, name, who="aggregate")
        V.check_tensor(clients, name, dims=2)
        if not clients.is_contiguous():
            raise ValueError(f"{name} as a [C, N] tensor must be contiguous")
        C, N = clients.shape
        if C == 0:
            raise ValueError(f"{name} must hold at least one client, got shape {tuple(clients.shape)}")
        return clients, C, N, clients.dtype, clients.device
    rows = V.check_tensor_list(clients, name)
    if not rows:
        raise ValueError(f"{name} must hold at least one client")
    for i, r in enumerate(rows):
        V.refuse_dtensor(r, f"{name}[{i}]", who="aggregate")
    first = rows[0]
    for i, r in enumerate(rows):
        if r.dim() != 1:
            raise ValueError(f"{name}[{i}] must be a 1-D vector, got shape {tuple(r.shape)}")
        if not r.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous")
        V.check_like(r, first, f"{name}[{i}]", f"{name}[0]", strides=False)
    return rows, len(rows), first.numel(), first.dtype, first.device


def as_weight_tensor(weights, C: int, name: str = "weights") -> torch.Tensor:
    """Client weights in any of the forms every entry point accepts -- a tensor
    (floating or integer), a list or tuple of numbers, a NumPy array -- as a ``[C]``
    real tensor: sequences become CPU float64, integer tensors float64 on their
    device, floating tensors stay as they are (autograd included)."""
    V.refuse_dtensor(weights, name, who="aggregate")
    if not isinstance(weights, torch.Tensor):
        if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
            raise TypeError(f"{name} must be a tensor or a sequence of {C} numbers, got {type(weights).__name__}")
        try:
            weights = torch.as_tensor([float(v) for v in weights], dtype=torch.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a tensor or a sequence of {C} numbers, got {weights!r}") from None
    if weights.dtype == torch.bool or weights.is_complex():
        raise TypeError(f"{name} must hold real numbers, got dtype {weights.dtype}")
    if weights.dim() != 1 or weights.shape[0] != C:
        raise ValueError(f"{name} must have shape [{C}] (one weight per client), got {tuple(weights.shape)}")
    if not weights.is_floating_point():
        weights = weights.to(torch.float64)
    return weights


def check_weights(weights, C: int, device, dtype, name: str = "weights", *, values_checked: bool = False
                  ) -> torch.Tensor:
    """``[C]`` weights (any form :func:`as_weight_tensor` takes, or
    :class:`~.checked_weights.CheckedWeights`) on ``device`` in ``dtype``.

    Weights that live on the CPU are also checked by value (no negative or non-finite
    weight, not all zero) and then copied to the clients' device without waiting for
    it.  Weights already on an accelerator are not read: that would synchronise the
    host with the device, which a step never does.  :class:`CheckedWeights` (the
    server's round, whose weights are checked once where they enter) or
    ``values_checked``: the caller has already checked the values; only the form
    (length, dtype, device) is checked here.
    """
    if isinstance(weights, CheckedWeights):
        weights, values_checked = weights.values, True
    weights = as_weight_tensor(weights, C, name)
    if weights.device.type == "cpu":
        if not values_checked:
            check_weight_values(weights, name)
        return host_to_device(weights.to(dtype).contiguous(), device, name)
    if weights.device != device:
        raise ValueError(f"{name} is on {weights.device} but the clients are on {device}")
    return weights.to(dtype).contiguous()


def host_to_device(t: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    """A host tensor argument on ``device``: a queued copy on CUDA (no host sync).  While
    a CUDA graph is being captured such a copy cannot be recorded (the graph would
    replay it from a host buffer long gone), so it is refused by name: pass the
    argument as a CUDA tensor to capture the op.  The copy starts from pinned memory:
    from pageable memory CUDA may make an asynchronous copy wait for the stream."""
    if device.type != "cuda":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise ValueError(f"{name} is a CPU tensor (or a list of numbers), which cannot be copied to {device} while "
                         f"a CUDA graph is being captured: pass {name} as a tensor on {device}")
    return t.pin_memory().to(device, non_blocking=True)


def check_weight_values(weights: torch.Tensor, name: str = "weights", *, allow_all_zero: bool = False) -> None:
    """Host-side value checks of client weights (reads the values): finite, ``>= 0``
    and (unless ``allow_all_zero``: one rank's share of a distributed round, where "not
    all zero" is a property of the union) not all zero.  Under ``torch.compile`` the
    same check is one ``_assert_async`` node in the graph (a Python branch on the values
    would break the graph); it fails when the compiled graph runs, with the same
    statement of what was expected."""

    def in_graph():
        w = weights.detach()
        ok = torch.isfinite(w).all() & (w >= 0).all()
        if w.numel():
            ok = ok & (w > 0).any()
        return ok

    def now():
        w = weights.detach().cpu().double()
        bad = ~torch.isfinite(w)
        if bad.any():
            raise ValueError(f"{name} must be finite, got {w[bad][0].item()} at index {int(bad.nonzero()[0])}")
        neg = w < 0
        if neg.any():
            raise ValueError(f"{name} must be >= 0, got {w[neg][0].item()} at index {int(neg.nonzero()[0])}")
        if w.numel() and not allow_all_zero and not (w > 0).any():
            raise ValueError(f"{name} must not all be zero")

    V.check_values(now, in_graph, f"{name} must be finite, >= 0 and not all zero")


def check_gamma(gamma, device, dtype):
    if isinstance(gamma, torch.Tensor):
        if gamma.numel() != 1:
            raise ValueError(f"gamma as a tensor must have one element, got shape {tuple(gamma.shape)}")
        if gamma.device != device:
            raise ValueError(f"gamma is on {gamma.device} but the clients are on {device}")
        if device.type == "cpu":  # read by value like CPU weights; on a device that would sync
            g = gamma.detach().reshape(())
            V.check_values(lambda: V.check_real(float(g), "gamma", low=0.0, low_open=True),
                           lambda: torch.isfinite(g) & (g > 0), "gamma must be finite and satisfy gamma > 0.0")
        return gamma.reshape(()).to(dtype)
    return V.check_real(gamma, "gamma", low=0.0, low_open=True)


def robust_weights(w: torch.Tensor, q: torch.Tensor, exclude: bool, max_client_norm: Optional[float]):
    """Effective weights: non-finite clients dropped (the rest rescaled to the same
    total) and, optionally, each client scaled down to ``max_client_norm``.

    All on the device: ``[C]``-sized tensor ops, no host sync.
    """
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    excluded = ~torch.isfinite(q) if exclude else torch.zeros_like(q, dtype=torch.bool)
    kept = torch.where(excluded, zero, w)
    kept_total = kept.sum()
    ratio = torch.where(kept_total != 0, w.sum() / kept_total, zero)
    eff = kept * ratio
    if max_client_norm is not None:
        eff = eff * norm_bound_factors(q, excluded, max_client_norm)
    return eff, excluded


def norm_bound_factors(q: torch.Tensor, excluded: torch.Tensor, max_client_norm: float) -> torch.Tensor:
    """Each client's norm-bound factor ``min(1, M / (||X_i|| + 1e-6))`` from its squared
    norm ``q_i`` (an excluded client's, possibly NaN, is never read: its factor is 1)."""
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    norm = torch.where(excluded, zero, q).sqrt()
    return torch.clamp(max_client_norm / (norm + 1e-6), max=1.0)


def aggregate(
    clients: Clients,
    weights: torch.Tensor,
    *,
    gamma=1.0,
    out: Optional[torch.Tensor] = None,
    nonfinite: str = "exclude",
    max_client_norm: Optional[float] = None,
    backend: Optional[str] = None,
):
    r"""Fused ``out = gamma * sum_i weights[i] * clients[i]`` and its statistics.

    ``clients`` is a ``[C, N]`` tensor, a sequence of ``C`` 1-D tensors of length ``N``
    (no stacking copy is made), or :class:`~fedopt_kernels.ops.ClientPieces`: each
    client as its per-layer pieces, optionally subtracted from a base, read in place
    on the CPU backend (bit for bit the result of the copied rows; other backends get
    the rows stacked); ``weights`` a ``[C]`` tensor (not required to sum
    to 1); ``gamma`` (FedLAW's global weight shrinking, [FedLAW] eq. 8) a number
    ``> 0`` or a one-element tensor (checked by value on the CPU; on an accelerator
    that would synchronise, so its value is the caller's contract).  In the same pass
    over the data it computes every ``||X_i||^2`` and ``||sum_i w_i X_i||^2``: each
    client is read once and ``out`` written once, ``(C + 1)`` words per parameter, with
    fp32 accumulation for fp16/bf16 data and a deterministic reduction.

    Robustness (fedopt_kernels' contract, not the paper's):

    * ``nonfinite="exclude"`` (default): a client holding NaN/Inf (a non-finite
      ``||X_i||^2``) gets weight 0 and the others are rescaled to the same total; it
      never reaches ``out``.  If every client is excluded ``out`` is zeros and
      ``stats.all_excluded`` is True.  ``"propagate"`` applies plain IEEE arithmetic.
    * ``max_client_norm=M``: client ``i`` is scaled by ``min(1, M / (||X_i|| + 1e-6))``
      before averaging (norm bounding against poisoned updates).

    Either only costs a second pass over the data when it changes a weight; the
    decision is made on the device (the second pass is a no-op launch otherwise).

    Returns ``(out, AggregateStats)``; ``out`` has the clients' dtype unless given.
    """
    out, stats, _ = aggregate_bounded(clients, weights, gamma=gamma, out=out, nonfinite=nonfinite,
                                      max_client_norm=max_client_norm, backend=backend)
    return out, stats


def aggregate_bounded(clients: Clients, weights: torch.Tensor, *, gamma=1.0, out: Optional[torch.Tensor] = None,
                      nonfinite: str = "exclude", max_client_norm: Optional[float] = None,
                      backend: Optional[str] = None, weights_checked: bool = False):
    """:func:`aggregate` (the same checks, passes and bits), and the norm-bound factors
    it applied: ``(out, AggregateStats, bound)``, ``bound`` ``[C]`` each client's
    ``min(1, M / (||X_i|| + 1e-6))`` (1 for an excluded client), None without
    ``max_client_norm``.  For a caller that describes the round with them (the server's
    :class:`~fedopt_kernels.server.aggregation.LocalAggregator`) instead of computing
    them a second time.

    ``weights_checked=True`` is that caller's promise that ``weights`` hold finite
    numbers ``>= 0``, not all zero (it checked and normalised them itself): their values
    are then not read a second time on the CPU.  Their form (``[C]``, dtype, device) is
    still checked.  The default keeps the op's own guard for every direct user."""
    rows, C, N, dtype, device = check_clients(clients)
    acc = V.acc_dtype(dtype)
    w = check_weights(weights, C, device, acc, values_checked=bool(weights_checked))
    gamma = check_gamma(gamma, device, acc)
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if max_client_norm is not None:
        max_client_norm = V.check_real(max_client_norm, "max_client_norm", low=0.0, low_open=True)
    out = check_out(out, N, dtype, device, who="aggregate", apart_from=rows)
    V.check_backend(backend)
    run = aggregate_runner(backend, device)

    q, Q = run(rows, w, gamma, out, None)
    bound = None
    if nonfinite == "exclude" or max_client_norm is not None:
        eff, excluded = robust_weights(w, q, nonfinite == "exclude", None)
        if max_client_norm is not None:  # the factors, once: returned for the server round to read
            bound = norm_bound_factors(q, excluded, max_client_norm)
            eff = eff * bound
        same = (eff == w).all()  # nothing changed: the second pass does nothing
        _, Q2 = run(rows, eff, gamma, out, same)
        Q = torch.where(same, Q, Q2)
    else:
        eff, excluded = w, torch.zeros(C, dtype=torch.bool, device=device)
    return out, AggregateStats(q, Q, excluded, eff, excluded.all()), bound


def _byte_range(t: torch.Tensor) -> tuple:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_out(out: Optional[torch.Tensor], N: int, dtype: torch.dtype, device: torch.device, *, who: str,
              apart_from=None) -> torch.Tensor:
    """The ``[N]`` output of an aggregation over clients of ``dtype`` on ``device``: a new
    tensor of ``dtype`` when ``out`` is None, else ``out`` checked (contiguous, ``[N]``,
    on ``device``, of ``dtype`` or its accumulation dtype, not a DTensor) and, with
    ``apart_from`` (the clients' rows), sharing no memory with them."""
    if out is None:
        return torch.empty(N, dtype=dtype, device=device)
    acc = V.acc_dtype(dtype)
    V.refuse_dtensor(out, "out", who=who)
    V.check_tensor(out, "out", dims=1)
    if out.shape[0] != N or out.device != device or out.dtype not in (dtype, acc) or not out.is_contiguous():
        dtypes = str(dtype) if dtype == acc else f"{dtype} or {acc}"
        raise ValueError(f"out must be a contiguous [{N}] tensor on {device} with dtype {dtypes}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if apart_from is not None:
        _check_out_apart(out, apart_from)
    return out


def _check_out_apart(out: torch.Tensor, rows) -> None:
    """``out`` may not share memory with a client: the second pass (exclusion, norm
    bounds) re-reads every client after the first one wrote ``out``.  Eager only:
    fake tensors have no addresses."""
    V.check_values(lambda: _out_apart(out, rows), None)


def _out_apart(out: torch.Tensor, rows) -> None:
    if out.numel() == 0:
        return  # an empty out writes nothing
    lo, hi = _byte_range(out)
    tensors = rows.tensors() if isinstance(rows, ClientPieces) else [rows] if isinstance(rows, torch.Tensor) else rows
    for i, r in enumerate(tensors):
        a, b = _byte_range(r)
        if a < hi and lo < b:
            where = ("clients" if isinstance(rows, torch.Tensor) else
                     "a piece (or subtract_from) of clients" if isinstance(rows, ClientPieces) else f"clients[{i}]")
            raise ValueError(f"out shares memory with {where}: aggregate reads every client after writing out, so "
                             "out must be a separate tensor")


def aggregate_runner(backend: Optional[str], device: torch.device):
    """The aggregation kernel of ``backend`` on ``device`` as one callable
    ``run(rows, weights, gamma, out, skip, noise=None) -> (client_sq_norms, sq_norm)``
    (inputs already checked; ``gamma`` a number or a 0-d tensor, split here into the
    contract's pair; ``noise`` None or ``(key, std)``, the contract's Gaussian noise
    added in the same pass: :mod:`.dp_noise`): the backend itself in eager mode, its custom op under
    ``torch.compile`` (:mod:`._dispatch`).  Resolving it raises if the backend cannot
    run there, so a multi-pass caller (the distributed aggregation) learns that before
    any pass.

    ``rows`` may be :class:`ClientPieces`: read in place by the backend's
    ``aggregate_pieces`` (the CPU backend), else its ``aggregate`` over the rows
    stacked once (``O(C N)``; :meth:`ClientPieces.stacked`).  Not under
    ``torch.compile``, which cannot trace the pieces' pointer table."""
    run = _dispatch.kernel("aggregate", backend, device)

    def call(rows, w, gamma, out, skip, noise=None):
        if noise is None:
            return run(rows, w, *split(gamma), out, skip)
        key, std = noise  # the contract's Gaussian noise in the same pass (ops.dp_noise)
        return run(rows, w, *split(gamma), out, skip, key, *split(std))

    return call


def client_dots(clients: Clients, g: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """``[<clients[i], g>]`` for all clients in one pass over the data (acc dtype);
    :class:`ClientPieces` are read in place as :func:`aggregate` reads them."""
    rows, C, N, dtype, device = check_clients(clients)
    V.check_tensor(g, "g", dims=1)
    if g.shape[0] != N or g.device != device or not g.is_contiguous():
        raise ValueError(f"g must be a contiguous [{N}] tensor on {device}, got {tuple(g.shape)} on {g.device}")
    acc = V.acc_dtype(dtype)
    if g.dtype not in (dtype, acc):
        g = g.to(acc)
    return _dispatch.kernel("client_dots", backend, device)(rows, g)
