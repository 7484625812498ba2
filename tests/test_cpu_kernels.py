"""What is specific to the C++ CPU backend (csrc/cpu): the results do not depend on the
thread count nor on the instruction set the kernels were dispatched to, the per-ISA
build itself, and the raw ops' checks of what would be memory-unsafe.

The backend contract (python_ref's results, odd sizes and chunk tails, the no-FMA
arithmetic: an unclipped step and the aggregate are python_ref's to the bit, ...) is
checked for every backend by tests/test_contract_nar_step.py and
test_contract_aggregate.py.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest
import torch

from _contract import assert_bitwise, clone
from _cpu_isa import assert_level_agrees_with_default
from fedopt_kernels import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
MODES = ["co", "grad", "none"]

pytestmark = pytest.mark.usefixtures("cpu_extension")


# --------------------------------------------------------------------------------------
# determinism


def _exact_rand(shape, gen, dtype):
    """Random values in [-2, 2) with 21 fractional bits: exact in fp32, so every
    instruction set draws the same data (torch.randn's own kernels differ in the last
    bits between its AVX2 and DEFAULT builds)."""
    return (torch.randint(-(2 ** 22), 2 ** 22, shape, generator=gen, dtype=torch.int64).double() / 2 ** 21).to(dtype)


def _all_results(dtype):
    """Every op on data spanning several chunks, returned as one list of tensors."""
    gen = torch.Generator().manual_seed(16)
    shapes = [(300000,), (5,), (64, 32, 3, 3), (1025,), (200000,)]
    params = [_exact_rand(s, gen, dtype) for s in shapes]
    grads = [_exact_rand(s, gen, dtype) for s in shapes]
    bufs = [_exact_rand(s, gen, dtype) for s in shapes]
    out = []
    for mode in MODES:
        p, b = clone(params), clone(bufs)
        st = ops.nar_step_(p, grads, lr=0.1, weight_decay=0.01, max_norm=3.0, mode=mode, momentum=0.9,
                           momentum_buffers=b, backend="cpu")
        out += p + b + list(st)
    X = _exact_rand((4, 150001), gen, dtype)
    G = _exact_rand((4, 150001), gen, dtype)
    Xb = X.clone()
    out += [Xb] + list(ops.nar_step_batched_(Xb, G, lr=torch.tensor([0.1, 0.2, 0.3, 0.4]), max_norm=2.0,
                                             backend="cpu"))
    agg, st = ops.aggregate(X, torch.tensor([0.1, 0.2, 0.3, 0.4]), nonfinite="propagate", backend="cpu")
    out += [agg, st.client_sq_norms, st.sq_norm]
    out.append(ops.client_dots(X, G[0], backend="cpu"))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_results_independent_of_thread_count(dtype, threads):
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(_all_results(dtype))
    for other in results[1:]:
        assert_bitwise(results[0], other)


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_results_independent_of_instruction_set(level):
    """The DEFAULT (SSE2), AVX2 and AVX-512 builds of the kernels give the same bits:
    the same 32-lane reduction layout and no FMA in any of them."""
    assert_level_agrees_with_default("test_cpu_kernels", "_all_results", level)


# --------------------------------------------------------------------------------------
# the build


def test_cpu_isa_follows_torch():
    """The kernels run the instruction set torch's own CPU kernels use."""
    isa = torch.ops.fedopt_C.cpu_isa()
    expected = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in ("x86_64", "amd64") and expected in ("DEFAULT", "AVX2", "AVX512"):
        assert isa == expected
    else:
        assert isa == "DEFAULT"


def _extension_path():
    import fedopt_kernels._C as ext

    return ext.__file__


_ISA_NAMESPACE = re.compile(r"\bAVX(2|512)\b")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 instruction sets")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_avx_code_only_in_per_isa_namespaces():
    """Only the per-ISA kernels may contain VEX/EVEX (AVX) instructions; anything else
    compiled for AVX (e.g. a shared inline function whose AVX2 copy the linker kept)
    would crash on a CPU without AVX2."""
    dump = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", _extension_path()], capture_output=True,
                          text=True, check=True).stdout
    func, offenders, n_avx, default_avx = None, set(), 0, False
    for line in dump.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            func = m.group(1)
            continue
        parts = line.split("\t")
        if len(parts) < 2 or func is None:
            continue
        mnemonic = parts[1].split()[0] if parts[1].split() else ""
        if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
            if _ISA_NAMESPACE.search(func):
                n_avx += 1
            else:
                offenders.add(func)
                default_avx = default_avx or "::DEFAULT::" in func
    if default_avx:
        pytest.skip("the whole library was compiled for an AVX target (e.g. CFLAGS=-march=native): "
                    "it needs such a CPU anyway")
    assert n_avx > 0, "no AVX code at all: were the AVX2/AVX-512 kernels compiled?"
    assert not offenders, f"AVX instructions outside the per-ISA kernels: {sorted(offenders)[:10]}"


def test_raw_ops_check_what_would_be_memory_unsafe():
    p, g = [torch.zeros(5)], [torch.zeros(4)]
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.nar_step_(p, g, [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    with pytest.raises(RuntimeError, match="grads"):
        torch.ops.fedopt_C.nar_step_(p, [], [], 0.1, None, 0.0, None, 1.0, 0, 0.0, None, None)
    with pytest.raises(RuntimeError, match="momentum_buffers"):
        torch.ops.fedopt_C.nar_step_(p, [torch.zeros(5)], [], 0.1, None, 0.0, None, 1.0, 0, 0.9, None, None)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.fedopt_C.nar_step_(p, [torch.zeros(5, dtype=torch.float64)], [], 0.1, None, 0.0, None, 1.0, 0,
                                     0.0, None, None)
    with pytest.raises(RuntimeError, match="dense"):
        torch.ops.fedopt_C.nar_step_([torch.zeros(10)[::2]], [torch.zeros(5)], [], 0.1, None, 0.0, None, 1.0, 0,
                                     0.0, None, None)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.nar_step_batched_(torch.zeros(2, 3), torch.zeros(2, 3), None, 0.1, torch.zeros(3), 0.0,
                                             None, 1.0, 0, 0.0, None, None)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.aggregate([torch.zeros(2, 3)], torch.ones(3), 1.0, None, torch.zeros(3), None)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.aggregate([torch.zeros(2, 3)], torch.ones(2), 1.0, None, torch.zeros(4), None)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.fedopt_C.client_dots([torch.zeros(3), torch.zeros(4)], torch.zeros(3))
