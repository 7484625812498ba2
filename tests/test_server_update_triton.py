"""The triton backend's ``server_update_`` against an independent PyTorch oracle of the
contract formulas (csrc/include/fedopt/math.h ``server_update_*``).

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py
sets TRITON_INTERPRET=1 before any kernel is defined); with one it runs compiled on
CUDA tensors.  The backend function is called directly, with the contract's arguments
(the ops layer, which validates them, is tested in tests/test_server_update.py).

Exactness: the oracle computes every formula in the acc dtype with one torch op per
operation, in math.h's order, so each operation is rounded once, as in the kernel
(numpy in the interpreter; PTX ``.rn`` operations on the GPU, where the kernel is
launched with FMA contraction off), and division and square root are correctly rounded
on both sides (``div_rn`` / ``sqrt_rn`` in the kernel, numpy's in the oracle).  Float
hyperparameters are rounded once, fp64 -> acc to nearest, on both sides.  So fp32 and
fp64 results must agree to the last bit (0 ulp, not 1), and so must fp16 (both sides
round the acc value to nearest even when storing).  bf16 too on the GPU; the
interpreter converts fp32 -> bf16 by truncation, so there a bf16 value may also be the
truncated acc value (1 bf16 ulp below in magnitude), and nothing else.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from _server_update_oracle import server_update_exact, sqrt_rn
from conftest import import_triton_module
from fedopt_kernels import backends

TB = import_triton_module("fedopt_kernels.backends.triton")
_tables = importlib.import_module("fedopt_kernels.backends.triton._tables")
_chunks = importlib.import_module("fedopt_kernels.backends._chunks")
_kernels = importlib.import_module("fedopt_kernels.backends.triton.server_update")

def acc_of(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype the kernels promise: fp64 for fp64 data, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# (id, rule, nesterov): math.h ServerRule
RULES = [("sgd", 0, False), ("momentum", 1, False), ("nesterov", 1, True), ("adagrad", 2, False),
         ("adam", 3, False), ("yogi", 4, False)]
RULE_IDS = [r[0] for r in RULES]
# Not exactly representable in fp32 (0.05, 0.9, 0.99, 1e-3, 1.3): exercises the rounding
# of the fp64 kernel arguments to the acc dtype.
HYPER = dict(lr=0.05, gamma=1.3, beta1=0.9, beta2=0.99, tau=1e-3)
SIZES = [(5,), (0,), (1025,), (7, 13), (1,), (70001,)]


@pytest.fixture(scope="module")
def dev(triton_device):
    return triton_device


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ----------------------------------------------------------------------------- oracle

def oracle(x, d, m, v, rule, nesterov, lr, gamma, beta1, beta2, tau):
    """New ``(x, m, v)`` in the acc dtype (before the store rounding; None where the rule
    has no such state): the contract evaluated exactly (tests/_server_update_oracle.py)."""
    return server_update_exact(rule, nesterov, x, d, m, v, lr=lr, gamma=gamma, beta1=beta1, beta2=beta2, tau=tau)


def assert_stored(out, acc_values, what):
    """``out`` (params' dtype) is ``acc_values`` stored: rounded to nearest even, bit for
    bit; for bf16 in the interpreter, the truncated value is accepted too."""
    out = out.detach().cpu().reshape(-1)
    acc_values = acc_values.reshape(-1)
    good = bits(out) == bits(acc_values.to(out.dtype))
    if out.dtype == torch.bfloat16 and backends.triton_interpret_mode():
        truncated = (bits(acc_values) >> 16).to(torch.int16)  # arithmetic shift: the top 16 bits
        good |= bits(out) == truncated
    bad = (~good).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {out.numel()} elements differ, first at {i}: "
                             f"got {out[i].item()!r}, want {acc_values[i].item()!r} rounded to {out.dtype}")


# ----------------------------------------------------------------------------- cases

def _copy(t):
    """A copy of ``t`` at the same address offset modulo 16 (``clone`` would realign a
    misaligned view): a view at ``t``'s storage offset of a fresh allocation."""
    o = t.storage_offset()
    c = torch.empty(o + t.numel(), dtype=t.dtype, device=t.device)[o:].view(t.shape)
    return c.copy_(t)


class Case:
    """Data of one call: params, updates as views of one flat acc vector, state lists."""

    def __init__(self, sizes, dtype, rule, dev, aligned_updates=False, seed=0):
        acc = acc_of(dtype)
        g = torch.Generator().manual_seed(seed)
        numels = [math.prod(s) for s in sizes]
        step = 16 // torch.empty((), dtype=acc).element_size()  # elements per 16 bytes
        # Offsets of the views: all 16-byte aligned, or all at odd element offsets (only
        # 4- / 8-byte aligned), as slices of the flat mean update of a real call are.
        offs, o = [], 1
        for n in numels:
            if aligned_updates:
                o = -(-o // step) * step
            elif o % 2 == 0:
                o += 1
            offs.append(o)
            o += n + 1
        flat = torch.randn(o + step, generator=g, dtype=acc) * 0.5
        params = [torch.randn(s, generator=g).to(dtype) for s in sizes]
        m = [(torch.randn(s, generator=g) * 0.1).to(dtype) for s in sizes] if rule >= 1 else []
        v = [(torch.rand(s, generator=g) * 0.5).to(dtype) for s in sizes] if rule >= 2 else []
        # Elements with v == D * D exactly (D = +-0.5 and 0.25 are exact in every dtype):
        # Yogi's sign(v - d2) is 0 there, so v stays as it is.
        for i, (a, n) in enumerate(zip(offs, numels)):
            flat[a:a + n][3::11] = 0.5
            flat[a:a + n][9::11] = -0.5
            if v:
                v[i].view(-1)[3::11] = 0.25
                v[i].view(-1)[9::11] = 0.25
        self.flat = flat.to(dev)
        self.updates = [self.flat[a:a + n].view(s) for a, n, s in zip(offs, numels, sizes)]
        self.params = [t.to(dev) for t in params]
        self.exp_avg = [t.to(dev) for t in m]
        self.exp_avg_sq = [t.to(dev) for t in v]
        self.rule = rule
        self.aligned = None  # the last run's chunk flags: True (all aligned), False (none) or "mixed"

    def run(self, nesterov=False, skip=None, **hyper):
        """Run the backend on copies; returns (params, exp_avg, exp_avg_sq) after."""
        h = dict(HYPER, **hyper)
        p, m, v = ([_copy(t) for t in ts] for ts in (self.params, self.exp_avg, self.exp_avg_sq))
        TB.server_update_(p, self.updates, m, v, self.rule, h["lr"], h["gamma"], h["beta1"], h["beta2"],
                          h["tau"], nesterov, skip)
        if any(t.numel() for t in p):
            flags = _tables.server_table(p, self.updates, m, v).chunks[:, _chunks.COL_FLAGS]  # the call's table
            on = flags == _chunks.FLAG_ALIGNED16
            self.aligned = bool(on.all()) if bool(on.all()) or not bool(on.any()) else "mixed"
        return p, m, v

    def check(self, got, nesterov=False, **hyper):
        h = dict(HYPER, **hyper)
        p, m, v = got
        for i, x in enumerate(self.params):
            mi = self.exp_avg[i].cpu().reshape(-1) if self.exp_avg else None
            vi = self.exp_avg_sq[i].cpu().reshape(-1) if self.exp_avg_sq else None
            X, M, V = oracle(x.cpu().reshape(-1), self.updates[i].cpu().reshape(-1), mi, vi, self.rule,
                             nesterov, **h)
            assert p[i].shape == x.shape and p[i].dtype == x.dtype
            assert_stored(p[i], X, f"params[{i}]")
            if M is not None:
                assert_stored(m[i], M, f"exp_avg[{i}]")
            if V is not None:
                assert_stored(v[i], V, f"exp_avg_sq[{i}]")

    def table(self):
        return _tables.server_table(self.params, self.updates, self.exp_avg, self.exp_avg_sq)


def _hyper_tensor(value, dtype, dev):
    return torch.tensor(value, dtype=acc_of(dtype), device=dev)


# ----------------------------------------------------------------------------- tests

def test_oracle_sqrt_is_correctly_rounded():
    vals = [2.0, 3.0, 0.1, 1e-300, 7.0e200, 0.25, 12345.678]
    got = sqrt_rn(torch.tensor(vals, dtype=torch.float64)).tolist()
    assert got == [math.sqrt(a) for a in vals]
    f32 = torch.rand(10000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sqrt_rn(f32), f32.double().sqrt().float())  # 24-bit roots: fp64 suffices


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,rule,nesterov", RULES, ids=RULE_IDS)
def test_every_rule_and_dtype_odd_sizes_unaligned_updates(dev, dtype, name, rule, nesterov):
    case = Case(SIZES, dtype, rule, dev, aligned_updates=False, seed=rule)
    upd = [u.clone() for u in case.updates]
    case.check(case.run(nesterov), nesterov)
    assert case.aligned is False  # the odd update views force the unaligned variant
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(case.updates, upd))  # read only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name,rule,nesterov", [RULES[0], RULES[2], RULES[4], RULES[5]],
                         ids=["sgd", "nesterov", "adam", "yogi"])
def test_aligned_updates_take_the_aligned_variant(dev, dtype, name, rule, nesterov):
    case = Case([(4096,), (1,), (0,), (20000,), (37,)], dtype, rule, dev, aligned_updates=True, seed=10 + rule)
    case.check(case.run(nesterov), nesterov)
    assert case.aligned is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("name,rule,nesterov", RULES, ids=RULE_IDS)
def test_tensor_lr_and_gamma(dev, dtype, name, rule, nesterov):
    """0-d acc tensors (read in the kernel) give the oracle's result, and the same bits
    as the float they hold."""
    case = Case([(3000,), (5,)], dtype, rule, dev, seed=20 + rule)
    lr_t, gamma_t = _hyper_tensor(0.05, dtype, dev), _hyper_tensor(1.3, dtype, dev)
    for lr, gamma in [(lr_t, gamma_t), (lr_t, 1.3), (0.05, gamma_t)]:
        got = case.run(nesterov, lr=lr, gamma=gamma)
        case.check(got, nesterov, lr=lr, gamma=gamma)
    want = case.run(nesterov)
    for a, b in zip(sum(got, []), sum(want, [])):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("name,rule,nesterov", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_skip(dev, dtype, name, rule, nesterov):
    """skip True: every bit stays (params and state); False and None: the step."""
    case = Case([(2049,), (0,), (3,)], dtype, rule, dev, seed=30 + rule)
    lr = _hyper_tensor(0.05, dtype, dev)
    p, m, v = case.run(nesterov, skip=torch.tensor(True, device=dev), lr=lr)
    for a, b in zip(p + m + v, case.params + case.exp_avg + case.exp_avg_sq):
        assert torch.equal(bits(a), bits(b))
    for skip in (torch.tensor(False, device=dev), None):
        case.check(case.run(nesterov, skip=skip), nesterov)


def test_empty_calls_launch_nothing(dev, monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for a call without elements")

    monkeypatch.setattr(TB, "server_update_kernel", NoLaunch())
    empty = torch.empty(0, device=dev)
    acc = acc_of(torch.float32)
    for rule in range(5):
        TB.server_update_([], [], [], [], rule, 0.1, 1.0, 0.9, 0.99, 1e-3, False, None)
        p = [empty.clone(), torch.empty(0, 3, device=dev)]
        d = [torch.empty(0, dtype=acc, device=dev), torch.empty(0, 3, dtype=acc, device=dev)]
        m = [t.clone() for t in p] if rule >= 1 else []
        v = [t.clone() for t in p] if rule >= 2 else []
        TB.server_update_(p, d, m, v, rule, 0.1, 1.0, 0.9, 0.99, 1e-3, False, torch.tensor(False, device=dev))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_single_element_and_empty_in_list(dev, dtype):
    for rule in range(5):
        case = Case([(1,), (0,), (0, 4)], dtype, rule, dev, seed=40 + rule)
        case.check(case.run())


def test_params_and_state_as_misaligned_views(dev):
    """Contiguous views at odd offsets of params / state (not only of the updates)."""
    for rule in (1, 4):
        case = Case([(3000,), (17,)], torch.float16, rule, dev, aligned_updates=True, seed=50 + rule)
        case.run()
        assert case.aligned is True
        for name in ("params", "exp_avg", "exp_avg_sq"):
            ts = getattr(case, name)
            if not ts:
                continue
            flat = torch.empty(sum(t.numel() for t in ts) + 8, dtype=ts[0].dtype, device=dev)
            o, views = 3, []
            for t in ts:
                views.append(flat[o:o + t.numel()].view(t.shape))
                views[-1].copy_(t)
                o += t.numel() + 1
            setattr(case, name, views)
        case.check(case.run())
        assert case.aligned is False


def test_table_layout_and_cache(dev):
    """Per-column element sizes: x, m, v advance by the params' element size, D by the acc
    dtype's; a repeated call hits the cache."""
    _tables.clear_cache()
    case = Case([(20000,), (5,), (0,)], torch.float16, 2, dev, aligned_updates=True)
    t1, t2 = case.table(), case.table()
    assert t1 is t2 and _tables.stats["hits"] == 1 and _tables.stats["misses"] == 1
    rows = t1.chunks.cpu().tolist()
    assert t1.chunk_size == 2048 and t1.n_chunks == 11 and len(rows[0]) == _chunks.ROW_COLS
    x0, d0 = case.params[0].data_ptr(), case.updates[0].data_ptr()
    m0, v0 = case.exp_avg[0].data_ptr(), case.exp_avg_sq[0].data_ptr()
    assert rows[1][:5] == [x0 + 2048 * 2, d0 + 2048 * 4, m0 + 2048 * 2, v0 + 2048 * 2, 2048]
    assert rows[9][4] == 20000 - 9 * 2048
    assert rows[10][:5] == [t[1].data_ptr() for t in (case.params, case.updates, case.exp_avg, case.exp_avg_sq)] + [5]
    assert all(r[5] == 0 and r[6] == _chunks.FLAG_ALIGNED16 for r in rows)
    sgd = Case([(20000,)], torch.float32, 0, dev)  # no state: zero addresses
    assert all(r[2] == 0 and r[3] == 0 for r in sgd.table().chunks.cpu().tolist())


def test_float_hyperparameters_are_runtime_fp64_args():
    """Float hyperparameters are declared fp64 and never value-specialized: a new lr,
    beta or tau reuses the compiled kernel."""
    kernel = _kernels.server_update_kernel
    fn = getattr(kernel, "fn", kernel)
    ann = {k: str(v) for k, v in fn.__annotations__.items()}
    for n in ("lr_value", "gamma_value", "beta1", "beta2", "tau"):
        assert ("fp64" in ann[n] or "float64" in ann[n]) and "constexpr" not in ann[n], (n, ann[n])


@pytest.mark.cuda
def test_no_host_sync_on_cuda(dev):
    if dev.type != "cuda":
        pytest.skip("needs the compiled kernels on a CUDA device")
    case = Case([(1000,), (3, 3)], torch.float32, 4, dev, seed=60)
    lr, skip = torch.tensor(0.05, device=dev), torch.tensor(False, device=dev)
    case.run(lr=lr, skip=skip)  # warm up: compile, build the table
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.run(lr=lr, skip=skip)
        case.run(lr=0.01, beta1=0.8, skip=skip)
    finally:
        torch.cuda.set_sync_debug_mode(0)
