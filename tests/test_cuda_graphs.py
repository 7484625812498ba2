"""CUDA-graph capture of a FedNAR local step (needs a CUDA device; skipped otherwise).

What is capturable: every op whose work layout needs no host table —
``nar_step_batched_`` (e.g. on a ``[1, N]`` view of flat parameters) and ``aggregate``
on a ``[C, N]`` tensor — on the cuda and triton backends, and the list form on the
triton backend after one warm-up call (its tables are then cached).  The list form on
the cuda backend uploads a table per call and refuses to be captured.
"""

from __future__ import annotations

import pytest
import torch

from fedopt_kernels import ops
from fedopt_kernels.backends import triton_interpret_mode, why_unavailable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _need(backend):
    if backend == "triton" and triton_interpret_mode():
        pytest.skip("TRITON_INTERPRET=1 is set")
    reason = why_unavailable(backend, torch.device("cuda"))
    if reason is not None:
        pytest.fail(f"backend {backend!r} should run on this CUDA machine: {reason}")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_capture_batched_step_on_flat_params_replays_with_new_lr(backend):
    _need(backend)
    torch.manual_seed(0)
    N = 100_003
    x0, g = torch.randn(1, N, device="cuda"), torch.randn(1, N, device="cuda")
    X, lr = x0.clone(), torch.tensor(0.1, device="cuda")
    kw = dict(weight_decay=0.01, max_norm=1.0, backend=backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (compiles Triton kernels) on a side stream
            ops.nar_step_batched_(X.clone(), g, lr=lr, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stats = ops.nar_step_batched_(X, g, lr=lr, **kw)
    expected = x0.clone()
    X.copy_(x0)
    for value in (0.1, 0.05, 0.2):
        lr.fill_(value)
        graph.replay()
        ref_stats = ops.nar_step_batched_(expected, g, lr=value, **kw)
        torch.cuda.synchronize()
        torch.testing.assert_close(X, expected)
        torch.testing.assert_close(stats.norm, ref_stats.norm)


def test_cuda_backend_list_form_refuses_capture():
    _need("cuda")
    params = [torch.randn(10, device="cuda"), torch.randn(20, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    ops.nar_step_(params, grads, lr=0.1, backend="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot replay"):
        with torch.cuda.graph(graph):
            ops.nar_step_(params, grads, lr=0.1, backend="cuda")


def test_triton_list_form_captures_after_warm_up():
    _need("triton")
    torch.manual_seed(1)
    params = [torch.randn(1000, device="cuda"), torch.randn(37, 5, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    start = [p.clone() for p in params]
    lr = torch.tensor(0.1, device="cuda")
    ops.nar_step_([p.clone() for p in params], grads, lr=lr, backend="triton")  # compile
    ops.nar_step_(params, grads, lr=lr, backend="triton")  # warm-up: caches the table for these tensors
    torch.cuda.synchronize()
    for p, s in zip(params, start):
        p.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.nar_step_(params, grads, lr=lr, backend="triton")
    for p, s in zip(params, start):
        p.copy_(s)
    graph.replay()
    expected = [s.clone() for s in start]
    ops.nar_step_(expected, grads, lr=0.1, backend="reference")
    torch.cuda.synchronize()
    for a, b in zip(params, expected):
        torch.testing.assert_close(a, b)
