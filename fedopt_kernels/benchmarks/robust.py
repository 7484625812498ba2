"""Throughput of the coordinate-wise robust aggregators against the memory-traffic floor
and against what a PyTorch user writes.  Timed interleaved in one run, medians; only
ratios are reported as results.

* ``floor (torch.sum dim 0)``: ``torch.sum(X, dim=0)`` -- reads the ``[C, N]`` clients
  once and writes ``[N]``: the traffic of a one-pass median (C + 1 words per coordinate).
* ``median (fused)`` / ``trimmed mean (fused)``: ``ops.robust_aggregate``'s
  ``coordinate_median`` / ``trimmed_mean(beta)`` (one pass; the NaN check rides along).
* ``torch.median(dim=0)``: the lower median, no NaN exclusion (a smaller job).
* ``sort-based trimmed mean``: ``torch.sort(X, dim=0)`` then the mean of the middle rows
  (what Flower's ``trim_mean`` does in numpy).
* ``Gram (fused, acc-dtype blocks)``: ``client_gram`` on the CPU backend (Krum's, Bulyan's,
  the geometric median's one pass); ``Gram (float64 blocks)``: the same matrix from
  float64 blocks (the reference backend's, and every backend's before the CPU kernel).

Run: ``python -m fedopt_kernels.benchmarks.robust [--clients 20] [--numel 11200000]``.
"""

from __future__ import annotations

import argparse
import math
import platform

import torch

from ..ops import robust_aggregate as R
from .timing import interleaved

FLOOR = "floor (torch.sum dim 0)"
GRAM = "Gram (fused, acc-dtype blocks)"
GRAM64 = "Gram (float64 blocks)"


def candidates(X: torch.Tensor, beta: float, backend=None) -> dict:
    C = X.shape[0]
    k = math.floor(beta * C)
    out = torch.empty(X.shape[1], dtype=X.dtype, device=X.device)

    def sort_trimmed():
        v = torch.sort(X, dim=0).values
        return v[k:C - k].mean(dim=0)

    return {
        FLOOR: lambda: torch.sum(X, dim=0),
        "median (fused)": lambda: R.coordinate_median(X, out=out, backend=backend),
        f"trimmed mean beta={beta} (fused)": lambda: R.trimmed_mean(X, beta, out=out, backend=backend),
        "torch.median(dim=0)": lambda: torch.median(X, dim=0),
        "sort-based trimmed mean": sort_trimmed,
        GRAM: lambda: R.client_gram(X, backend=backend),
        GRAM64: lambda: R.client_gram(X, backend="reference"),
    }


def bench(C: int = 20, N: int = 11_200_000, beta: float = 0.1, dtype=torch.float32, repeats: int = 5,
          backend=None) -> dict:
    X = torch.randn(C, N, generator=torch.Generator().manual_seed(0), dtype=torch.float32).to(dtype)
    times = interleaved(candidates(X, beta, backend), repeats=repeats, warmup=1)
    floor = times[FLOOR]
    traffic = (C + 1) * N * X.element_size()
    rows = {name: dict(seconds=t, vs_floor=t / floor, gb_s=traffic / t / 1e9) for name, t in times.items()}
    fused_med = times["median (fused)"]
    fused_trim = times[f"trimmed mean beta={beta} (fused)"]
    return dict(C=C, N=N, dtype=str(dtype), threads=torch.get_num_threads(), cpu=platform.processor(),
                rows=rows, median_speedup_vs_torch=times["torch.median(dim=0)"] / fused_med,
                trimmed_speedup_vs_sort=times["sort-based trimmed mean"] / fused_trim,
                gram_speedup_vs_float64=times[GRAM64] / times[GRAM])


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--numel", type=int, default=11_200_000)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    r = bench(a.clients, a.numel, a.beta, repeats=a.repeats)
    print(f"C={r['C']} N={r['N']} {r['dtype']} threads={r['threads']}")
    for name, row in r["rows"].items():
        print(f"  {name:36s} {row['seconds'] * 1e3:9.1f} ms  {row['vs_floor']:6.2f}x floor  {row['gb_s']:6.2f} GB/s")
    print(f"  fused median vs torch.median(dim=0): {r['median_speedup_vs_torch']:.2f}x faster")
    print(f"  fused trimmed mean vs sort-based:    {r['trimmed_speedup_vs_sort']:.2f}x faster")
    print(f"  fused Gram vs float64 blocks:        {r['gram_speedup_vs_float64']:.2f}x faster")


if __name__ == "__main__":
    main()
