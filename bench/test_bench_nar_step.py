"""pytest-benchmark cases for the FedNAR step (run: ``make bench`` or
``pytest bench/ --benchmark-only``).  A benchmark, not a test: nothing here asserts a
time.  ``test_interleaved_ratios`` times all candidates round-robin in one run and
records the ratios (speed vs the memory-traffic floor) in ``extra_info``."""

import pytest
import torch

import python_ref.fednar as ref
from fedopt_kernels import ops
from fedopt_kernels.benchmarks.nar_step import HYPER, _make, bench_nar_step, foreach_nar_step_
from fedopt_kernels.benchmarks.shapes import numel, resnet18_shapes, small_cnn_shapes
from fedopt_kernels.benchmarks.suite import print_table

MODELS = {"resnet18": resnet18_shapes(), "small_cnn": small_cnn_shapes()}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("case", ["fused", "python_ref", "foreach", "floor"])
def test_nar_step(benchmark, model, case):
    benchmark.group = f"nar_step {model}"
    params, grads = _make(MODELS[model], "cpu")
    lrs = iter([0.01 * 0.999 ** i for i in range(10 ** 7)])
    if case == "fused":
        benchmark(lambda: ops.nar_step_(params, grads, lr=next(lrs), **HYPER))
    elif case == "python_ref":
        benchmark(lambda: ref.nar_step_(params, grads, lr=next(lrs), **HYPER))
    elif case == "foreach":
        benchmark(lambda: foreach_nar_step_(params, grads, lr=next(lrs), **HYPER))
    else:
        n = numel(MODELS[model])
        x, g = torch.randn(n), torch.randn(n) * 1e-3
        benchmark(lambda: (torch.dot(g, x), x.add_(g, alpha=-1e-6)))


@pytest.mark.parametrize("model", list(MODELS))
def test_interleaved_ratios(benchmark, model):
    rows = benchmark.pedantic(lambda: bench_nar_step(MODELS[model], label=model, include_compile=True),
                              rounds=1, iterations=1)
    benchmark.extra_info.update({r["case"]: {"ms": r["ms"], "vs floor": r["vs floor"]} for r in rows})
    print_table(rows)
