"""The two data passes of a differentially private aggregation: the clipped sum and its
Gaussian noise.

``clipped_sum`` is the fused aggregation pass (:func:`fedopt_kernels.ops.aggregate`'s
kernel, every backend) used the way DP needs it: ``out = scale * sum_i w_i s_i X_i``
with ``s_i = min(1, C / (||X_i|| + 1e-6))``, so each client enters with norm at most
``w_i C``.  It differs from ``aggregate(..., max_client_norm=C)`` in one point that the
privacy guarantee rests on: a client holding NaN/Inf gets weight 0 and the others are
NOT rescaled to the same total.  ``aggregate`` rescales them (right for a mean), but then
one client's data would change every other client's weight, and the sum's sensitivity
would no longer be ``C``.

The kernel computes every ``||X_i||^2`` in the same pass as the sum, so clipping takes
the same two passes as ``aggregate``'s norm bound: the first yields the norms (and an
unclipped sum), the second the clipped sum with the factors decided on the device; it
is a no-op launch when no factor changes a weight.

The Gaussian noise is drawn INSIDE the kernel: ``clipped_sum(..., noise_key=k,
noise_std=s)`` writes ``out[j] = scale * total[j] + s * n_j``, with ``n_j`` element ``j``
of the counter-based noise of key ``k`` (python_ref/gaussian_noise.py: Philox4x32-10 of
``(k, j)``, Box-Muller with fixed fp32 polynomials).  Each element's draw depends on
``(k, j)`` alone, so the kernel needs no generator state, the bits are the same on every
backend and CPU instruction set, and a run is reproducible from its seed (the key of a
round is a function of the run's seed and the round:
:func:`fedopt_kernels.server.differential_privacy.dp.dp_noise_key`).  :func:`gaussian_noise_` adds the same
noise to a vector already summed: for an fp32/fp64 ``out`` the two forms give the same
bits.  The noise goes into the pass that writes ``out`` last: the second pass when a
client is clipped (the usual DP round), fused there; else, the second pass being a
no-op, one ``add_noise_`` pass -- chosen on the device by the same flag that skips the
second pass, no host sync.  (Noise in both passes would draw it twice in a clipped
round; in the first alone it would be lost when the second rewrites ``out``.)  An
fp16/bf16 ``out`` takes the noise in both passes, so that sum and noise are rounded
once whichever pass writes last.

The sampler is 24-bit Box-Muller: its largest value is ``5.77`` (tails beyond 5.77
sigma, probability ``8e-9`` per element, are cut), as any fp32 Box-Muller's.  Like
torch's and Opacus's samplers it is an ordinary floating-point sampler, not one of the
exact discrete samplers some DP libraries use against floating-point attacks (Mironov
2012).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import validation as V
from . import _dispatch
from .aggregate import Clients, aggregate_runner, check_clients, check_out, check_weights, norm_bound_factors
from ..backends.hyper import split

__all__ = ["ClipStats", "clipped_sum", "gaussian_noise_", "clip_updates_", "CLIP_EPS", "CLIENT_CLIP_MARGIN",
           "check_noise"]

CLIP_EPS = 1e-6  # the norm bound's guard (ops.aggregate.norm_bound_factors): a clipped norm is < C


class ClipStats(NamedTuple):
    """What :func:`clipped_sum` saw, as tensors on the data's device (no host sync).

    * ``client_sq_norms`` ``[C]``: ``||X_i||^2`` as sent (NaN/Inf for a non-finite client);
    * ``unclipped`` ``[C]`` bool: ``||X_i|| <= C`` (False for an excluded client) -- the
      ``b_i`` of adaptive clipping (Andrew et al. 2021, Algorithm 1);
    * ``excluded`` ``[C]`` bool: left out for holding NaN/Inf (weight 0, others unchanged);
    * ``factors`` ``[C]``: each client's clip factor ``min(1, C / (||X_i|| + 1e-6))`` (1 for
      an excluded one, whose norm is never read);
    * ``weights`` ``[C]``: the effective weight of each client in the sum,
      ``w_i s_i`` (0 for an excluded one), before ``scale``;
    * ``sq_norm``: ``||out||^2`` of the clipped, scaled sum (before any noise).
    """

    client_sq_norms: torch.Tensor
    unclipped: torch.Tensor
    excluded: torch.Tensor
    factors: torch.Tensor
    weights: torch.Tensor
    sq_norm: torch.Tensor


def _check_clip(clip, device: torch.device, acc: torch.dtype):
    """A positive finite number, or a one-element tensor on ``device`` (the adaptive clip,
    whose value is not read: that would synchronise)."""
    if isinstance(clip, torch.Tensor):
        if clip.numel() != 1:
            raise ValueError(f"clip as a tensor must have one element, got shape {tuple(clip.shape)}")
        if clip.device != device:
            raise ValueError(f"clip is on {clip.device} but the clients are on {device}")
        if not clip.is_floating_point():
            raise TypeError(f"clip must be a floating tensor, got dtype {clip.dtype}")
        return clip.reshape(()).to(acc)
    return V.check_real(clip, "clip", low=0.0, low_open=True)


def clipped_sum(clients: Clients, clip, *, weights=None, scale: float = 1.0, out: Optional[torch.Tensor] = None,
                noise_key: Optional[int] = None, noise_std: Union[float, torch.Tensor] = 0.0,
                backend: Optional[str] = None):
    r"""``out = scale * sum_i w_i min(1, C / (||X_i|| + 1e-6)) X_i + noise_std * n`` over the
    finite clients.

    ``clients``: as :func:`~fedopt_kernels.ops.aggregate` takes them (``[C, N]``, ``C``
    vectors, or :class:`~fedopt_kernels.ops.ClientPieces`); ``clip`` ``C``: a number
    ``> 0`` or a one-element tensor on the clients' device; ``weights``: None (every
    client 1) or ``[C]`` numbers ``>= 0`` (a fixed bound on them is the caller's
    guarantee: :mod:`fedopt_kernels.server.differential_privacy.dp` checks it); ``scale``: a number ``> 0``
    (``1 / m``, the expected number of clients, for DP-FedAvg's mean);
    ``noise_key``: None (no noise) or an int in ``[0, 2^63)``, with ``noise_std`` a number
    ``>= 0`` or a one-element tensor on the clients' device (not read: no sync): the
    noise ``n`` of that key (module docstring) added in the same pass.

    Each client's contribution has norm ``< w_i C``.  A client holding NaN/Inf is left
    out with weight 0 and, unlike :func:`~fedopt_kernels.ops.aggregate`'s
    ``nonfinite="exclude"``, the others keep their weights (the sensitivity argument
    of the module docstring).  Two passes of the fused aggregation kernel (the second
    a no-op when nothing is clipped or excluded), fp32 accumulation, deterministic.

    Returns ``(out, ClipStats)``; ``out`` has the clients' dtype unless given (the
    clients' dtype or the accumulation dtype).  The statistics are of the sum without
    the noise.
    """
    rows, C, N, dtype, device = check_clients(clients)
    acc = V.acc_dtype(dtype)
    if weights is None:
        w = torch.ones(C, dtype=acc, device=device)
    else:
        w = check_weights(weights, C, device, acc)
    clip = _check_clip(clip, device, acc)
    scale = V.check_real(scale, "scale", low=0.0, low_open=True)
    noise = None if noise_key is None else check_noise(noise_key, noise_std, device, acc)
    out = check_out(out, N, dtype, device, who="clipped_sum", apart_from=rows)
    V.check_backend(backend)
    run = aggregate_runner(backend, device)

    # Where the noise goes (module docstring): into the pass that writes out last.  With an
    # out in the acc dtype, pass 1 sums without it; pass 2 (run when a factor changed)
    # adds it, else add_noise_ does -- both decided by `same` on the device.  With an
    # fp16/bf16 out both passes add it (one rounding of sum + noise whichever writes last).
    both = noise is not None and out.dtype != acc
    q, Q = run(rows, w, scale, out, None, noise if both else None)  # pass 1: every ||X_i||^2, the unclipped sum
    excluded = ~torch.isfinite(q)
    zero = torch.zeros((), dtype=acc, device=device)
    factors = norm_bound_factors(q.to(acc), excluded, clip)
    eff = torch.where(excluded, zero, w * factors)
    same = (eff == w).all()  # nothing clipped or excluded: the second pass does nothing
    _, Q2 = run(rows, eff, scale, out, same, noise)  # the same noise: element j's draw is (key, j)
    if noise is not None and not both:
        _dispatch.kernel("add_noise_", backend, device)(out, noise[0], *split(noise[1]), ~same)
    norms = torch.where(excluded, zero, q.to(acc)).sqrt()
    unclipped = ~excluded & (norms <= clip)
    return out, ClipStats(q, unclipped, excluded, factors, eff, torch.where(same, Q, Q2))


CLIENT_CLIP_MARGIN = 1e-5  # clients clip to C (1 - margin): the server's bound at C is then a no-op


def clip_updates_(updates: torch.Tensor, clip) -> torch.Tensor:
    """Client-side clipping, in place: each row of ``updates`` (``[C, N]``, or one ``[N]``
    update) scaled by ``min(1, R / (||row|| + 1e-6))`` with ``R = C (1 - 1e-5)``.

    The radius is a hair under the server's ``C`` so that the server's bound
    (:func:`clipped_sum`, which checks every update against ``C`` whoever clipped it)
    changes no weight for an honest client -- its norms differing from the client's by
    fp32 rounding -- and its second pass is a no-op: client-side clipping costs the
    server one pass over the data.  (fp16/bf16 updates are scaled in fp32 and rounded
    once; that rounding can leave a norm above ``R`` and the server's pass then runs.)
    Returns the unclipped bits ``||row|| <= C`` (``[C]`` or 0-d bool; False for a
    non-finite row, which is left as it is for the server to exclude).  Norms in float64
    (torch's fp32 norm on the CPU is not accurate enough for a bound)."""
    V.check_tensor(updates, "updates")
    if updates.dim() not in (1, 2):
        raise ValueError(f"updates must be one [N] update or [C, N] rows, got shape {tuple(updates.shape)}")
    acc = V.acc_dtype(updates.dtype)
    rows = updates if updates.dim() == 2 else updates.unsqueeze(0)
    clip = _check_clip(clip, updates.device, acc)
    # float64, one row at a time: torch's fp32 CPU norm of an 11M-element row is off by ~4e-4
    # (relative), enough to send an update above the clip; a row's float64 copy is the only temporary
    norms = torch.stack([torch.linalg.vector_norm(r, dtype=torch.float64) for r in rows]).to(acc) if len(rows) \
        else torch.zeros(0, dtype=acc, device=rows.device)
    finite = torch.isfinite(norms)
    radius = clip * (1 - CLIENT_CLIP_MARGIN)
    factors = torch.where(finite, torch.clamp(radius / (torch.where(finite, norms, 0) + CLIP_EPS), max=1.0),
                          torch.ones_like(norms)).unsqueeze(1)
    if rows.dtype == acc:
        rows.mul_(factors)
    else:
        rows.copy_(rows.to(acc).mul_(factors))
    unclipped = finite & (norms <= clip)
    return unclipped if updates.dim() == 2 else unclipped[0]


MAX_KEY = (1 << 63) - 1


def check_noise(key, std, device: torch.device, acc: torch.dtype) -> Tuple[int, Union[float, torch.Tensor]]:
    """``(key, std)`` checked: ``key`` an int in ``[0, 2^63)``; ``std`` a number ``>= 0`` or
    a one-element floating tensor on ``device`` (returned as a 0-d ``acc`` tensor, not read)."""
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= MAX_KEY:
        raise ValueError(f"noise_key must be an int in [0, 2^63), got {key!r}")
    if isinstance(std, torch.Tensor):
        if std.numel() != 1 or std.device != device or not std.is_floating_point():
            raise ValueError(f"noise_std as a tensor must be one floating element on {device}, got shape "
                             f"{tuple(std.shape)}, dtype {std.dtype} on {std.device}")
        return key, std.reshape(()).to(acc)
    return key, V.check_real(std, "noise_std", low=0.0)


def gaussian_noise_(out: torch.Tensor, std: Union[float, torch.Tensor], key: int, *,
                    backend: Optional[str] = None) -> torch.Tensor:
    """``out += std * n``, in place, ``n`` the counter-based noise of ``key`` (module
    docstring): element ``j`` of ``n`` depends on ``(key, j)`` alone, the same bits on
    every backend.  ``out``: a 1-D contiguous tensor; ``std`` a number ``>= 0`` or a
    one-element tensor on ``out``'s device (not read: no sync); ``key`` an int in
    ``[0, 2^63)``.  Computed in the accumulation dtype (fp32 for fp16/bf16 ``out``) and
    rounded once.  Returns ``out``."""
    V.check_tensor(out, "out", dims=1)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    acc = V.acc_dtype(out.dtype)
    key, std = check_noise(key, std, out.device, acc)
    V.check_backend(backend)
    _dispatch.kernel("add_noise_", backend, out.device)(out, key, *split(std))
    return out
