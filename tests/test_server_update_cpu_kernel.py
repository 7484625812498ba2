"""What is specific to the CPU kernel of fedopt_C::server_update_
(csrc/cpu/server_update.cpp): its results do not depend on the thread count nor on the
instruction set the kernels were dispatched to, the raw op routes a call without tensors
by its skip flag, and it refuses what would be memory-unsafe.

That it matches the contract's formulas BIT FOR BIT (tests/_server_update_oracle.py) in
every dtype, with every load path, skip flag and special value, is checked for every
backend by tests/test_contract_server_update.py.
"""

from __future__ import annotations

import pytest
import torch

from _contract import assert_bitwise
from _cpu_isa import assert_level_agrees_with_default
from python_ref.fednar import compute_dtype as acc_of  # the oracle's accumulation dtype

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# (rule, nesterov): 0 sgd, 1 momentum (heavy ball / nesterov), 2 adagrad, 3 adam, 4 yogi
RULES = [(0, False), (1, False), (1, True), (2, False), (3, False), (4, False)]
# > 2 * 2**18 elements in all (kMinElementsPerThread): two threads get work; 300007
# and 278011 end in ragged chunks of 64Ki, and an empty tensor sits in the middle.
LIST = [(300007,), (0,), (5,), (64, 32, 3, 3), (1025,), (1,), (278011,)]
HYPER = dict(lr=0.03, gamma=0.9, beta1=0.9, beta2=0.99, tau=1e-3)

pytestmark = pytest.mark.usefixtures("cpu_extension")


# --------------------------------------------------------------------------------------
# data


def make(shapes, dtype, *, seed=0, exact=False):
    """params, updates, exp_avg, exp_avg_sq.  The updates are views of one flat acc vector
    at odd element offsets (pointers only 4-byte aligned).  Every 97th element is a Yogi
    tie (v == D^2 exactly: sign 0) and every 89th has D = 0.  `exact`: values with 21
    fractional bits, drawn the same by every instruction set's torch kernels."""
    gen = torch.Generator().manual_seed(seed)
    acc = acc_of(dtype)

    def rand(n, scale):
        if exact:
            return torch.randint(-(2 ** 22), 2 ** 22, (n,), generator=gen, dtype=torch.int64).double() / 2 ** 21 * scale
        return torch.randn(n, generator=gen, dtype=torch.float64) * scale

    sizes = [torch.Size(s).numel() for s in shapes]
    total = sum(sizes)
    flat = rand(total + 3, 0.1)
    x, m, v = rand(total, 1.0), rand(total, 0.1), rand(total, 0.1).abs() * 0.2
    tie, zero = torch.arange(total) % 97 == 0, torch.arange(total) % 89 == 0
    d = flat[1:1 + total]
    d[tie] = 0.25
    v[tie] = 0.0625
    d[zero] = 0.0
    flat = flat.to(acc)
    params, updates, exp_avg, exp_avg_sq, off = [], [], [], [], 0
    for s, n in zip(shapes, sizes):
        params.append(x[off:off + n].to(dtype).view(s))
        updates.append(flat[1 + off:1 + off + n].view(s))
        exp_avg.append(m[off:off + n].to(dtype).view(s))
        exp_avg_sq.append(v[off:off + n].to(dtype).view(s))
        off += n
    return params, updates, exp_avg, exp_avg_sq


def run(params, updates, exp_avg, exp_avg_sq, rule, nesterov, *, lr, gamma, beta1, beta2, tau, skip=None):
    """torch.ops.fedopt_C.server_update_ on copies; lr / gamma: float or 0-d tensor.
    Returns the copies (params, the state lists the rule has)."""
    x = [t.clone() for t in params]
    m = [t.clone() for t in exp_avg] if rule >= 1 else []
    v = [t.clone() for t in exp_avg_sq] if rule >= 2 else []
    lr_f, lr_t = (0.0, lr) if isinstance(lr, torch.Tensor) else (lr, None)
    gamma_f, gamma_t = (0.0, gamma) if isinstance(gamma, torch.Tensor) else (gamma, None)
    torch.ops.fedopt_C.server_update_(x, updates, m, v, rule, lr_f, lr_t, gamma_f, gamma_t, beta1, beta2, tau,
                                      nesterov, skip)
    return x, m, v


# --------------------------------------------------------------------------------------
# determinism


def _all_results(dtype):
    """Every rule on LIST (several chunks and threads), as one list of tensors."""
    data = make(LIST, dtype, seed=12, exact=True)
    out = []
    for rule, nesterov in RULES:
        x, m, v = run(*data, rule, nesterov, **HYPER)
        out += x + m + v
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_independent_of_thread_count(dtype, threads):
    threads(1)
    one = _all_results(dtype)
    threads(2)
    assert_bitwise(one, _all_results(dtype))


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_independent_of_instruction_set(level):
    """The DEFAULT (SSE2), AVX2 and AVX-512 builds give the same bits: no FMA in any,
    IEEE sqrt and division in all, and the same selects for Yogi's sign."""
    assert_level_agrees_with_default("test_server_update_cpu_kernel", "_all_results", level)


# --------------------------------------------------------------------------------------
# edge cases and checks


def test_raw_op_without_tensors_goes_by_the_skip_flag():
    # With no tensor at all the dispatcher has no device to go by (the backend and
    # ops.server_update_ return before the call); a CPU skip flag routes it here.
    torch.ops.fedopt_C.server_update_([], [], [], [], 3, 0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False,
                                      torch.tensor(False))


def test_raw_op_checks_what_would_be_memory_unsafe():
    op = torch.ops.fedopt_C.server_update_
    p, d = [torch.zeros(5)], [torch.zeros(5)]
    rest = (0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False, None)
    with pytest.raises(RuntimeError, match="elements"):
        op(p, [torch.zeros(4)], [], [], 0, *rest)
    with pytest.raises(RuntimeError, match="updates"):
        op(p, [], [], [], 0, *rest)
    with pytest.raises(RuntimeError, match="dtype"):  # updates in the acc dtype, not the params'
        op([torch.zeros(5, dtype=torch.float16)], [torch.zeros(5, dtype=torch.float16)], [], [], 0, *rest)
    with pytest.raises(RuntimeError, match="exp_avg"):
        op(p, d, [], [], 1, *rest)
    with pytest.raises(RuntimeError, match="exp_avg_sq"):
        op(p, d, [torch.zeros(5)], [], 3, *rest)
    with pytest.raises(RuntimeError, match="exp_avg_sq"):
        op(p, d, [torch.zeros(5)], [torch.zeros(5, dtype=torch.float64)], 4, *rest)
    with pytest.raises(RuntimeError, match="contiguous"):
        op([torch.zeros(4, 3).t()], [torch.zeros(12)], [], [], 0, *rest)
    with pytest.raises(RuntimeError, match="rule"):
        op(p, d, [], [], 5, *rest)
