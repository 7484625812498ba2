"""What is specific to the ``triton`` backend's FedNAR and aggregation kernels: the
chunk and client tables (layout, per-chunk alignment flags, the cache), the
table-free ``[C, N]`` form, kernel specialisation (float hyperparameters are runtime
fp64 arguments), and on a GPU that no call synchronises with the host.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py
sets TRITON_INTERPRET=1 before any kernel is defined); with one they run compiled on
CUDA tensors.  The backend contract (python_ref's results, odd sizes, misaligned views,
non-finite values, skip flags, determinism, the finalize pass, ...) is checked for
every backend by tests/test_contract_nar_step.py and test_contract_aggregate.py; the
AOT compile of every kernel variant by tests/test_triton_aot.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import python_ref.aggregation as ref_agg
from conftest import import_triton_module
from fedopt_kernels import ops

TB = import_triton_module("fedopt_kernels.backends.triton")
_tables = importlib.import_module("fedopt_kernels.backends.triton._tables")
_chunks = importlib.import_module("fedopt_kernels.backends._chunks")
_nar_kernels = importlib.import_module("fedopt_kernels.backends.triton.nar_step")
_agg_kernels = importlib.import_module("fedopt_kernels.backends.triton.aggregate")


@pytest.fixture(scope="module")
def dev(triton_device):
    return triton_device


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # every test sees the same data whatever the order


def make(shapes, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(dtype).to(device) for s in shapes]


# ----------------------------------------------------------------------------- tables

def test_nar_table_alignment_is_decided_per_chunk(dev):
    """Vector width is decided per chunk: a view 4 bytes past a 16-byte boundary gets
    the scalar body on its chunks only; an aligned tensor of the same call keeps the
    vector body (flag bit 0 of its rows)."""
    base_x, base_g = torch.randn(10001, device=dev), torch.randn(10001, device=dev)
    x, g = base_x[1:], base_g[1:]  # 4 bytes past a 16-byte boundary
    assert x.data_ptr() % 16 == 4
    y, gy = torch.randn(5000, device=dev), torch.randn(5000, device=dev)
    table = _tables.nar_table([x, y], [g, gy], [])
    flags = table.chunks[:, _chunks.COL_FLAGS].tolist()
    assert flags == [0] * 5 + [_chunks.FLAG_ALIGNED16] * 3, flags  # 10000 -> 5 chunks, 5000 -> 3
    assert _tables.nar_table([x], [g.clone()], []).chunks[:, _chunks.COL_FLAGS].eq(0).all()


def test_table_cache_hit_and_layout(dev):
    _tables.clear_cache()
    shapes = [(2048 * 3 + 1,), (0,), (7,)]
    params, grads = make(shapes, torch.float32, dev, 26), make(shapes, torch.float32, dev, 27)
    t1 = _tables.nar_table(params, grads, [])
    t2 = _tables.nar_table(params, grads, [])
    assert t1 is t2 and _tables.stats["hits"] == 1 and _tables.stats["misses"] == 1
    ch = t1.chunks.cpu()
    assert t1.chunk_size == 2048 and t1.n_chunks == 5 and ch.shape == (5, _chunks.ROW_COLS)
    assert ch[:, _chunks.COL_LEN].tolist() == [2048, 2048, 2048, 1, 7]
    assert ch[3, 0] == params[0].data_ptr() + 3 * 2048 * 4 and ch[4, 1] == grads[2].data_ptr()
    assert (ch[:, 2] == 0).all() and (ch[:, 3] == 0).all()  # no momentum buffer, no 4th array
    assert (ch[:, _chunks.COL_GROUP] == 0).all() and t1.groups.tolist() == [[0, 5]]


def test_nar_step_batched_builds_no_table(dev):
    """The [C, N] form is table-free: nothing is built or looked up (capturable on any
    stream)."""
    X, G = torch.randn(3, 20000, device=dev), torch.randn(3, 20000, device=dev)
    wd = torch.tensor([0.0, 0.1, 1.0], device=dev)
    _tables.clear_cache()
    TB.nar_step_batched_(X.clone(), G, None, 0.1, None, 0.0, wd, 50.0, 0, 0.0, None, None)
    assert _tables.stats["hits"] == 0 and _tables.stats["misses"] == 0


def test_client_table_alignment_is_decided_per_client(dev):
    base = torch.randn(3, 5000, device=dev)
    clients = [base[0, 1:], base[1, 1:], base[2, :4999]]  # two start 4 bytes past 16
    flags = _tables.client_table(clients).addrs[:, 1].tolist()
    assert flags == [0, 0, _chunks.FLAG_ALIGNED16]


# ----------------------------------------------------------------------------- specialisation

def test_float_hyperparameters_are_runtime_fp64_args():
    """Float hyperparameters are declared fp64 (never value-specialized, never constexpr):
    a new lr reuses the compiled kernel."""
    for kernel, names in [(_nar_kernels.nar_update_kernel, ["lr_value", "wd_value", "max_norm", "momentum"]),
                          (_nar_kernels.nar_norm_kernel, ["wd_value"]),
                          (_agg_kernels.aggregate_kernel, ["gamma_value"])]:
        fn = getattr(kernel, "fn", kernel)
        ann = {k: str(v) for k, v in fn.__annotations__.items()}
        for n in names:
            assert "fp64" in ann[n] or "float64" in ann[n], (kernel, n, ann[n])
            assert "constexpr" not in ann[n]


# ----------------------------------------------------------------------------- through the ops layer
# Two ops-level checks that came with this file's Triton cases (the backend-independent
# matrices of tests/test_aggregate.py and test_weighted_sum.py hold the rest).

def test_aggregate_exclude_reruns_with_the_skip_flag_read_in_kernel(dev):
    """ops.aggregate's default nonfinite="exclude" re-runs with skip = (no weight changed),
    read in the kernel: the NaN client is excluded, the rest aggregated as the
    reference backend does."""
    X = torch.randn(3, 4099, device=dev)
    X[1, 17] = float("nan")
    X[1, 4098] = float("inf")
    o_e, st_e = ops.aggregate(X, torch.tensor([0.6, 0.2, 0.2], device=dev), backend="triton")
    o_x, st_x = ops.aggregate(X, torch.tensor([0.6, 0.2, 0.2], device=dev), backend="reference")
    assert st_e.excluded.tolist() == [False, True, False]
    torch.testing.assert_close(o_e, o_x)
    torch.testing.assert_close(st_e.sq_norm, st_x.sq_norm, rtol=2e-5, atol=0)


def test_weighted_sum_gradients(dev):
    X = torch.randn(3, 2049, device=dev)
    w = torch.tensor([0.2, 0.3, 0.5], device=dev, requires_grad=True)
    gamma = torch.tensor(0.9, device=dev, requires_grad=True)
    G = torch.randn(2049, device=dev)
    out = ops.weighted_sum(X, w, gamma, backend="triton")
    (out * G).sum().backward()
    gw, gg = ref_agg.weighted_sum_backward(X, w.detach(), gamma.detach(), G)
    torch.testing.assert_close(w.grad, gw, rtol=1e-4, atol=1e-3)  # dots of ~2000 terms in fp32
    torch.testing.assert_close(gamma.grad, gg, rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------- CUDA only

@pytest.mark.cuda
def test_no_host_sync_on_cuda(dev):
    if dev.type != "cuda":
        pytest.skip("needs the compiled kernels on a CUDA device")
    params = [torch.randn(1000, device=dev), torch.randn(3, 3, device=dev)]
    grads = [torch.randn_like(p) for p in params]
    X = torch.randn(3, 1000, device=dev)
    w = torch.tensor([0.2, 0.3, 0.5], device=dev)
    lr, flag, g = torch.tensor(0.2, device=dev), torch.tensor(False, device=dev), torch.randn(1000, device=dev)
    # warm up (compiles the kernels and builds the tables), then no call may synchronise
    TB.nar_step_(params, grads, [], 0.1, None, 0.01, None, 1.0, 0, 0.0, None, None)
    TB.nar_step_(params, grads, [], 0.0, lr, 0.01, None, 1.0, 0, 0.0, None, None)
    TB.aggregate(X, w, 1.0, None, torch.empty(1000, device=dev), flag)
    TB.client_dots(X, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TB.nar_step_(params, grads, [], 0.0, lr, 0.01, None, 1.0, 0, 0.0, None, None)
        TB.nar_step_(params, grads, [], 0.3, None, 0.01, None, 1.0, 0, 0.0, None, None)
        TB.aggregate(X, w, 1.0, None, torch.empty(1000, device=dev), flag)
        TB.client_dots(X, g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
