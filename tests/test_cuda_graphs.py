"""CUDA-graph capture and the device table cache (needs a CUDA device; skipped otherwise).

What is capturable: every op whose work layout needs no host table --
``nar_step_batched_`` (e.g. on a ``[1, N]`` view of flat parameters) and ``aggregate``
on a ``[C, N]`` tensor -- on the cuda and triton backends, and the list forms after one
warm-up call on the same tensors, whose tables are then cached on the device (triton:
its table cache; cuda: the device table cache of csrc/include/fedopt/table_cache.h,
keyed by device and table CONTENT, not by stream, so the warm-up on any stream serves
the capture on torch.cuda.graph's side stream).  A cuda list form captured without a
warm-up fails with a message saying to run the same call once before capturing.

The cache tests of the cuda backend use its diagnostic ops
(``torch.ops.fedopt_C._cuda_table_cache_info`` / ``_cuda_table_cache_clear``): a table
uploaded on one stream and used on another must be waited for (a missing
cudaStreamWaitEvent reads the table before its copy has run: the upload is queued behind
a long sleep kernel here), the cache is bounded, and entries used by a capture survive.
"""

from __future__ import annotations

import pytest
import torch

from fedopt_kernels import ops
from fedopt_kernels.backends import triton_interpret_mode, why_unavailable
from _asserts import same_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MISS_DURING_CAPTURE = r"run the same call \(the same tensors\) once before capturing"


def _need(backend):
    if backend == "triton" and triton_interpret_mode():
        pytest.skip("TRITON_INTERPRET=1 is set")
    reason = why_unavailable(backend, torch.device("cuda"))
    if reason is not None:
        pytest.fail(f"backend {backend!r} should run on this CUDA machine: {reason}")


def _cuda_backend():
    _need("cuda")
    from fedopt_kernels.backends import cuda

    return cuda


def _cache_info():
    entries, captured, hits, misses, capacity = torch.ops.fedopt_C._cuda_table_cache_info()
    return dict(entries=entries, captured=captured, hits=hits, misses=misses, capacity=capacity)



def _lists(shapes, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(dtype).cuda() for s in shapes] for _ in range(3)]


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


def test_cuda_list_form_capture_without_warm_up_fails_clearly():
    cuda = _cuda_backend()
    params, grads, _ = _lists([(10,), (20,)], seed=1)
    before = [p.clone() for p in params]
    torch.ops.fedopt_C._cuda_table_cache_clear()  # no table of an earlier test can serve this call
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=MISS_DURING_CAPTURE):
        with torch.cuda.graph(graph):
            cuda.nar_step_(params, grads, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    torch.cuda.synchronize()
    assert all(same_bits(p, b) for p, b in zip(params, before))
    # The same call eagerly (the warm-up) works, and then so does the capture.
    cuda.nar_step_([p.clone() for p in params], grads, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None,
                   None)  # other tensors
    with pytest.raises(RuntimeError, match=MISS_DURING_CAPTURE):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            cuda.nar_step_(params, grads, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    cuda.nar_step_(params, grads, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        cuda.nar_step_(params, grads, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_host_weights_under_capture_are_refused_by_name(backend):
    """Weights given as numbers (or a CPU tensor) need a host-to-device copy, which a
    CUDA graph cannot record: the op says which argument to pass on the device, and
    the same call with device weights captures and replays."""
    _need(backend)
    X = torch.randn(3, 5000, device="cuda")
    for weights in ([1.0, 2.0, 3.0], torch.tensor([1.0, 2.0, 3.0])):
        with pytest.raises(ValueError, match=r"weights is a CPU tensor .* pass weights as a tensor on cuda"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                ops.aggregate(X, weights, backend=backend)
        torch.cuda.synchronize()
    w = torch.tensor([1.0, 2.0, 3.0], device="cuda")
    ops.aggregate(X, w, backend=backend)  # warm-up on the side stream's allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = ops.aggregate(X, w, backend=backend)
    w.copy_(torch.tensor([0.5, 0.0, 2.0]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 0.5 * X[0] + 2.0 * X[2])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_cuda_list_form_captures_after_warm_up_and_replays_with_new_lr(momentum):
    """nar_step_ on a list, captured after one eager warm-up call on the same tensors (on
    a side stream: the cache key is not the stream), replayed with new values of a
    device lr tensor: bitwise the eager steps from the same values."""
    cuda = _cuda_backend()
    shapes = [(1000,), (37, 5), (70_001,), (3, 3, 3, 64)]
    params, grads, bufs = _lists(shapes, seed=2)
    start_p, start_b = [p.clone() for p in params], [b.clone() for b in bufs]
    lr, wd = torch.tensor(0.1, device="cuda"), torch.tensor(0.01, device="cuda")
    b_arg = bufs if momentum else []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up: caches the table
        cuda.nar_step_(params, grads, b_arg, 0.0, lr, 0.0, wd, 1.0, 0, momentum, None, None)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    captured_before = _cache_info()["captured"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm, scale, skipped = cuda.nar_step_(params, grads, b_arg, 0.0, lr, 0.0, wd, 1.0, 0, momentum, None, None)
    assert _cache_info()["captured"] == captured_before + 1  # pinned: the graph replays its address
    torch.ops.fedopt_C._cuda_table_cache_clear()  # must not free it
    for p, b, p0, b0 in zip(params, bufs, start_p, start_b):
        p.copy_(p0)
        b.copy_(b0)
    exp_p, exp_b = [p.clone() for p in start_p], [b.clone() for b in start_b]
    for value in (0.1, 0.05, 0.2):
        lr.fill_(value)
        graph.replay()
        ref = cuda.nar_step_(exp_p, grads, exp_b if momentum else [], value, None, 0.01, None, 1.0, 0, momentum,
                             None, None)
        torch.cuda.synchronize()
        assert same_bits(norm, ref[0]) and same_bits(scale, ref[1]) and not bool(skipped)
        for a, e in zip(params + (bufs if momentum else []), exp_p + (exp_b if momentum else [])):
            assert same_bits(a, e)


def test_cuda_sq_norm_and_apply_capture_after_warm_up():
    """The two halves of a shared-norm step (ops.nar_step_groups_) capture too."""
    cuda = _cuda_backend()
    params, grads, _ = _lists([(5000,), (17,)], seed=3)
    start = [p.clone() for p in params]
    cuda.nar_apply_(params, grads, [], cuda.nar_sq_norm(params, grads, 0.01, None, 0, None), 0.1, None, 0.01, None,
                    1.0, 0, 0.0, None, None)  # warm-up: one table serves both (same content)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sq = cuda.nar_sq_norm(params, grads, 0.01, None, 0, None)
        cuda.nar_apply_(params, grads, [], sq, 0.1, None, 0.01, None, 1.0, 0, 0.0, None, None)
    for p, s in zip(params, start):
        p.copy_(s)
    graph.replay()
    expected = [s.clone() for s in start]
    cuda.nar_step_(expected, grads, [], 0.1, None, 0.01, None, 1.0, 0, 0.0, None, None)
    torch.cuda.synchronize()
    assert all(same_bits(a, e) for a, e in zip(params, expected))


def test_cuda_server_update_captures_after_warm_up():
    cuda = _cuda_backend()
    shapes = [(1025,), (33, 31), (70_001,)]
    params, exp_avg, exp_avg_sq = _lists(shapes, seed=4)
    exp_avg_sq = [v.abs() + 0.01 for v in exp_avg_sq]
    flat = torch.randn(1 + sum(p.numel() for p in params), device="cuda") * 0.1
    updates, at = [], 1  # views of one flat vector at odd offsets, as the ops layer passes them
    for p in params:
        updates.append(flat[at:at + p.numel()].view(p.shape))
        at += p.numel()
    state = params + exp_avg + exp_avg_sq
    start = [t.clone() for t in state]
    lr = torch.tensor(0.3, device="cuda")
    skip = torch.tensor(False, device="cuda")
    args = (3, 0.0, lr, 1.0, None, 0.8, 0.95, 1e-2, False)
    cuda.server_update_(params, updates, exp_avg, exp_avg_sq, *args, skip)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda.server_update_(params, updates, exp_avg, exp_avg_sq, *args, skip)
    for t, s in zip(state, start):
        t.copy_(s)
    expected = [s.clone() for s in start]
    T = len(params)
    for value in (0.3, 0.1):
        lr.fill_(value)
        graph.replay()
        cuda.server_update_(expected[:T], updates, expected[T:2 * T], expected[2 * T:], 3, value, None, 1.0, None,
                            0.8, 0.95, 1e-2, False, None)
        torch.cuda.synchronize()
        assert all(same_bits(a, e) for a, e in zip(state, expected))
    skip.fill_(True)  # read on the device at replay: nothing is written
    before = [t.clone() for t in state]
    graph.replay()
    torch.cuda.synchronize()
    assert all(same_bits(a, b) for a, b in zip(state, before))


def test_cuda_list_form_aggregate_and_client_dots_capture_after_warm_up():
    cuda = _cuda_backend()
    C, N = 40, 10_001
    gen = torch.Generator().manual_seed(5)
    clients = [torch.randn(N, generator=gen).cuda() for _ in range(C)]
    weights = torch.rand(C, generator=gen).cuda()
    out = torch.empty(N, device="cuda")
    g = torch.randn(N, generator=gen).cuda()
    cuda.aggregate(clients, weights, 1.0, None, out, None)  # warm-up: caches the address table
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, Q = cuda.aggregate(clients, weights, 1.0, None, out, None)
        d = cuda.client_dots(clients, g)  # the same addresses: the same table
    for k in range(2):
        weights.copy_(torch.rand(C, generator=gen).cuda())
        graph.replay()
        out_e = torch.empty(N, device="cuda")
        q_e, Q_e = cuda.aggregate(clients, weights, 1.0, None, out_e, None)
        d_e = cuda.client_dots(clients, g)
        torch.cuda.synchronize()
        assert same_bits(out, out_e) and same_bits(q, q_e) and same_bits(Q, Q_e) and same_bits(d, d_e)


def test_cuda_table_cache_hits_by_content_and_is_bounded():
    cuda = _cuda_backend()
    params, grads, _ = _lists([(100,), (7, 3)], seed=6)
    torch.ops.fedopt_C._cuda_table_cache_clear()
    cuda.nar_step_(params, grads, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    cuda.nar_step_(params, grads, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    cuda.nar_sq_norm(params, grads, 0.0, None, 0, None)  # the same rows: the same entry
    info = _cache_info()
    assert (info["misses"], info["hits"], info["entries"]) == (1, 2, 1)
    keep = []
    for k in range(info["capacity"] + 10):  # distinct tables: at most `capacity` stay
        ps = [torch.randn(100 + k, device="cuda")]
        keep.append(ps)
        cuda.nar_sq_norm(ps, ps, 0.0, None, 0, None)
    info = _cache_info()
    assert info["entries"] == info["capacity"]
    assert info["misses"] == 1 + info["capacity"] + 10
    torch.cuda.synchronize()


def test_cuda_table_uploaded_on_one_stream_used_on_another():
    """A table uploaded on stream A is a cache hit on stream B; B must wait for A's copy
    (cudaStreamWaitEvent), which is queued behind a ~50 ms sleep kernel here: a kernel on
    B reading the table without that wait would read it before it exists."""
    cuda = _cuda_backend()
    params, grads, _ = _lists([(70_001,), (1025,), (5,)], seed=7)
    C, N = 5, 30_000
    clients = [torch.randn(N, device="cuda") for _ in range(C)]
    g = torch.randn(N, device="cuda")
    torch.cuda.synchronize()
    torch.ops.fedopt_C._cuda_table_cache_clear()
    A, B = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(A):
        torch.cuda._sleep(100_000_000)
        sq_a = cuda.nar_sq_norm(params, grads, 0.01, None, 0, None)  # misses: uploads on A, behind the sleep
        d_a = cuda.client_dots(clients, g)
    with torch.cuda.stream(B):
        sq_b = cuda.nar_sq_norm(params, grads, 0.01, None, 0, None)  # hits, from B
        d_b = cuda.client_dots(clients, g)
    info = _cache_info()
    assert (info["misses"], info["hits"]) == (2, 2)
    torch.cuda.synchronize()
    assert same_bits(sq_a, sq_b) and same_bits(d_a, d_b)
    expected_sq = sum(float((gr.double() + 0.01 * p.double()).square().sum()) for p, gr in zip(params, grads))
    assert abs(float(sq_b) - expected_sq) <= 1e-4 * expected_sq
    torch.testing.assert_close(d_b, torch.stack([c @ g for c in clients]), rtol=1e-4, atol=1e-3)


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
