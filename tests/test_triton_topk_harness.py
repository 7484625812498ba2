"""The Triton top-k encode (backends/triton/topk_encode.py) compiled for the device and
executed by tools/gpu_harness -- on a GPU, or on the PTX simulator that
``FEDOPT_CUDA_SIM_ENV`` names (tests/_gpu_harness.py) -- through the backend's own
wrapper: its 8 histogram + pick passes, then count, scan and write, each launch compiled
ahead of time for the device's arch and its arrays copied back, as
tests/test_gpu_harness.py's table-driven Triton cases do.  The indices and values are
held to python_ref's stable sort bit for bit: fp32 with ties that reach the index
digits, NaN, +-Inf and +-0, and bf16 (passed as bits) with subnormals.  Skips, saying
why, where no CUDA runtime can run kernels (the fixtures are test_gpu_harness.py's)."""

from __future__ import annotations

import pytest
import torch

from conftest import import_triton_module

import_triton_module("triton")

from test_gpu_harness import _on_harness, binary, run, triton_archs  # noqa: E402,F401  (fixtures)

from fedopt_kernels.backends import compressed as compressed_backend  # noqa: E402
from fedopt_kernels.backends.triton import topk_encode as K  # noqa: E402
from python_ref import compression as codec_ref  # noqa: E402


def harness_input(dtype) -> torch.Tensor:
    """3 tiles (the last a tail): a run of equal magnitudes that the k-th falls inside,
    NaN, +-Inf, +-0, subnormals, the rest distinct."""
    N = 2 * K.TOPK_BLOCK + 37
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, generator=g, dtype=torch.float64) * 0.1
    x[50:1500:3] = 0.75
    x[51:1500:6] = -0.75
    x[[7, 2000]] = float("nan")
    x[[9, 1800]] = torch.tensor([float("inf"), -float("inf")], dtype=torch.float64)
    x[[10, 11]] = torch.tensor([0.0, -0.0], dtype=torch.float64)
    x[12:20] = torch.arange(1, 9, dtype=torch.float64) * 1e-40
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_topk_encode_compiled(run, dtype, monkeypatch):
    # The harness reads every int64 tensor argument as a possible table of host addresses
    # (tests/_triton_on_harness.py) and refuses a word that looks like one outside the given
    # tensors; the wrapper's int64 output (torch.empty) can hold such leftover bytes, so
    # int64 buffers are allocated zeroed here (the kernels write every element of it).
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (torch.zeros if kw.get("dtype") == torch.int64 else empty)(
        *a, **kw))
    x = harness_input(dtype)
    encode = compressed_backend.topk_encode("triton")
    runs = 0
    for arch in triton_archs(run):
        for k in (3, 200):  # 3: NaNs and Infs decide; 200: the k-th inside the run of 0.75s
            want_v, want_i = codec_ref.topk_encode(x, k)
            with _on_harness(run, arch, []) as log:
                values, indices = encode(x, k)
            kernels = [name for name, _, _ in log]
            assert kernels == (["topk_histogram_kernel", "topk_pick_kernel"] * K.TOPK_PASSES
                               + ["topk_count_kernel", "topk_scan_kernel", "topk_write_kernel"]), kernels
            assert torch.equal(indices, want_i), (arch, dtype, k)
            assert torch.equal(values.view(torch.int32), want_v.view(torch.int32)), (arch, dtype, k)
            runs += 1
    assert runs
