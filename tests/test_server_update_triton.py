"""What is specific to the ``triton`` backend's ``server_update_``: the chunk table
(per-column element sizes, the per-chunk alignment flag that picks the vectorised or
the scalar body, the cache), no launch for a call without elements, kernel
specialisation (float hyperparameters are runtime fp64 arguments), and on a GPU that
no call synchronises with the host.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py
sets TRITON_INTERPRET=1 before any kernel is defined); with one it runs compiled on
CUDA tensors.  That its results are the contract's formulas to the bit (fp32, fp64,
fp16, bf16), for every rule,
dtype, load path, skip flag and special value, is checked for every backend by
tests/test_contract_server_update.py.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from conftest import import_triton_module
from _asserts import acc_of
from fedopt_kernels.backends.hyper import split

TB = import_triton_module("fedopt_kernels.backends.triton")
_tables = importlib.import_module("fedopt_kernels.backends.triton._tables")
_chunks = importlib.import_module("fedopt_kernels.backends._chunks")
_kernels = importlib.import_module("fedopt_kernels.backends.triton.server_update")


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

    def run(self, nesterov=False, skip=None, **hyper):
        """Run the backend on copies; returns (params, exp_avg, exp_avg_sq) after."""
        h = dict(HYPER, **hyper)
        p, m, v = ([_copy(t) for t in ts] for ts in (self.params, self.exp_avg, self.exp_avg_sq))
        TB.server_update_(p, self.updates, m, v, self.rule, *split(h["lr"]), *split(h["gamma"]), h["beta1"],
                          h["beta2"], h["tau"], nesterov, skip)
        return p, m, v

    def aligned(self):
        """The chunk flags of this call's table: True (all aligned), False (none) or "mixed"."""
        on = self.table().chunks[:, _chunks.COL_FLAGS] == _chunks.FLAG_ALIGNED16
        return bool(on.all()) if bool(on.all()) or not bool(on.any()) else "mixed"

    def table(self):
        return _tables.server_table(self.params, self.updates, self.exp_avg, self.exp_avg_sq)


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,rule,nesterov", RULES, ids=RULE_IDS)
def test_odd_update_views_take_the_unaligned_variant(dev, dtype, name, rule, nesterov):
    assert Case(SIZES, dtype, rule, dev, aligned_updates=False, seed=rule).aligned() is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name,rule,nesterov", [RULES[0], RULES[2], RULES[4], RULES[5]],
                         ids=["sgd", "nesterov", "adam", "yogi"])
def test_aligned_updates_take_the_aligned_variant(dev, dtype, name, rule, nesterov):
    case = Case([(4096,), (1,), (0,), (20000,), (37,)], dtype, rule, dev, aligned_updates=True, seed=10 + rule)
    assert case.aligned() is True


def test_empty_calls_launch_nothing(dev, monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for a call without elements")

    monkeypatch.setattr(TB, "server_update_kernel", NoLaunch())
    empty = torch.empty(0, device=dev)
    acc = acc_of(torch.float32)
    for rule in range(5):
        TB.server_update_([], [], [], [], rule, 0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False, None)
        p = [empty.clone(), torch.empty(0, 3, device=dev)]
        d = [torch.empty(0, dtype=acc, device=dev), torch.empty(0, 3, dtype=acc, device=dev)]
        m = [t.clone() for t in p] if rule >= 1 else []
        v = [t.clone() for t in p] if rule >= 2 else []
        TB.server_update_(p, d, m, v, rule, 0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False, torch.tensor(False, device=dev))


def test_params_and_state_as_misaligned_views_take_the_unaligned_variant(dev):
    """Contiguous views at odd offsets of params / state (not only of the updates)."""
    for rule in (1, 4):
        case = Case([(3000,), (17,)], torch.float16, rule, dev, aligned_updates=True, seed=50 + rule)
        assert case.aligned() is True
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
        assert case.aligned() is False


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
