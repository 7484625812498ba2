"""Benchmark of the fused aggregation against unfused compositions.

All candidates produce the same thing: the weighted mean of C client vectors AND the
statistics a server needs (every ``||X_i||^2`` and ``||sum w_i X_i||^2``), except the
floor, which only sums.  Timed interleaved, medians.

* ``fused``: ``fedopt_kernels.ops.aggregate`` (one pass: reads C words, writes 1).
* ``fused + NaN guard``: the same with its default non-finite-client exclusion (the
  second pass is a device-side no-op unless a client is non-finite).
* ``w @ X + norms``: ``torch.mv`` plus ``(X * X).sum(1)`` and the norm of the result.
* ``stack + w @ X + norms``: the same when clients arrive as a list (``torch.stack``).
* ``loop add_ + norms``: a Python loop of ``out.add_(x_i, alpha=w_i)`` and ``dot``s.
* ``floor``: ``torch.sum(X, dim=0)`` (same traffic as the fused kernel).
* ``floor: torch.stack(list).sum(0)``: what a PyTorch user writes to sum clients that
  arrive as a list of tensors -- the torch anchor of the ``vs torch`` column.  No norms
  and no weights, so a lower bar than the fused op's work, but 3C+1 words per parameter
  (the stack reads and writes every client once more), not the traffic floor.

On CUDA each candidate's ``launches`` is counted once the timing is done
(``timing.defer_launch_columns``), one profiled call each.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from .timing import defer_launch_columns, interleaved, ratio_rows

FLOOR = "floor (torch.sum dim 0)"
TORCH_ANCHOR = "floor: torch.stack(list).sum(0)"


def aggregate_candidates(X: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *,
                         backend: Optional[str] = None) -> dict:
    """The candidates of :func:`bench_aggregate` (name -> no-argument callable) on clients
    ``X`` ``[C, N]`` (also used as a list of rows), weights ``w`` and output ``out``."""
    N = X.shape[1]
    device = X.device
    rows_list = list(X.unbind(0))

    def matmul_norms():
        mean = torch.mv(X.t(), w)
        return mean, (X * X).sum(1), torch.dot(mean, mean)

    def stack_matmul_norms():
        Xs = torch.stack(rows_list)
        mean = torch.mv(Xs.t(), w)
        return mean, (Xs * Xs).sum(1), torch.dot(mean, mean)

    def loop():
        acc = torch.zeros(N, device=device)
        norms = []
        for i, x in enumerate(rows_list):
            acc.add_(x, alpha=float(w[i]))
            norms.append(torch.dot(x, x))
        return acc, torch.stack(norms), torch.dot(acc, acc)

    return {
        "fused": lambda: ops.aggregate(X, w, out=out, nonfinite="propagate", backend=backend),
        "fused + NaN guard": lambda: ops.aggregate(X, w, out=out, backend=backend),
        "fused (list of clients)": lambda: ops.aggregate(rows_list, w, out=out, nonfinite="propagate",
                                                         backend=backend),
        "w @ X + norms": matmul_norms,
        "stack + w @ X + norms": stack_matmul_norms,
        "loop add_ + norms": loop,
        FLOOR: lambda: torch.sum(X, dim=0),
        TORCH_ANCHOR: lambda: torch.stack(rows_list).sum(0),
    }


def bench_aggregate(C: int, N: int, *, label: str, backend: Optional[str] = None, device="cpu",
                    repeats: int = 11, cache: str = "cold", deferred: Optional[list] = None) -> list:
    """``cache``: "cold" (every timed call starts from memory) or "warm" (each is preceded
    by an untimed call of itself, for data that fits in the caches); see ``interleaved``.
    ``deferred``: where the launch counting waits (``timing.defer_launch_columns``)."""
    if cache not in ("cold", "warm"):
        raise ValueError(f"cache must be 'cold' or 'warm', got {cache!r}")
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(C, N, generator=g).to(device)
    w = torch.rand(C, generator=g).to(device)
    w = w / w.sum()
    out = torch.empty(N, device=device)
    candidates = aggregate_candidates(X, w, out, backend=backend)
    times = interleaved(candidates, repeats=repeats, device=device, warm_cache=cache == "warm",
                        cold_cache=cache == "cold")
    # minimum traffic: every client read once, out written once
    rows = ratio_rows(f"aggregate {label}", times, base=FLOOR, fused="fused",
                      traffic_bytes=(C + 1) * N * X.element_size(), device=device, torch_anchor=TORCH_ANCHOR)
    return defer_launch_columns(rows, candidates, device, deferred)
