"""pytest-benchmark cases for the fused aggregation (``pytest bench/ --benchmark-only``).
No time is asserted; ``test_interleaved_ratios`` records ratios vs the floor."""

import pytest
import torch

from fedopt_kernels import ops
from fedopt_kernels.benchmarks.aggregate import bench_aggregate
from fedopt_kernels.benchmarks.shapes import numel, resnet18_shapes, small_cnn_shapes
from fedopt_kernels.benchmarks.suite import print_table

SETTINGS = {"20xresnet18": (20, numel(resnet18_shapes())), "100xsmall_cnn": (100, numel(small_cnn_shapes()))}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", ["fused", "matmul_norms", "floor"])
def test_aggregate(benchmark, setting, case):
    C, N = SETTINGS[setting]
    benchmark.group = f"aggregate {setting}"
    X = torch.randn(C, N)
    w = torch.full((C,), 1.0 / C)
    out = torch.empty(N)
    if case == "fused":
        benchmark(lambda: ops.aggregate(X, w, out=out, nonfinite="propagate"))
    elif case == "matmul_norms":
        benchmark(lambda: (torch.mv(X.t(), w), (X * X).sum(1)))
    else:
        benchmark(lambda: torch.sum(X, dim=0))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_interleaved_ratios(benchmark, setting):
    C, N = SETTINGS[setting]
    rows = benchmark.pedantic(lambda: bench_aggregate(C, N, label=setting), rounds=1, iterations=1)
    benchmark.extra_info.update({r["case"]: {"ms": r["ms"], "vs floor": r["vs floor"]} for r in rows})
    print_table(rows)
