"""Shared test setup.

The session's environment is set here, explicitly, so that a developer's shell cannot
change what the suite tests:

* Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter; with one,
  compiled on the GPU.  triton.jit reads TRITON_INTERPRET when a kernel is *defined*,
  so it is set before anything imports the kernels (``TRITON_INTERPRET=0`` in a shell
  on a CPU machine would otherwise fail every Triton case; ``=1`` on a GPU machine
  would hide the compiled ones).
* ``FEDOPT_BACKEND`` is cleared: it would route every default-backend case to one
  backend.  Tests of the variable set it themselves (monkeypatch).
* ``MKL_CBWR`` and ``FEDOPT_MKL_STRICT`` are cleared before fedopt_kernels sets MKL's
  strict mode (backends/mkl.py): the suite tests the library's own setting; the tests
  of the variables set them in their subprocesses.
* In the interpreter, a device-function call skips Triton's redundant re-patching of
  ``triton.language``, ``xor_sum`` (so ``tl.sort``) runs through numpy and the type
  table is built once (tests/_fast_interpreter.py: the same bits; checked by
  tests/test_triton_fast_interpreter.py).
* Under pytest-xdist each worker runs torch, and the processes it starts, on its share
  of the cores (below).
"""

import importlib
import math
import os
import signal

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"
os.environ.pop("FEDOPT_BACKEND", None)
os.environ.pop("MKL_CBWR", None)
os.environ.pop("FEDOPT_MKL_STRICT", None)

# pytest-xdist workers share the cores: each runs torch (and, through the environment,
# the processes it starts) on its share.  With torch's default -- every core in every
# worker -- two workers ran 4 spinning OpenMP threads on 2 cores: a contract suite took
# 61 s beside a busy neighbour instead of 25 s.  No result depends on it (the thread-count
# tests set their counts themselves; the CPU kernels' bits do not depend on it).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
                 // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_SHARE)
    torch.set_num_threads(_SHARE)

from fedopt_kernels import backends  # noqa: E402

if os.environ["TRITON_INTERPRET"] == "1":
    import _fast_interpreter

    _fast_interpreter.install()

# Scheduling only (no result depends on it).  `make test` gives pytest-xdist's workers one
# file at a time in collection order (--dist loadfile --no-loadscope-reorder), so the
# files that take longest go first -- longest-processing-time-first -- and the many short
# ones fill in at the end.  xdist's own order (most tests first) ran the slow tier's
# few, long tests last, one worker alone with them while the other idled.
LONGEST_FIRST = (  # measured 2026-11-27 (tests/ per-file sums of `make test`), longest first
    "test_oldest_torch.py",  # builds against torch 2.11, runs the contract suites there
    "test_wheel.py", "test_flower_deployment.py",
    # the other two Flower deployments (139 s and 52 s in the last full run, 2026-11-28), after the
    # two builds: each mostly waits on Flower (heartbeats, a dropout's stage timeout,
    # ClientApp start-ups), and its time-outs are better met beside one busy core than two
    "test_flower_secagg_deployment.py", "test_flower_fedbuff.py",
    "test_selftest.py", "test_flower.py", "test_flower_run_bench.py",
    "test_contract_nar_step.py", "test_contract_server_update.py", "test_contract_aggregate.py",
    "test_batched_engine.py", "test_contract_noise.py", "test_aggregate.py", "test_distributed.py",
    "test_triton_aot.py", "test_robust_aggregate.py", "test_device_check_script.py", "test_code_paths.py",
    "test_cli_signals.py", "test_sanitizer_driver.py", "test_chunked_rounds.py", "test_lean_install.py",
    "test_compile_every_op.py", "test_scale_bench.py", "test_robust_triton_aot.py", "test_gaussian_noise.py",
    "test_distributed_robust_dp.py", "test_robust_gram.py", "test_cli.py", "test_nar_step.py",
    "test_engine_agreement.py", "test_startup.py", "test_server_optimizers.py",
)


def pytest_addoption(parser):
    parser.addoption("--backends", default=None, metavar="A,B",
                     help="run the cases of the `backend` fixture for these backends only (of "
                          f"{', '.join(backends.BACKENDS)}); the others are deselected.  Default: every one")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept
    _only_backends(config, items)


def _only_backends(config, items):
    """``--backends A,B``: deselect the cases of the other backends (tests/test_oldest_torch.py
    leaves out the reference backend's contract cases under torch 2.11; it says why)."""
    wanted = config.getoption("backends")
    if wanted is None:
        return
    wanted = set(wanted.split(","))
    if not wanted <= set(backends.BACKENDS):
        raise pytest.UsageError(f"--backends: {sorted(wanted - set(backends.BACKENDS))} are not backends "
                                f"(the backends are {', '.join(backends.BACKENDS)})")

    def keep(item):
        callspec = getattr(item, "callspec", None)
        return callspec is None or callspec.params.get("backend", None) in (None, *wanted)

    other = [item for item in items if not keep(item)]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if keep(item)]


# Backends whose absence is a build failure, not a reason to skip: CI always builds the
# C++ CPU extension, and the CUDA extension whenever torch has CUDA.
_MUST_EXIST = {"reference", "cpu"}


def backend_device(name: str) -> torch.device:
    """The device a backend's tests run on here."""
    if name == "cuda" or (name == "triton" and not backends.triton_interpret_mode()):
        return torch.device("cuda")
    return torch.device("cpu")


def require_backend(name: str) -> torch.device:
    """Skip (with the reason) when ``name`` genuinely cannot run on this machine;
    fail when it should run and does not."""
    device = backend_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"backend {name!r} needs a CUDA device and this machine has none")
    reason = backends.why_unavailable(name, device)
    if reason is not None:
        if name in _MUST_EXIST:
            pytest.fail(f"backend {name!r} must be available here but is not: {reason}")
        if name == "triton" and "not installed" in reason and torch.version.cuda is None:
            pytest.skip(f"backend 'triton': {reason} (CPU-only torch)")
        pytest.fail(f"backend {name!r} should be available here but is not: {reason}")
    return device


def import_triton_module(name: str):
    """Import ``name`` (triton itself or a module built on it) for a test module.

    Triton ships with every CUDA build of torch, so there its absence is a broken setup
    and the import error fails the module; only with a CPU-only torch (no triton to be
    had) is the module skipped, saying why."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if torch.version.cuda is None:
            pytest.skip(f"{name} needs triton, which CPU-only torch does not ship: {e}", allow_module_level=True)
        raise


def assert_same_tree(a, b, what="", *, nan_equal=False):
    """Nested dicts, lists and tuples of tensors and plain values equal: tensors of the
    same dtype and shape element by element (+0.0 == -0.0), the rest by ``==``.  NaN
    equals NaN (in a tensor or a float) only with ``nan_equal``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        same = a == b
        if nan_equal and a.is_floating_point():
            same = same | (torch.isnan(a) & torch.isnan(b))
        assert bool(same.all()), f"{what}: {a} vs {b}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{what}: {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{what}.{k}", nan_equal=nan_equal)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{what}[{i}]", nan_equal=nan_equal)
    else:
        assert a == b or (nan_equal and isinstance(a, float) and math.isnan(a) and math.isnan(b)), \
            f"{what}: {a!r} vs {b!r}"


@pytest.fixture(params=list(backends.BACKENDS))
def backend(request):
    """Every backend, with the device its tests run on: ``(name, device)``."""
    return request.param, require_backend(request.param)


@pytest.fixture
def backend_impl(backend):
    """Every backend's module (``backends.resolve``), as the contract suite calls it:
    a tests/_contract.py ``Backend`` (its functions, name and device)."""
    from _contract import Backend

    return Backend(*backend)


@pytest.fixture(scope="module")
def cpu_extension():
    """The C++ CPU extension, loaded, with the fake kernels of its ops registered (as the
    cpu backend registers them when it is first resolved: a test that calls a raw op on
    meta tensors must not depend on another test having resolved it first); its absence
    fails (CI always builds it)."""
    require_backend("cpu")
    backends.resolve("cpu", torch.device("cpu"))


@pytest.fixture(scope="module")
def triton_device() -> torch.device:
    """Where the triton backend's tests run: CUDA when compiled kernels can run, else CPU
    tensors in the interpreter (skips without either; fails if triton should run)."""
    return require_backend("triton")


@pytest.fixture
def no_mkldnn():
    """CPU matmuls without oneDNN inside a test (deterministic across two runs of one
    model), restored afterwards: no test module changes this global at import."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = before


@pytest.fixture
def one_thread():
    """torch on one intra-op thread inside a test (simulations whose numbers must not
    depend on the thread count, and that share 2 cores with the rest); restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def threads():
    """Set torch's intra-op thread count inside a test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt inside the test, as in a terminal, even when the
    suite runs where SIGINT is ignored (a background shell, ``nohup``, some CI runners:
    Python then leaves SIG_IGN installed); the previous handler is restored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
