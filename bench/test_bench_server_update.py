"""pytest-benchmark cases for the fused server step (``pytest bench/ --benchmark-only``).
No time is asserted; ``test_interleaved_ratios`` records the ratios of one run."""

import pytest

from fedopt_kernels.benchmarks.server_update import bench_server_update
from fedopt_kernels.benchmarks.shapes import resnet18_shapes, small_cnn_shapes
from fedopt_kernels.benchmarks.suite import print_table

SETTINGS = {"resnet18": resnet18_shapes, "small_cnn": small_cnn_shapes}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_interleaved_ratios(benchmark, setting):
    rows = benchmark.pedantic(lambda: bench_server_update(SETTINGS[setting](), label=setting, repeats=5),
                              rounds=1, iterations=1)
    benchmark.extra_info.update({r["case"]: {"ms": r["ms"], "time / fused": r["time / fused"]} for r in rows})
    print_table(rows)
