"""The Triton backend's table cache and the table-free forms (issue 12, items 1 and 8).

* The ``[C, N]`` forms (``nar_step_batched_``, aggregation of a 2-D client tensor) build
  and look up no table at all, so they capture on any stream without a warm-up.
* List-form tables are keyed by device and content: equal tensors hit, whatever the
  stream; the cache is bounded and safe to use from several threads.
* On a GPU (skipped here): a table uploaded on one stream is safe to use on another
  while the upload is still queued behind other work, and the list form captures
  after one warm-up, by hand and under ``torch.compile(mode="reduce-overhead")``.
"""

from __future__ import annotations

import importlib
import re
import threading
from pathlib import Path

import pytest
import torch

from conftest import import_triton_module
from fedopt_kernels import ops

TB = import_triton_module("fedopt_kernels.backends.triton")
_tables = importlib.import_module("fedopt_kernels.backends.triton._tables")
_helpers = importlib.import_module("fedopt_kernels.backends.triton._helpers")
_chunks = importlib.import_module("fedopt_kernels.backends._chunks")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dev(triton_device):
    return triton_device


@pytest.fixture(autouse=True)
def fresh_cache():
    _tables.clear_cache()
    yield
    _tables.clear_cache()


def test_batched_and_2d_forms_use_no_table(dev):
    X, G = torch.randn(3, 5000, device=dev), torch.randn(3, 5000, device=dev)
    ops.nar_step_batched_(X, G, lr=0.1, max_norm=1.0, backend="triton")
    ops.aggregate(X, torch.ones(3, device=dev), backend="triton")
    ops.client_dots(X, G[0], backend="triton")
    assert _tables.stats["hits"] == 0 and _tables.stats["misses"] == 0 and _tables.cache_len() == 0


def test_list_tables_are_keyed_by_content(dev):
    params = [torch.randn(3000, device=dev), torch.randn(5, device=dev)]
    grads = [torch.randn_like(p) for p in params]
    t1 = _tables.nar_table(params, grads, [])
    t2 = _tables.nar_table(list(params), list(grads), [])  # new lists, same tensors
    assert t1 is t2 and _tables.stats["misses"] == 1 and _tables.stats["hits"] == 1
    t3 = _tables.nar_table(params, [g.clone() for g in grads], [])  # other addresses: other content
    assert t3 is not t1 and _tables.stats["misses"] == 2


def test_cache_is_bounded(dev):
    keep = []
    for i in range(_tables.CACHE_SIZE * 3):
        p, g = torch.randn(7 + i, device=dev), torch.randn(7 + i, device=dev)
        keep.append((p, g))  # distinct live addresses: every call a new table
        _tables.nar_table([p], [g], [])
        assert _tables.cache_len() <= _tables.CACHE_SIZE
    assert _tables.stats["misses"] == _tables.CACHE_SIZE * 3
    # the most recent ones are still there, the oldest were evicted
    _tables.nar_table([keep[-1][0]], [keep[-1][1]], [])
    assert _tables.stats["hits"] == 1
    _tables.nar_table([keep[0][0]], [keep[0][1]], [])
    assert _tables.stats["misses"] == _tables.CACHE_SIZE * 3 + 1


class _FakeStream:
    def __init__(self, handle):
        self.cuda_stream, self.waited = handle, []

    def wait_event(self, event):
        self.waited.append(event)


class _FakeDeviceTensor:
    """Stands for an uploaded table (this machine has no CUDA): records record_stream."""

    def __init__(self):
        self.recorded = []

    def record_stream(self, stream):
        self.recorded.append(stream.cuda_stream)


class _PendingEvent:
    def query(self):
        return False  # the upload is still queued behind other work


def test_other_streams_record_the_table_memory_once_each(monkeypatch):
    """The cache's CUDA stream logic, driven by fakes: a table uploaded on stream 1 and
    hit from streams 2 and 3 is recorded on each of them exactly once (so evicting it
    cannot return its memory to stream 1's pool while their kernels still read it) and
    each waits for the upload; hits from the upload's own stream record nothing."""
    streams = {h: _FakeStream(h) for h in (1, 2, 3)}
    current = {"h": 1}
    uploaded = []

    def fake_to_device(rows, device, cols):
        t = _FakeDeviceTensor()
        uploaded.append(t)
        return t, _PendingEvent()

    monkeypatch.setattr(_tables, "_to_device", fake_to_device)
    monkeypatch.setattr(_tables, "_capturing", lambda device: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[current["h"]])
    device = torch.device("cuda", 0)

    def build(upload):
        return (upload([1, 2], 2), upload([3, 4], 2))

    value = _tables._cached(("fake",), device, build)
    assert len(uploaded) == 2 and value == tuple(uploaded)
    for h in (1, 1, 2, 2, 3, 1, 3):
        current["h"] = h
        assert _tables._cached(("fake",), device, build) is value
    assert [t.recorded for t in uploaded] == [[2, 3], [2, 3]]
    assert len(streams[1].waited) == 0 and len(streams[2].waited) == 2 and len(streams[3].waited) == 2
    assert _tables.stats["misses"] == 1 and _tables.stats["hits"] == 7


def _expected_rows(params, grads):
    chunk = _chunks.chunk_size_for(sum(p.numel() for p in params))
    rows, _ = _chunks.build_rows([(p.data_ptr(), g.data_ptr(), 0) for p, g in zip(params, grads)],
                                 (params[0].element_size(),) * 3, [p.numel() for p in params],
                                 [0] * len(params), 1, chunk)
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, _chunks.ROW_COLS)


def _in_threads(work, n: int) -> None:
    """Run ``work(0)`` ... ``work(n - 1)`` in ``n`` threads at once and wait for all."""
    threads = [threading.Thread(target=work, args=(s,)) for s in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_cache_is_thread_safe(dev):
    """Threads looking up shared and their own tables concurrently (the interpreter
    itself is not thread-safe, so the kernels are left out here; a GPU runs them in
    ``test_threads_step_concurrently``): every lookup counted once, every table the
    right content for its tensors, the bound kept."""
    shared = [torch.randn(4099, device=dev), torch.randn(17, device=dev)]
    shared_g = [torch.randn_like(p) for p in shared]
    own = {s: [([torch.randn(100 + s + i, device=dev)], [torch.randn(100 + s + i, device=dev)]) for i in range(40)]
           for s in range(8)}
    errors = []
    barrier = threading.Barrier(8)

    def work(seed):
        try:
            barrier.wait()
            for i in range(40):
                params, grads = (shared, shared_g) if i % 2 else own[seed][i]
                table = _tables.nar_table(params, grads, [])
                assert torch.equal(table.chunks.cpu(), _expected_rows(params, grads))
        except Exception as exc:  # reported below
            errors.append(exc)

    _in_threads(work, 8)
    assert not errors, errors[0]
    assert _tables.stats["hits"] + _tables.stats["misses"] == 8 * 40
    assert _tables.stats["misses"] >= 1 + 8 * 20  # the shared table, and every thread's own
    assert _tables.cache_len() <= _tables.CACHE_SIZE


def test_python_twin_matches_chunks_h_and_the_kernels():
    """One chunk rule and row layout: backends/_chunks.py (Triton launchers) states the
    constants of csrc/include/fedopt/chunks.h (CUDA launchers), and the Triton kernels'
    column constexprs agree with both."""
    header = (ROOT / "csrc" / "include" / "fedopt" / "chunks.h").read_text()

    def const(name):
        m = re.search(rf"\b{name}\s*=\s*(\d+)", header)
        assert m, f"chunks.h does not define {name}"
        return int(m.group(1))

    assert const("kMinChunk") == _chunks.MIN_CHUNK
    assert const("kTargetChunks") == _chunks.TARGET_CHUNKS
    assert const("kMaxRedundantPartials") == _chunks.MAX_REDUNDANT_PARTIALS
    assert const("kAlignBytes") == _chunks.ALIGN_BYTES
    assert _helpers.ROW_COLS.value == _chunks.ROW_COLS
    assert (_helpers.COL_LEN.value, _helpers.COL_GROUP.value, _helpers.COL_FLAGS.value) == (
        _chunks.COL_LEN, _chunks.COL_GROUP, _chunks.COL_FLAGS)
    assert _helpers.FLAG_ALIGNED16.value == _chunks.FLAG_ALIGNED16


@pytest.mark.parametrize("n, expected", [(0, 2048), (1, 2048), (2048 * 1024, 2048), (2048 * 1024 + 1, 4096),
                                         (11_000_000, 16384)])
def test_chunk_rule(n, expected):
    assert _chunks.chunk_size_for(n) == expected
    if n:
        assert -(-n // expected) <= _chunks.TARGET_CHUNKS


@pytest.mark.parametrize("n, widest, tile", [(62_000, 2048, 256), (1, 2048, 256), (512 * 1024, 2048, 1024),
                                             (10**7, 2048, 2048), (10**7, 1024, 1024)])
def test_aggregate_tile_depends_on_n_and_dtype_only(n, widest, tile):
    assert _chunks.aggregate_tile(n, widest) == tile
    block, warps, programs = TB.aggregate_tiling(62_000, torch.float32)
    assert (block, warps, programs) == (256, 1, 243)  # C=100, N=62K: 243 programs, not 31


def test_rows_misalignment():
    assert _chunks.rows_misalignment([64, 128, 0]) == 0
    assert _chunks.rows_misalignment([68, 132]) == 4
    assert _chunks.rows_misalignment([68, 64]) == -1  # never all aligned at once


def test_aggregate_per_client_alignment_in_2d_rows(dev):
    """A [C, N] tensor whose row length is not a multiple of 16 bytes: rows alternate
    between aligned and not; the per-client choice must give the reference's values."""
    torch.manual_seed(3)
    X = torch.randn(6, 1001, device=dev)  # 4004-byte rows: row i starts at 4 * i mod 16
    w = torch.rand(6, device=dev) + 0.1
    out, st = ops.aggregate(X, w, nonfinite="propagate", backend="triton")
    ref, st_r = ops.aggregate(X, w, nonfinite="propagate", backend="reference")
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(st.client_sq_norms, st_r.client_sq_norms)
    torch.testing.assert_close(ops.client_dots(X, X[0], backend="triton"), ops.client_dots(X, X[0],
                                                                                             backend="reference"))


# ------------------------------------------------------------------ GPU only

needs_compiled_triton = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)")


def _need_compiled():
    from fedopt_kernels.backends import triton_interpret_mode, why_unavailable

    if triton_interpret_mode():
        pytest.skip("TRITON_INTERPRET=1 is set")
    reason = why_unavailable("triton", torch.device("cuda"))
    if reason is not None:
        pytest.fail(f"the triton backend should run on this CUDA machine: {reason}")


@needs_compiled_triton
def test_table_uploaded_on_one_stream_is_safe_on_another():
    """The first call queues its table upload on s1 behind ~50 ms of other work; the
    second call, on s2, hits the cache and must wait for that upload (an event), not
    read the table before it lands."""
    _need_compiled()
    params = [torch.randn(300_001, device="cuda"), torch.randn(77, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    expected = ops.nar_sq_norm(params, grads, weight_decay=0.01, backend="reference")
    _tables.clear_cache()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s1):
        torch.cuda._sleep(50_000_000)
        on_s1 = ops.nar_sq_norm(params, grads, weight_decay=0.01, backend="triton")
    with torch.cuda.stream(s2):
        on_s2 = ops.nar_sq_norm(params, grads, weight_decay=0.01, backend="triton")
    torch.cuda.synchronize()
    assert _tables.stats["misses"] == 1 and _tables.stats["hits"] == 1
    torch.testing.assert_close(on_s1, expected)
    torch.testing.assert_close(on_s2, expected)


@needs_compiled_triton
@pytest.mark.parametrize("op", ["nar_step_", "server_update_", "aggregate_list"])
def test_list_forms_capture_after_warm_up_on_a_side_stream(op):
    """docs/compile.md recipe: warm up on a side stream, capture (torch.cuda.graph uses its own
    stream), replay with new tensor lr values == eager."""
    _need_compiled()
    torch.manual_seed(4)
    params = [torch.randn(10_001, device="cuda"), torch.randn(37, 5, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    lr = torch.tensor(0.1, device="cuda")

    def call(ps, backend, lr_value):
        if op == "nar_step_":
            return ops.nar_step_(ps, grads, lr=lr_value, weight_decay=0.01, max_norm=1.0, backend=backend)
        if op == "server_update_":
            return ops.server_update_(ps, grads, rule="sgd", lr=lr_value, backend=backend)
        clients = [p.reshape(-1)[:185] for p in ps] + [g.reshape(-1)[:185] for g in grads]
        out, _ = ops.aggregate(clients, torch.ones(4, device="cuda"), gamma=lr_value, backend=backend)
        ps[0].reshape(-1)[:185].copy_(out)
        return out

    start = [p.clone() for p in params]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(params, "triton", lr)  # warm-up: compiles the kernels, caches the table
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(params, "triton", lr)
    for value in (0.1, 0.05, 0.2):
        for p, s in zip(params, start):
            p.copy_(s)
        lr.fill_(value)
        graph.replay()
        expected = [s.clone() for s in start]
        call(expected, "reference", value)
        torch.cuda.synchronize()
        for a, b in zip(params, expected):
            torch.testing.assert_close(a, b)


@needs_compiled_triton
def test_threads_step_concurrently():
    """Compiled kernels (unlike the interpreter) may be launched from several threads:
    each thread's steps equal the reference backend's."""
    _need_compiled()
    shared = [torch.randn(4099, device="cuda"), torch.randn(17, device="cuda")]
    shared_g = [torch.randn_like(p) for p in shared]
    errors = []

    def work(seed):
        try:
            gen = torch.Generator().manual_seed(seed)
            for i in range(12):
                if i % 2:
                    params, grads = [p.clone() for p in shared], shared_g
                else:
                    params = [torch.randn(100 + seed, generator=gen).cuda()]
                    grads = [torch.randn(100 + seed, generator=gen).cuda()]
                expected = [p.clone() for p in params]
                ops.nar_step_(params, grads, lr=0.1, weight_decay=0.01, max_norm=1.0, backend="triton")
                ops.nar_step_(expected, grads, lr=0.1, weight_decay=0.01, max_norm=1.0, backend="reference")
                torch.cuda.current_stream().synchronize()
                for a, b in zip(params, expected):
                    torch.testing.assert_close(a, b)
        except Exception as exc:  # reported below
            errors.append(exc)

    _in_threads(work, 6)
    assert not errors, errors[0]


@needs_compiled_triton
def test_reduce_overhead_compile_of_the_list_form():
    """torch.compile(mode="reduce-overhead") (cudagraph trees) around a FedNAR step on
    the triton backend equals eager over several steps."""
    _need_compiled()
    torch.manual_seed(5)
    params = [torch.randn(4099, device="cuda"), torch.randn(33, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    expected = [p.clone() for p in params]
    lr = torch.tensor(0.1, device="cuda")

    @torch.compile(mode="reduce-overhead")
    def step():
        ops.nar_step_(params, grads, lr=lr, weight_decay=0.01, max_norm=1.0, backend="triton")

    for value in (0.1, 0.05, 0.2, 0.1):
        lr.fill_(value)
        step()
        ops.nar_step_(expected, grads, lr=value, weight_decay=0.01, max_norm=1.0, backend="reference")
    torch.cuda.synchronize()
    for a, b in zip(params, expected):
        torch.testing.assert_close(a, b)


def _cuda_extension_ops():
    """torch.ops.fedopt_C with the CUDA extension's host-side hooks (registered even
    without a GPU); skipped only on a CPU-only torch, where that extension is not built."""
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build: no CUDA extension to compare with")
    import fedopt_kernels._C_cuda  # noqa: F401  (a CUDA torch must have it: test_cuda_extension.py)

    return torch.ops.fedopt_C


@pytest.mark.parametrize("seed", range(6))
def test_python_rows_equal_the_cuda_launchers_rows(seed):
    """The same tensors give the same chunk rows and group ranges from chunks.h
    (``build_chunk_rows``, what the CUDA launchers upload) and from its Python twin
    (what the Triton launchers upload): odd sizes, empty tensors, several groups,
    misaligned and absent pointers, mixed element sizes."""
    ops_ = _cuda_extension_ops()
    gen = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 9, (), generator=gen))
    num_groups = int(torch.randint(1, 4, (), generator=gen))
    groups = sorted(int(v) for v in torch.randint(0, num_groups, (T,), generator=gen))
    numels = [int(v) for v in torch.randint(0, 9000, (T,), generator=gen)]
    numels[0] = [0, 1, 2048, 2049, 123_457, 3 * 2048][seed]
    esizes = [2, 4, 2, 2] if seed % 2 else [8, 8, 8, 8]
    addrs = []
    for i in range(T):
        row = [(1 << 20) * (i + 1) + 4 * int(torch.randint(0, 4, (), generator=gen)) * k for k in range(1, 5)]
        if seed % 3 == 0:
            row[2] = row[3] = 0  # arrays the op does not have
        addrs.append(row)
    blob, num_rows, chunk, max_group_rows = ops_._cuda_chunk_rows(
        [a for row in addrs for a in row], numels, groups, esizes, num_groups)
    largest = max(sum(n for n, g in zip(numels, groups) if g == k) for k in range(num_groups))
    assert chunk == _chunks.chunk_size_for(largest)
    rows, ranges = _chunks.build_rows(addrs, esizes, numels, groups, num_groups, chunk)
    assert num_rows == len(rows) // _chunks.ROW_COLS
    assert list(blob) == rows + ranges
    assert max_group_rows == max(e - b for b, e in zip(ranges[0::2], ranges[1::2]))
    assert ops_._cuda_max_redundant_partials() == _chunks.max_redundant_partials()
