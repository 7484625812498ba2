"""The DP noise of the C++ CPU kernels (``fedopt_C::aggregate`` / ``aggregate_pieces``
with ``noise_key``, ``fedopt_C::add_noise_``) against python_ref/gaussian_noise.py, BIT
FOR BIT, under every instruction set the kernels are built for (DEFAULT, AVX2, AVX-512:
one subprocess per ``ATEN_CPU_CAPABILITY``, tests/_cpu_isa.py), and what is specific to
the C++ kernels: the noise-free path unchanged, the thread count, the raw ops' checks,
no out-of-line copy of the shared noise header in the library.

The oracle of every case is independent of the kernels' noise: python_ref's noise ``n``
and python_ref's noiseless aggregate (which the CPU kernel matches to the bit,
tests/test_contract_aggregate.py), combined by torch's correctly rounded ``*`` and ``+``
in the acc dtype: ``round_out(gamma * total + std * n)``.  The backend-generic contract
(every backend, the ops layer) is tests/test_contract_noise.py.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import shutil
import subprocess

import pytest
import torch

from _asserts import acc_of, assert_bitwise
from _cpu_isa import LEVELS, results_at, why_not
from python_ref import aggregation as agg_ref
from python_ref import gaussian_noise as noise_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
KEY = 0x5DEECE66D
TOP_KEY = (1 << 63) - 1  # both Philox key words non-zero and the sign bit's neighbour

pytestmark = pytest.mark.usefixtures("cpu_extension")


def _ops():
    import fedopt_kernels.backends.cpu  # noqa: F401 - loads the extension: registers the ops

    return torch.ops.fedopt_C


def _exact(shape, gen, dtype):
    """Values in [-2, 2) with 21 fractional bits, exact in fp32: every instruction set
    draws the same data (torch.randn's own kernels differ in the last bits between
    ISAs)."""
    return (torch.randint(-(2 ** 22), 2 ** 22, shape, generator=gen, dtype=torch.int64).double() / 2 ** 21).to(dtype)


def _weights(C, gen, acc):
    """[C] weights with every other one exactly 0 (from the second): four-client groups
    with a zero and single clients both occur."""
    w = (torch.randint(1, 64, (C,), generator=gen, dtype=torch.int64).double() / 64).to(acc)
    w[1::2] = 0
    return w


@functools.lru_cache(maxsize=None)
def _ref_noise(key, n):
    """python_ref's noise (fp32), once per (key, n): the cases of every dtype share it."""
    return noise_ref.noise(key, n)


def _acc_std(std, acc):
    """The std as the kernels take it: a float rounded to acc, or a tensor converted."""
    return std.to(acc) if isinstance(std, torch.Tensor) else torch.tensor(std, dtype=acc)


def expected_aggregate(X, w, gamma, key, std, out_dtype):
    """``round_out(gamma * total + std * n)``: python_ref's noiseless aggregate (acc
    dtype) plus python_ref's noise, each product and the sum rounded on its own."""
    base, _, _ = agg_ref.aggregate(X, w, gamma)
    acc = base.dtype
    n = _ref_noise(key, base.numel()).to(acc)
    return (base + _acc_std(std, acc) * n).to(out_dtype)


def expected_add_noise(out, key, std):
    acc = acc_of(out.dtype)
    n = _ref_noise(key, out.numel()).to(acc)
    return (out.to(acc) + _acc_std(std, acc) * n).to(out.dtype)


def _split(std):
    """``(noise_std, noise_std_tensor)`` of the schema."""
    return (0.0, std) if isinstance(std, torch.Tensor) else (float(std), None)


def aggregate(X, w, gamma, out, key=None, std=0.0, skip=None, gamma_tensor=None):
    rows = [X] if isinstance(X, torch.Tensor) else list(X)
    if key is None:
        return _ops().aggregate(rows, w, gamma, gamma_tensor, out, skip)
    return _ops().aggregate(rows, w, gamma, gamma_tensor, out, skip, key, *_split(std))


def _pieces(X, sizes):
    """Client i's row of [C, N] cut into pieces of `sizes` (copies: in place they would
    alias X), flat in client order as aggregate_pieces takes them."""
    flat = []
    for row in X:
        flat += [p.clone() for p in row.split(sizes)]
    return flat


# --------------------------------------------------------------------------------------
# every instruction set: the same cases in a subprocess per ATEN_CPU_CAPABILITY, hashed


def _isa_cases(dtype):
    """(kernel result, oracle) pairs of aggregate, aggregate_pieces and add_noise_ over
    data of `dtype`: chunk tails, several chunks, out in the data and the acc dtype, the
    std as a float and as fp32 / fp64 tensors, both keys."""
    acc = acc_of(dtype)
    gen = torch.Generator().manual_seed(31)
    cases = []
    # [C, N] rows, out in the data dtype, several 4 Ki chunks with a tail, float std
    X = _exact((6, 3 * 4096 + 29), gen, dtype)
    w = _weights(6, gen, acc)
    out = torch.full((X.shape[1],), 7.0, dtype=dtype)
    aggregate(X, w, 0.7, out, KEY, 0.37)
    cases.append((out, expected_aggregate(X, w, 0.7, KEY, 0.37, dtype)))
    # a list of 5 clients, out in acc, 17 columns, an fp64 std tensor, the top key
    rows = list(_exact((5, 17), gen, dtype).unbind(0))
    w5 = _weights(5, gen, acc)
    std64 = torch.tensor(1.0 / 3.0, dtype=torch.float64)
    out = torch.empty(17, dtype=acc)
    aggregate(rows, w5, 1.3, out, TOP_KEY, std64)
    cases.append((out, expected_aggregate(rows, w5, 1.3, TOP_KEY, std64, acc)))
    # pieces with a base (updates base - x), one column across a piece boundary
    Xp = _exact((5, 4096 + 3), gen, dtype)
    base = _exact((4096 + 3,), gen, dtype)
    sizes = [1000, 1, 3098]
    out = torch.empty(Xp.shape[1], dtype=dtype)
    _ops().aggregate_pieces(_pieces(Xp, sizes), len(sizes), base, w5, 0.9, None, out, None, KEY, 0.25, None)
    cases.append((out, expected_aggregate(base - Xp, w5, 0.9, KEY, 0.25, dtype)))
    # add_noise_: past one 64 Ki chunk with a tail, an fp32 std tensor; and one element
    for n, key, std in [((1 << 16) + 77, KEY, torch.tensor(2.5)), (1, TOP_KEY, 0.5)]:
        out = _exact((n,), gen, dtype)
        want = expected_add_noise(out, key, std)
        _ops().add_noise_(out, key, *_split(std))
        cases.append((out, want))
    return cases


def isa_results(dtype):
    """The kernels' results of _isa_cases (run by tests/_cpu_isa.py in each subprocess)."""
    return [got for got, _ in _isa_cases(dtype)]


def _hashes(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_isa_cases_are_python_ref_in_this_process(dtype):
    """The per-ISA cases at this process's ISA, element by element (the subprocess test
    below only compares hashes)."""
    for i, (got, want) in enumerate(_isa_cases(dtype)):
        assert_bitwise(got, want, f"{_ops().cpu_isa()} case {i}")


@pytest.mark.parametrize("level", LEVELS)
def test_every_isa_is_python_ref_bit_for_bit(level):
    reason = why_not(level)
    if reason is not None:
        pytest.skip(reason)
    want = tuple(_hashes([w for _, w in _isa_cases(dtype)]) for dtype in DTYPES)
    got = results_at("test_noise_cpu_isa", "isa_results", level)
    assert len(got) == len(DTYPES)
    for dtype, g, w in zip(DTYPES, got, want):
        assert g == w, f"ATEN_CPU_CAPABILITY={level}: the noise cases of {dtype} differ from python_ref"


# --------------------------------------------------------------------------------------
# aggregate with noise, in this process


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_acc", [False, True], ids=["out_data", "out_acc"])
@pytest.mark.parametrize("N", [0, 1, 17, 4096, 2 * 4096 + 1])
def test_aggregate_noise_is_python_ref(dtype, out_acc, N):
    acc = acc_of(dtype)
    gen = torch.Generator().manual_seed(N)
    X = _exact((9, N), gen, dtype)
    w = _weights(9, gen, acc)
    out_dtype = acc if out_acc else dtype
    for std in [0.37, torch.tensor(0.37, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float32)]:
        out = torch.empty(N, dtype=out_dtype)
        aggregate(X, w, 0.7, out, KEY, std)
        assert_bitwise(out, expected_aggregate(X, w, 0.7, KEY, std, out_dtype), f"N={N} std={std}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_and_noise_free_path_unchanged(dtype):
    """q and Q are those of the sum without noise, bit for bit; noise_key None (even with
    a std given) is the op called without the noise arguments, which is python_ref's
    noiseless aggregate."""
    acc = acc_of(dtype)
    gen = torch.Generator().manual_seed(5)
    X = _exact((7, 3 * 4096 + 5), gen, dtype)
    w = _weights(7, gen, acc)
    plain = torch.empty(X.shape[1], dtype=dtype)
    q0, Q0 = aggregate(X, w, 0.5, plain)
    assert_bitwise(plain, agg_ref.aggregate(X, w, 0.5)[0].to(dtype), "noise-free")
    ignored = torch.empty_like(plain)
    q1, Q1 = _ops().aggregate([X], w, 0.5, None, ignored, None, None, 4.0, torch.tensor(2.0))
    assert_bitwise([ignored, q1, Q1], [plain, q0, Q0], "noise_key None")
    noisy = torch.empty_like(plain)
    q2, Q2 = aggregate(X, w, 0.5, noisy, KEY, 2.0)
    assert_bitwise([q2, Q2], [q0, Q0], "norms with noise")
    assert not torch.equal(noisy, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused_equals_aggregate_then_add_noise(dtype):
    """For an fp32 / fp64 out (the acc dtype) the fused noise is the separate pass's, to
    the bit, with gamma from a tensor and the std from a tensor too."""
    gen = torch.Generator().manual_seed(6)
    X = _exact((6, 2 * 4096 + 999), gen, dtype)
    w = _weights(6, gen, dtype)
    gamma = torch.tensor(0.8, dtype=dtype)
    std = torch.tensor(0.05, dtype=dtype)
    fused = torch.empty(X.shape[1], dtype=dtype)
    aggregate(X, w, 0.0, fused, TOP_KEY, std, gamma_tensor=gamma)
    apart = torch.empty_like(fused)
    aggregate(X, w, 0.0, apart, gamma_tensor=gamma)
    _ops().add_noise_(apart, TOP_KEY, 0.0, std)
    assert_bitwise(fused, apart, "fused vs aggregate + add_noise_")


def test_low_precision_out_rounds_once():
    """fp16 out: the fused form rounds gamma * total + std * n once (python_ref's value
    rounded once), not the rounded sum plus the noise rounded again."""
    gen = torch.Generator().manual_seed(8)
    X = _exact((4, 5000), gen, torch.float16)
    w = torch.tensor([0.3, 0.2, 0.1, 0.4])
    fused = torch.empty(5000, dtype=torch.float16)
    aggregate(X, w, 1.0, fused, KEY, 0.01)
    assert_bitwise(fused, expected_aggregate(X, w, 1.0, KEY, 0.01, torch.float16), "fp16 fused")
    twice = torch.empty_like(fused)
    aggregate(X, w, 1.0, twice)
    _ops().add_noise_(twice, KEY, 0.01, None)
    assert not torch.equal(fused, twice), "no case where the two roundings differ: the check is vacuous"


def test_skip_leaves_out_untouched_and_adds_no_noise():
    gen = torch.Generator().manual_seed(9)
    X = _exact((3, 100), gen, torch.float32)
    w = torch.ones(3)
    out = _exact((100,), gen, torch.float32)
    before = out.clone()
    q, Q = aggregate(X, w, 1.0, out, KEY, 1.0, skip=torch.tensor(True))
    assert_bitwise([out, q, Q], [before, torch.zeros(3), torch.zeros(())], "skipped")
    q, Q = aggregate(X, w, 1.0, out, KEY, 1.0, skip=torch.tensor(False))
    assert_bitwise(out, expected_aggregate(X, w, 1.0, KEY, 1.0, torch.float32), "not skipped")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pieces_with_noise_are_the_rows_with_noise(dtype):
    """aggregate_pieces (read in place, staged across piece boundaries, with and without
    a base) adds the same noise at the same global indices as aggregate over the rows."""
    acc = acc_of(dtype)
    gen = torch.Generator().manual_seed(10)
    N = 2 * 4096 + 17
    X = _exact((5, N), gen, dtype)
    w = _weights(5, gen, acc)
    sizes = [4096, 3, 4000, N - 8099]
    for base in [None, _exact((N,), gen, dtype)]:
        rows = X if base is None else base - X
        want = torch.empty(N, dtype=dtype)
        qw, Qw = aggregate(rows, w, 0.6, want, KEY, 0.2)
        got = torch.empty(N, dtype=dtype)
        q, Q = _ops().aggregate_pieces(_pieces(X, sizes), len(sizes), base, w, 0.6, None, got, None, KEY, 0.2,
                                       None)
        assert_bitwise([got, q, Q], [want, qw, Qw], f"pieces, base={base is not None}")
        assert_bitwise(got, expected_aggregate(rows, w, 0.6, KEY, 0.2, dtype), "pieces vs python_ref")


def test_thread_count_changes_no_bit():
    """The noise depends on (key, j) alone: one thread and all of them give the same bits
    (the vectors are large enough for the ops to split them)."""
    gen = torch.Generator().manual_seed(11)
    X = _exact((3, 400_003), gen, torch.float32)
    w = torch.tensor([0.5, 0.25, 0.25])
    v = _exact((600_001,), gen, torch.bfloat16)
    results = []
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, max(2, threads)}):
            torch.set_num_threads(t)
            out = torch.empty(X.shape[1])
            aggregate(X, w, 1.0, out, KEY, 0.1)
            vv = v.clone()
            _ops().add_noise_(vv, TOP_KEY, 0.3, None)
            results.append([out, vv])
    finally:
        torch.set_num_threads(threads)
    assert_bitwise(results[0], results[1], "1 thread vs several")
    assert_bitwise(results[0][1], expected_add_noise(v, TOP_KEY, 0.3), "add_noise_ vs python_ref")


# --------------------------------------------------------------------------------------
# add_noise_


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [0, 1, 17, 33, (1 << 16) + 1])
def test_add_noise_is_python_ref(dtype, N):
    gen = torch.Generator().manual_seed(N + 1)
    for key, std in [(KEY, 0.37), (0, torch.tensor(1.5, dtype=torch.float64)), (TOP_KEY, torch.tensor(0.1))]:
        out = _exact((N,), gen, dtype)
        want = expected_add_noise(out, key, std)
        _ops().add_noise_(out, key, *_split(std))
        assert_bitwise(out, want, f"N={N} key={key} std={std}")


# --------------------------------------------------------------------------------------
# bad input: a clear error, raised before anything is written


def test_bad_noise_arguments_raise_before_writing():
    X = torch.ones(2, 10)
    w = torch.ones(2)
    out = torch.full((10,), 3.0)
    bad = [
        (dict(key=-1, std=1.0), "noise_key"),
        (dict(key=1, std=torch.ones(2)), "noise_std_tensor must have one element"),
        (dict(key=1, std=torch.ones((), dtype=torch.float16)), "noise_std_tensor must be float32 or float64"),
        (dict(key=1, std=torch.ones((), dtype=torch.int64)), "noise_std_tensor must be float32 or float64"),
    ]
    for kwargs, match in bad:
        with pytest.raises(RuntimeError, match=match):
            aggregate(X, w, 1.0, out, **kwargs)
        assert torch.equal(out, torch.full((10,), 3.0)), match
        with pytest.raises(RuntimeError, match=match):
            _ops().add_noise_(out, kwargs["key"], *_split(kwargs["std"]))
        assert torch.equal(out, torch.full((10,), 3.0)), match
    with pytest.raises(RuntimeError, match="noise_key"):
        _ops().aggregate_pieces([torch.ones(10)], 1, None, torch.ones(1), 1.0, None, out, None, -5, 1.0, None)
    with pytest.raises(RuntimeError, match="contiguous 1-D"):
        _ops().add_noise_(torch.ones(20)[::2], 1, 1.0, None)
    with pytest.raises(RuntimeError, match="contiguous 1-D"):
        _ops().add_noise_(torch.ones(2, 3), 1, 1.0, None)
    with pytest.raises(RuntimeError, match="out has unsupported dtype"):
        _ops().add_noise_(torch.ones(3, dtype=torch.int32), 1, 1.0, None)


# --------------------------------------------------------------------------------------
# the build


@pytest.mark.skipif(platform.system() != "Linux" or shutil.which("nm") is None, reason="nm (binutils) on Linux")
def test_no_out_of_line_copy_of_the_noise_header():
    """gaussian_noise.h's functions are plain inline functions, compiled into every
    isa_*.cpp with that file's target; the kernels inline them all (noise_kernels.h's
    `flatten`), so the library holds no copy the linker could have taken from the AVX2
    or AVX-512 build for every caller."""
    import fedopt_kernels._C as ext

    names = subprocess.run(["nm", "-C", ext.__file__], capture_output=True, text=True, check=True).stdout
    assert "normal_parts" in names, "the noise kernels are not in the library (or nm found no symbols)"
    copies = [line for line in names.splitlines() if "fedopt::noise::" in line]
    assert not copies, copies[:5]
