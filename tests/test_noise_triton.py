"""The ``triton`` backend's fused DP noise (issue 31): ``_noise.normal`` against its
definition python_ref/gaussian_noise.py to the bit, the aggregation's noise epilogue
and ``add_noise_`` against the contract's formula (briefs: noise_contract)::

    aggregate:   out[j] = round_out( gamma * total[j] + std * n_j )      (q, Q without noise)
    add_noise_:  out[j] = round_out( out[j] + std * n_j )

in the acc dtype (fp32; fp64 for fp64 data), product and sum each rounded once, ``n_j``
= python_ref.gaussian_noise.normal(key, j).  The oracle of ``gamma * total`` is the same
backend's aggregation without noise (the contract: the noise leaves the sum's bits
alone; the sum itself is tested against python_ref by tests/test_contract_aggregate.py);
the oracle of the rest is torch's separately rounded CPU ``+`` and ``*`` on python_ref's
noise.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest.py), with
one compiled on CUDA -- where the question is whether every operation of the noise kept
its own rounding against LLVM's and ptxas' FMA contraction (the aggregation kernel is
compiled with contraction on; tests/test_triton_aot.py checks its PTX).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from conftest import import_triton_module
from _asserts import acc_of, assert_bitwise
from python_ref import gaussian_noise as G

triton = import_triton_module("triton")
tl = import_triton_module("triton.language")
TB = import_triton_module("fedopt_kernels.backends.triton")
NZ = importlib.import_module("fedopt_kernels.backends.triton._noise")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
KEY = 0x5DEECE66D_1234567  # above 2^32: both key words matter
STD = 0.37  # not an fp32 value: the fp64 argument is rounded to fp32 for an fp32 acc


@pytest.fixture(scope="module")
def dev(triton_device):
    return triton_device


def _round_out(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The store of acc values ``x`` into ``dtype``: round to nearest even (torch's cast;
    in the interpreter too, whose fp32 -> bf16 truncation _interpreter_compat fixes)."""
    return x.to(dtype)


def _noise(key: int, n: int, acc: torch.dtype, start: int = 0) -> torch.Tensor:
    return G.noise(key, n, start=start).to(acc)  # fp32 widened exactly for an fp64 acc


# ----------------------------------------------------------------------------- normal

def test_constants_are_python_refs():
    """Every fp32 constant of _noise.py is python_ref's class C value, exactly (a drift
    in one low bit of a high-order coefficient changes few draws: the bitwise cases
    below might miss it)."""
    names = [n for n in vars(G.C) if n.isupper() and n != "SQRT1_2"]
    assert len(names) == 17
    for name in names:
        assert getattr(NZ, name).value == getattr(G.C, name), name
    assert NZ.SQRT2.value == 2 * G.C.SQRT1_2
    assert (NZ.PHILOX_M0.value, NZ.PHILOX_M1.value) == (G._M0, G._M1)
    assert (NZ.PHILOX_W0.value, NZ.PHILOX_W1.value) == (G._W0, G._W1)


@triton.jit
def _normal_kernel(j_ptr, out_ptr, key: tl.int64, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    j = tl.load(j_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, NZ.normal(key, j), mask=mask)


@pytest.mark.parametrize("key", [0, 1, KEY, (1 << 63) - 1], ids=["0", "1", "2^32+", "2^63-1"])
def test_normal_is_python_refs_to_the_bit_past_2_to_the_32(dev, key):
    """The helper alone, on indices where the counter's high word is 0, crosses 1, and
    is large (``j`` up to ``2^62``): the split of the int64 index into two uint32 words."""
    starts = [0, (1 << 32) - 100, (1 << 62) + 12345]
    j = torch.cat([torch.arange(s, s + 200, dtype=torch.int64) for s in starts])
    out = torch.full((j.numel(),), float("nan"), dtype=torch.float32, device=dev)
    _normal_kernel[(triton.cdiv(j.numel(), 256),)](j.to(dev), out, key, j.numel(), BLOCK=256)
    assert_bitwise(out.cpu(), G.normal(key, j), f"normal(key={key})")


@triton.jit
def _normal_block_kernel(starts_ptr, out_ptr, key: tl.int64, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    start = tl.load(starts_ptr + p)
    tl.store(out_ptr + p * BLOCK + tl.arange(0, BLOCK), NZ.normal_block(key, start, BLOCK))


def test_normal_block_is_python_refs_to_the_bit(dev):
    """The kernels' form (a block from its int64 start, drawn in two halves of even and
    odd elements): blocks below, at and far past 2^32."""
    block = 256
    starts = [0, (1 << 32) - block, 1 << 32, (1 << 62) + 7 * block]
    out = torch.full((len(starts) * block,), float("nan"), dtype=torch.float32, device=dev)
    _normal_block_kernel[(len(starts),)](torch.tensor(starts, device=dev), out, KEY, BLOCK=block)
    j = torch.cat([torch.arange(s, s + block, dtype=torch.int64) for s in starts])
    assert_bitwise(out.cpu(), G.normal(KEY, j), "normal_block")


def test_normal_depends_on_both_key_words(dev):
    """Keys that differ in one word only give other noise (the oracle says so too; this
    guards the oracle comparison above against a key the kernel and python_ref both
    ignore)."""
    j = torch.arange(64, dtype=torch.int64)
    outs = []
    for key in (KEY, KEY ^ 1, KEY ^ (1 << 40)):
        out = torch.empty(64, dtype=torch.float32, device=dev)
        _normal_kernel[(1,)](j.to(dev), out, key, 64, BLOCK=64)
        outs.append(out.cpu())
        assert_bitwise(outs[-1], G.normal(key, j))
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


# ----------------------------------------------------------------------------- aggregate

def _clients(C, N, dtype, dev, seed, layout):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(C, N, generator=g, dtype=torch.float64).to(dtype)
    w = torch.rand(C, generator=g, dtype=torch.float64).to(acc_of(dtype))
    X, w = X.to(dev), w.to(dev)
    return (X if layout == "2d" else [x.clone() for x in X.unbind(0)]), w


def _std_pair(kind, acc, dev):
    """``(noise_std, noise_std_tensor)`` of a case: the float, or one element on the
    device (0-d or [1], fp32 or fp64) holding the float's value in that dtype."""
    if kind == "float":
        return STD, None
    dt, shape = {"t32": (torch.float32, ()), "t64": (torch.float64, (1,))}[kind]
    return 0.0, torch.full(shape, STD, dtype=dt, device=dev)


def _std_acc(kind, acc):
    """The std the contract uses: the tensor's value (its dtype) or the float, in acc."""
    dt = {"float": torch.float64, "t32": torch.float32, "t64": torch.float64}[kind]
    return torch.tensor(STD, dtype=dt).to(acc)


@pytest.mark.parametrize("N", [0, 1, 17, 1500], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aggregate_with_noise_is_the_contracts_formula(dev, dtype, N):
    """Every data dtype into an out of that dtype and into the acc dtype; N = 1500 runs
    6 programs (256-column tiles, one masked tail)."""
    acc = acc_of(dtype)
    clients, w = _clients(3, N, dtype, dev, seed=N, layout="2d")
    n = _noise(KEY, N, acc)
    for out_dtype in dict.fromkeys((dtype, acc)):
        plain = torch.empty(N, dtype=acc, device=dev)
        q0, Q0 = TB.aggregate(clients, w, 0.7, None, plain, None)
        out = torch.full((N,), 7.0, dtype=out_dtype, device=dev)
        q, Q = TB.aggregate(clients, w, 0.7, None, out, None, KEY, STD, None)
        expected = _round_out(plain.cpu() + _std_acc("float", acc) * n, out_dtype)
        assert_bitwise(out.cpu(), expected, f"aggregate {dtype} -> {out_dtype}")
        assert_bitwise([q, Q], [q0, Q0], "q, Q are those of the sum without noise")


@pytest.mark.parametrize("std_kind", ["float", "t32", "t64"])
@pytest.mark.parametrize("layout", ["2d", "list"])
def test_aggregate_noise_std_and_layouts(dev, layout, std_kind):
    """The std as a float or one element on the device (fp32 0-d, fp64 [1]), a gamma
    tensor, both client layouts; fp32 (bitwise, incl. the std's rounding to fp32)."""
    N, acc = 600, torch.float32
    clients, w = _clients(4, N, torch.float32, dev, seed=3, layout=layout)
    gamma_t = torch.tensor(1.3, dtype=acc, device=dev)
    plain = torch.empty(N, dtype=acc, device=dev)
    q0, Q0 = TB.aggregate(clients, w, 0.0, gamma_t, plain, None)
    std_f, std_t = _std_pair(std_kind, acc, dev)
    out = torch.empty(N, dtype=acc, device=dev)
    q, Q = TB.aggregate(clients, w, 0.0, gamma_t, out, None, 12345, std_f, std_t)
    expected = plain.cpu() + _std_acc(std_kind, acc) * _noise(12345, N, acc)
    assert_bitwise(out.cpu(), expected, f"aggregate, std {std_kind}, {layout}")
    assert_bitwise([q, Q], [q0, Q0])


@pytest.mark.parametrize("skip_value", [True, False])
def test_aggregate_noise_with_skip(dev, skip_value):
    """A true skip: out untouched (no noise either), zero stats; a false one: as no skip."""
    N, acc = 300, torch.float32
    clients, w = _clients(2, N, torch.float32, dev, seed=5, layout="2d")
    skip = torch.tensor(skip_value, device=dev)
    out = torch.full((N,), 7.0, dtype=acc, device=dev)
    q, Q = TB.aggregate(clients, w, 0.5, None, out, skip, KEY, STD, None)
    if skip_value:
        assert_bitwise(out.cpu(), torch.full((N,), 7.0, dtype=acc))
        assert_bitwise([q.cpu(), Q.cpu()], [torch.zeros(2, dtype=acc), torch.zeros((), dtype=acc)])
    else:
        ref = torch.empty(N, dtype=acc, device=dev)
        q0, Q0 = TB.aggregate(clients, w, 0.5, None, ref, None, KEY, STD, None)
        assert_bitwise([out, q, Q], [ref, q0, Q0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_fused_noise_is_aggregate_then_add_noise(dev, dtype):
    """For an acc-dtype out, aggregating with noise == aggregating, then ``add_noise_``
    with the same key and std, bit for bit (the one noise epilogue in both kernels)."""
    N, acc = 1100, acc_of(dtype)
    clients, w = _clients(3, N, dtype, dev, seed=9, layout="list")
    fused = torch.empty(N, dtype=acc, device=dev)
    TB.aggregate(clients, w, 0.9, None, fused, None, KEY, 0.0, torch.tensor(STD, device=dev))
    separate = torch.empty(N, dtype=acc, device=dev)
    TB.aggregate(clients, w, 0.9, None, separate, None)
    TB.add_noise_(separate, KEY, 0.0, torch.tensor(STD, device=dev))
    assert_bitwise(fused, separate, f"fused vs separate, {dtype} clients")


# ----------------------------------------------------------------------------- add_noise_

@pytest.mark.parametrize("N", [0, 1, 17, 2500], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_noise_is_the_contracts_formula(dev, dtype, N):
    """``out[j] = round(out[j] + std * n_j)`` in acc; N = 2500 is two full 1024-element
    blocks and a masked tail."""
    acc = acc_of(dtype)
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    for std_kind in ("float", "t64"):
        out = x.to(dev, copy=True)
        TB.add_noise_(out, KEY, *_std_pair(std_kind, acc, dev))
        expected = _round_out(x.to(acc) + _std_acc(std_kind, acc) * _noise(KEY, N, acc), dtype)
        assert_bitwise(out.cpu(), expected, f"add_noise_ {dtype}, std {std_kind}")


def test_add_noise_zero_std_and_nonfinite_values(dev):
    """std 0 adds +0 * n = +-0 (x unchanged, -0.0 + +-0 aside); inf and nan stay what
    IEEE makes of them (out + finite noise): the kernel hides nothing."""
    x = torch.tensor([1.5, -2.0, float("inf"), float("-inf"), float("nan"), 0.0, 3.0], dtype=torch.float32)
    out = x.to(dev, copy=True)
    TB.add_noise_(out, 7, 0.0, None)
    assert_bitwise(out.cpu(), x + 0.0 * G.noise(7, x.numel()), nan_ok=True)
    out = x.to(dev, copy=True)
    TB.add_noise_(out, 7, 2.0, None)
    assert_bitwise(out.cpu(), x + 2.0 * G.noise(7, x.numel()), nan_ok=True)


# ----------------------------------------------------------------------------- specialisation

def test_noise_arguments_never_recompile():
    """The std is an fp64 runtime argument and the key an int64 one, neither value-
    specialised: a new key every round (and a key that happens to be 1 or a multiple of
    16) reuses the compiled kernel."""
    AG = importlib.import_module("fedopt_kernels.backends.triton.aggregate")
    AN = importlib.import_module("fedopt_kernels.backends.triton.add_noise")
    for kernel in (AG.aggregate_kernel, AN.add_noise_kernel):
        fn = getattr(kernel, "fn", kernel)
        ann = {k: str(v) for k, v in fn.__annotations__.items()}
        assert ann["std_value"] in ("fp64", "tl.float64") and ann["noise_key"] in ("i64", "tl.int64"), ann
        dns = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"]
        assert {"std_value", "noise_key"} <= set(dns), dns
