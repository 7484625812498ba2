"""Benchmark of the C++ CPU kernels against their floors: the memory traffic of the
same operation done by ATen primitives on flat buffers of the same size.

Run (python_ref's formulas come from :mod:`fedopt_kernels.backends.oracle`):

    python -m fedopt_kernels.benchmarks.cpu_kernels [--reps 15] [--only nar|agg] [--dtype bfloat16]

(``python -m fedopt_kernels.benchmarks.suite --backend cpu`` is the project-wide
suite; this script adds the CPU-specific cases: the backend op next to the ops API, momentum
and mode grad, list vs [C, N] clients, client_dots against MKL's X @ g.)

Every measurement is the median of interleaved repetitions in one process, so that
each timed call starts with the caches full of the other candidates' data (as in
training, where a forward/backward pass separates two steps).

* nar_step_: a ResNet-18 parameter list (62 tensors, 11.18M fp32 parameters), against
  the floor `torch.dot(g, x)` + `x.add_(g, alpha=a)` on flat buffers of the same size
  (the same 5 words per parameter) and against python_ref eager.
* aggregate: 20 clients x 11.18M fp32, against `torch.sum(X, dim=0)` (the floor: each
  client read once, out written once) and against `w @ X` + separate norms.

"speed vs floor" = floor time / candidate time (> 1: faster than the floor).
ATEN_CPU_CAPABILITY=default|avx2|avx512 selects the instruction set of both torch's and
these kernels (the cpu backend's cpu_isa() says which build runs).  "backend op" is the cpu
backend's own function (fedopt_kernels.backends.cpu: the C++ op behind a Python call,
without the ops layer's checks).
"""

from __future__ import annotations

import argparse

import torch

from fedopt_kernels import backends, ops
from fedopt_kernels.backends.oracle import fednar as ref_nar
from fedopt_kernels.benchmarks.shapes import resnet18_shapes
from fedopt_kernels.benchmarks.timing import interleaved


def cpu_backend():
    """The cpu backend module (loads the extension; raises if it cannot run here)."""
    return backends.resolve("cpu", torch.device("cpu"))


def run_interleaved(cands: dict, reps: int) -> dict:
    return interleaved(cands, repeats=reps, warmup=1)


def bench_nar(reps: int, dtype=torch.float32) -> None:
    shapes = resnet18_shapes()
    gen = torch.Generator().manual_seed(0)
    P = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    G = [torch.randn(s, generator=gen, dtype=dtype) * 1e-3 for s in shapes]
    B = [torch.zeros(s, dtype=dtype) for s in shapes]
    n = sum(p.numel() for p in P)
    x = torch.randn(n, generator=gen, dtype=dtype)
    g = torch.randn(n, generator=gen, dtype=dtype) * 1e-3
    lr = torch.tensor(1e-6)  # tiny steps keep the params in range over many reps
    print(f"nar_step_: {len(P)} tensors, {n / 1e6:.2f}M params, {dtype}, {torch.get_num_threads()} threads")

    def floor():
        torch.dot(g, x)
        x.add_(g, alpha=-1e-6)

    raw = cpu_backend().nar_step_
    cands = {
        "floor dot+add_": floor,
        "fused backend op (co)": lambda: raw(P, G, [], 0.0, lr, 0.0, torch.tensor(5e-4), 10.0, 0, 0.0, None, None),
        "fused ops.nar_step_ (co)": lambda: ops.nar_step_(P, G, lr=lr, weight_decay=5e-4, max_norm=10.0,
                                                          backend="cpu"),
        "fused backend op (co, momentum)": lambda: raw(P, G, B, 0.0, lr, 0.0, torch.tensor(5e-4), 10.0, 0, 0.9,
                                                   None, None),
        "fused backend op (grad)": lambda: raw(P, G, [], 0.0, lr, 0.0, torch.tensor(5e-4), 10.0, 1, 0.0, None, None),
        "python_ref eager (co)": lambda: ref_nar.nar_step_(P, G, lr=lr, weight_decay=5e-4, max_norm=10.0),
    }
    med = run_interleaved(cands, reps)
    base = med["floor dot+add_"]
    for k, t in med.items():
        print(f"  {k:32s} {t * 1e3:8.2f} ms   speed vs floor {base / t:5.2f}   "
              f"vs python_ref {med['python_ref eager (co)'] / t:6.2f}x")


def bench_agg(reps: int, C: int = 20, dtype=torch.float32) -> None:
    n = sum(torch.Size(s).numel() for s in resnet18_shapes())
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(C, n, generator=gen, dtype=dtype)
    rows = list(X.unbind(0))
    w = torch.rand(C, generator=gen, dtype=torch.float32) + 0.1
    out = torch.empty(n, dtype=dtype)
    gvec = torch.randn(n, generator=gen, dtype=dtype)
    print(f"aggregate: {C} clients x {n / 1e6:.2f}M, {dtype}, {torch.get_num_threads()} threads")
    raw = cpu_backend().aggregate

    def unfused():
        total = w.to(dtype) @ X
        q = (X.float() * X.float()).sum(dim=1) if dtype != torch.float32 else torch.linalg.vector_norm(X, dim=1) ** 2
        return total, q, torch.dot(total, total)

    cands = {
        "floor torch.sum(X, 0)": lambda: torch.sum(X, dim=0),
        "fused backend op, 2-D": lambda: raw([X], w, 1.0, None, out, None),
        "fused backend op, list": lambda: raw(rows, w, 1.0, None, out, None),
        "fused ops.aggregate (propagate)": lambda: ops.aggregate(X, w, out=out, nonfinite="propagate",
                                                                 backend="cpu"),
        "unfused w @ X + norms": unfused,
        "client_dots backend op": lambda: cpu_backend().client_dots([X], gvec),
        "X @ g (client_dots floor)": lambda: X @ gvec,
    }
    med = run_interleaved(cands, reps)
    base = med["floor torch.sum(X, 0)"]
    for k, t in med.items():
        print(f"  {k:32s} {t * 1e3:8.2f} ms   speed vs floor {base / t:5.2f}   "
              f"vs unfused {med['unfused w @ X + norms'] / t:5.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--only", choices=("nar", "agg"))
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"fedopt CPU kernels {cpu_backend().cpu_isa()}")
    if args.only in (None, "nar"):
        bench_nar(args.reps, dtype)
    if args.only in (None, "agg"):
        bench_agg(args.reps, dtype=dtype)
