"""Benchmark of one FedNAR step (mode co) against the unfused ways to write it.

Candidates, all on the same parameter list, timed interleaved (``timing.interleaved``):

* ``fused``: ``fedopt_kernels.ops.nar_step_`` on the chosen backend, lr changing every
  call (free for the fused op: lr is a runtime argument).
* ``fused, 2 groups``: what ``FedNAR`` runs in the usual training-loop setup, weights
  (dim > 1) with weight decay and biases/norm layers without, ONE norm over both
  (``ops.nar_step_groups_``: a norm and an update launch per group, the same traffic).
* ``python_ref eager``: the oracle (``python_ref.fednar.nar_step_``).
* ``torch._foreach``: the best hand-written eager composition (``_foreach_add``,
  ``_foreach_norm``, ``_foreach_mul_``, ``_foreach_add_``).
* ``torch.compile(python_ref)``: the oracle compiled, at a fixed lr (its steady state)
  and with lr changing every call (what FL schedules do); the first call with a new lr
  is reported separately (recompilation).
* ``torch SGD(fused) + clip_grad_norm_(foreach)``: what PyTorch users run for a clipped
  SGD step (gradient clipping, decay after the clip: not FedNAR's math, the bar for
  speed), ``torch.optim.SGD(fused=True)`` where this torch has it: the torch anchor
  (``vs torch`` = its time / the candidate's; NaN where this torch has no fused SGD).
* ``floor``: ATen primitives with the step's memory traffic on flat buffers of the same
  size: ``torch.dot(g, x)`` (norm pass, 2 words/param) + ``x.add_(g, alpha=a)`` (update
  pass, 3 words/param).  ``speed vs floor`` = floor time / candidate time.

``of copy bw``: the step's minimum traffic (20 bytes/param for fp32: norm pass reads x
and g, update pass reads x, g and writes x) per second, as a fraction of the measured
device copy bandwidth (``timing.copy_bandwidth``); ``of HBM peak``: the same per second as
a fraction of the GPU's peak memory bandwidth (``timing.peak_bandwidth``; NaN on CPU).
On CUDA each candidate's ``launches`` is counted once the timing is done
(``timing.defer_launch_columns``, one profiled call each; the one-off recompile is not a
candidate).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from .. import ops
from ..backends.oracle import fednar as ref
from .shapes import numel
from .timing import defer_launch_columns, interleaved, ratio_rows

HYPER = dict(weight_decay=5e-4, max_norm=10.0)
TORCH_ANCHOR = "torch SGD(fused) + clip_grad_norm_(foreach)"


def _make(shapes, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=g) * 0.05).to(device=device, dtype=dtype) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-3).to(device=device, dtype=dtype) for s in shapes]
    return params, grads


def foreach_nar_step_(params, grads, *, lr, weight_decay, max_norm):
    """FedNAR (co) with torch._foreach_* ops: the best unfused eager version."""
    v = torch._foreach_add(grads, params, alpha=weight_decay)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(v)))
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(v, scale)
    torch._foreach_add_(params, v, alpha=-lr)
    return norm


def _lr_sequence():
    """A new lr every call, as with per-step decay."""
    state = {"lr": 0.01}

    def next_lr():
        state["lr"] *= 0.999
        return state["lr"]

    return next_lr


def bench_nar_step(shapes, *, label: str, backend: Optional[str] = None, device="cpu", repeats: int = 15,
                   include_compile: bool = True, warm_cache: bool = False, deferred: Optional[list] = None) -> list:
    """Rows of the candidates above on ``shapes``; ``deferred``: where the launch counting
    waits (``timing.defer_launch_columns``)."""
    device = torch.device(device)
    params, grads = _make(shapes, device)
    n = numel(shapes)
    next_lr = _lr_sequence()
    x_flat = torch.randn(n, device=device)
    g_flat = torch.randn(n, device=device) * 1e-3

    decay = [i for i, s in enumerate(shapes) if len(s) > 1]
    no_decay = [i for i, s in enumerate(shapes) if len(s) <= 1]

    def two_groups():
        lr = next_lr()
        return ops.nar_step_groups_(
            [ops.NarGroup([params[i] for i in decay], [grads[i] for i in decay], lr, HYPER["weight_decay"]),
             ops.NarGroup([params[i] for i in no_decay], [grads[i] for i in no_decay], lr, 0.0)],
            max_norm=HYPER["max_norm"], backend=backend)

    candidates = {
        "fused": lambda: ops.nar_step_(params, grads, lr=next_lr(), backend=backend, **HYPER),
        "fused, 2 groups": two_groups,
        "python_ref eager": lambda: ref.nar_step_(params, grads, lr=next_lr(), **HYPER),
        "torch._foreach": lambda: foreach_nar_step_(params, grads, lr=next_lr(), **HYPER),
        "floor (dot + add_)": lambda: (torch.dot(g_flat, x_flat), x_flat.add_(g_flat, alpha=-1e-6)),
    }
    sgd = _torch_clipped_sgd(shapes, device)
    if sgd is not None:
        candidates[TORCH_ANCHOR] = sgd
    extra = {}
    if include_compile:
        torch._dynamo.reset()
        compiled = torch.compile(ref.nar_step_)
        compiled(params, grads, lr=0.01, **HYPER)  # compile for a fixed lr
        candidates["torch.compile steady lr"] = lambda: compiled(params, grads, lr=0.01, **HYPER)
        start = time.perf_counter()
        compiled(params, grads, lr=0.02, **HYPER)  # the first new lr recompiles
        extra["torch.compile first new lr"] = time.perf_counter() - start
        candidates["torch.compile lr changes"] = lambda: compiled(params, grads, lr=next_lr(), **HYPER)

    times = interleaved(candidates, repeats=repeats, device=device, warm_cache=warm_cache)
    times.update(extra)
    # minimum traffic of the fp32 step: read x, g twice (norm, update), write x: 20 bytes/param
    rows = ratio_rows(f"nar_step {label}", times, base="floor (dot + add_)", fused="fused", traffic_bytes=20 * n,
                      device=device, not_timed=("torch.compile first new lr",), torch_anchor=TORCH_ANCHOR)
    return defer_launch_columns(rows, candidates, device, deferred)


def _torch_clipped_sgd(shapes, device):
    """``clip_grad_norm_(foreach=True)`` + ``SGD(fused=True).step`` on copies of the
    params (None where this torch has no fused SGD for ``device``)."""
    params, grads = _make(shapes, device, seed=1)
    leaves = [p.requires_grad_(True) for p in params]
    for p, g in zip(leaves, grads):
        p.grad = g
    try:
        opt = torch.optim.SGD(leaves, lr=0.01, weight_decay=HYPER["weight_decay"], fused=True)
        opt.step()
    except (RuntimeError, ValueError, TypeError):
        return None

    def step():
        torch.nn.utils.clip_grad_norm_(leaves, HYPER["max_norm"], foreach=True)
        opt.step()

    return step
