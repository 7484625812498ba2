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

``gaussian_noise_`` adds ``std * N(0, I)`` drawn from a seeded ``torch.Generator`` on
the data's device.  It is a separate in-place pass: the aggregation kernels of the CPU,
Triton and CUDA backends have no random number generator, and torch's (Philox on CUDA,
mt19937 on the CPU) makes the draw a function of the generator's seed alone, so a run
is reproducible bit for bit on the same device.  On CUDA it is one ``[N]`` draw and one
add.  On the CPU torch's sampler runs on one thread (about 80M normals/s on a Zen 4
core: an 11M-parameter model's noise costs as much as two passes of the aggregation
over 20 clients), so the vector is drawn in fixed chunks of ``2^20`` elements, chunk
``k`` from its own mt19937 seeded by the ``k``-th of ``ceil(N / 2^20)`` seeds drawn from
``generator``, the chunks spread over torch's threads and each added while it is in
cache: the bits depend on the generator's state alone, not on the number of threads.
Drawing inside the kernel (a counter-based Philox keyed by the seed and the element
index) would save the pass; it is a later step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from . import validation as V
from .aggregate import Clients, aggregate_runner, check_clients, check_out, check_weights, norm_bound_factors

__all__ = ["ClipStats", "clipped_sum", "gaussian_noise_", "clip_updates_", "CLIP_EPS", "CLIENT_CLIP_MARGIN",
           "NOISE_CHUNK"]

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
                backend: Optional[str] = None):
    r"""``out = scale * sum_i w_i min(1, C / (||X_i|| + 1e-6)) X_i`` over the finite clients.

    ``clients``: as :func:`~fedopt_kernels.ops.aggregate` takes them (``[C, N]``, ``C``
    vectors, or :class:`~fedopt_kernels.ops.ClientPieces`); ``clip`` ``C``: a number
    ``> 0`` or a one-element tensor on the clients' device; ``weights``: None (every
    client 1) or ``[C]`` numbers ``>= 0`` (a fixed bound on them is the caller's
    guarantee: :mod:`fedopt_kernels.server.dp` checks it); ``scale``: a number ``> 0``
    (``1 / m``, the expected number of clients, for DP-FedAvg's mean).

    Each client's contribution has norm ``< w_i C``.  A client holding NaN/Inf is left
    out with weight 0 and, unlike :func:`~fedopt_kernels.ops.aggregate`'s
    ``nonfinite="exclude"``, the others keep their weights (the sensitivity argument
    of the module docstring).  Two passes of the fused aggregation kernel (the second
    a no-op when nothing is clipped or excluded), fp32 accumulation, deterministic.

    Returns ``(out, ClipStats)``; ``out`` has the clients' dtype unless given (the
    clients' dtype or the accumulation dtype).
    """
    rows, C, N, dtype, device = check_clients(clients)
    acc = V.acc_dtype(dtype)
    if weights is None:
        w = torch.ones(C, dtype=acc, device=device)
    else:
        w = check_weights(weights, C, device, acc)
    clip = _check_clip(clip, device, acc)
    scale = V.check_real(scale, "scale", low=0.0, low_open=True)
    out = check_out(out, N, dtype, device, who="clipped_sum", apart_from=rows)
    V.check_backend(backend)
    run = aggregate_runner(backend, device)

    q, Q = run(rows, w, scale, out, None)  # pass 1: every ||X_i||^2 (and the unclipped sum)
    excluded = ~torch.isfinite(q)
    zero = torch.zeros((), dtype=acc, device=device)
    factors = norm_bound_factors(q.to(acc), excluded, clip)
    eff = torch.where(excluded, zero, w * factors)
    same = (eff == w).all()  # nothing clipped or excluded: the second pass does nothing
    _, Q2 = run(rows, eff, scale, out, same)
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


def gaussian_noise_(out: torch.Tensor, std: Union[float, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """``out += std * N(0, I)``, in place; returns ``out``.

    The draw is ``torch.randn`` of ``out``'s length in the accumulation dtype (fp32 for
    fp16/bf16 ``out``) from ``generator``, which must live on ``out``'s device; ``std`` is
    a number ``>= 0`` or a one-element tensor on that device (not read: no sync).  With
    the same generator state the same bits come out, whatever the number of threads
    (on the CPU the draw is chunked: see the module docstring)."""
    V.check_tensor(out, "out", dims=1)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if torch.device(generator.device).type != out.device.type:
        raise ValueError(f"generator is on {generator.device} but out is on {out.device}: draw the noise where the "
                         "data are (torch.Generator(device=out.device))")
    acc = V.acc_dtype(out.dtype)
    if isinstance(std, torch.Tensor):
        if std.numel() != 1 or std.device != out.device:
            raise ValueError(f"std as a tensor must have one element on {out.device}, got shape {tuple(std.shape)} "
                             f"on {std.device}")
    else:
        std = V.check_real(std, "std", low=0.0)
    if isinstance(std, torch.Tensor):
        std = std.reshape(()).to(acc)
    if out.device.type == "cpu":
        _cpu_noise_(out, std, generator, acc)
        return out
    _add_noise_(out, torch.randn(out.shape, generator=generator, device=out.device, dtype=acc), std)
    return out


NOISE_CHUNK = 1 << 20  # elements per CPU chunk (part of the reproducibility contract)


def _add_noise_(out: torch.Tensor, noise: torch.Tensor, std) -> None:
    if isinstance(std, torch.Tensor):
        out.add_(noise.mul_(std))
    else:
        out.add_(noise, alpha=std)


def _cpu_noise_(out: torch.Tensor, std, generator: torch.Generator, acc: torch.dtype) -> None:
    """The CPU draw (module docstring): fixed chunks, one seeded mt19937 each, spread
    over torch's threads."""
    N = out.numel()
    chunks = (N + NOISE_CHUNK - 1) // NOISE_CHUNK
    if chunks == 0:
        return
    seeds = torch.randint(0, 1 << 62, (chunks,), generator=generator, dtype=torch.int64).tolist()

    def chunk(k: int) -> None:
        lo, hi = k * NOISE_CHUNK, min(N, (k + 1) * NOISE_CHUNK)
        g = torch.Generator().manual_seed(seeds[k])
        _add_noise_(out[lo:hi], torch.randn(hi - lo, generator=g, dtype=acc), std)

    workers = min(torch.get_num_threads(), chunks)
    if workers <= 1:
        for k in range(chunks):
            chunk(k)
        return
    # torch releases the GIL in randn and add; which thread draws a chunk does not change its bits
    list(_noise_pool(workers).map(chunk, range(chunks)))


_POOLS: dict = {}  # (pid, workers) -> ThreadPoolExecutor, kept: starting threads every round cost ~40 ms


def _noise_pool(workers: int):
    """A thread pool of ``workers`` threads, made once per size and kept for the
    process (its threads idle between rounds; they exit with the interpreter).  Keyed
    by the process id too: a forked child (a simulator worker) inherits the parent's
    executor without its threads, and would wait on it for ever."""
    import os

    key = (os.getpid(), workers)
    pool = _POOLS.get(key)
    if pool is None:
        from concurrent.futures import ThreadPoolExecutor

        pool = _POOLS[key] = ThreadPoolExecutor(workers, thread_name_prefix="fedopt-dp-noise")
    return pool
