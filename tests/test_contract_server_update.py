"""The backend contract of ``server_update_`` run against every backend (reference, cpu,
triton, cuda) through the backend module itself (fedopt_kernels/backends/__init__.py),
against the exact oracle of tests/_server_update_oracle.py (the contract's operations
one torch op at a time in the acc dtype, math.h's order, an IEEE sqrt).

The kernels (cpu, cuda, triton) must match the oracle BIT FOR BIT in every dtype: each
operation rounded separately in that order (no FMA contraction), IEEE division and
square root, stores rounded to nearest even (Triton's interpreter too: its fp32 -> bf16
conversion truncated until fedopt_kernels/backends/triton/_interpreter_compat.py made
it round).  One exception, stated in ``check_server``: the reference backend evaluates
python_ref/server_optimizers.py's formulas in another order (held to the dtype's
tolerance; tests/test_server_update.py compares every backend to python_ref).

Load paths reached on purpose: everything 16-byte aligned, updates at odd offsets of
one flat acc vector (as the ops layer passes them), updates at aligned offsets of it,
params and state at odd offsets too (guarded), scalar tails, empty tensors, several
chunks and threads, grown chunk sizes; Yogi's ties (v == D^2 exactly) and D = 0;
non-finite values; float and 0-d tensor lr / gamma; the in-kernel skip flag.
"""

from __future__ import annotations

import math

import pytest
import torch

from _contract import DTYPES, acc_of, assert_bitwise, bits, same_bits
from _server_update_oracle import server_update_exact, sqrt_rn
from fedopt_kernels import backends
from fedopt_kernels.backends.hyper import split


@pytest.fixture
def be(backend_impl):
    return backend_impl


# (rule, nesterov) by name: math.h ServerRule 0 sgd, 1 momentum (heavy ball / nesterov),
# 2 adagrad, 3 adam, 4 yogi
RULES = {"sgd": (0, False), "momentum": (1, False), "nesterov": (1, True), "adagrad": (2, False),
         "adam": (3, False), "yogi": (4, False)}
HYPER = dict(lr=0.03, gamma=0.9, beta1=0.9, beta2=0.99, tau=1e-3)
# Not exactly representable in fp32: exercises the rounding of float hyperparameters.
HYPER_INEXACT = dict(lr=0.05, gamma=1.3, beta1=0.9, beta2=0.99, tau=1e-3)
HYPER_OTHER = dict(lr=0.3, gamma=0.9, beta1=0.8, beta2=0.95, tau=1e-2)
# > 2 * 2**18 elements in all: two CPU threads get work; 300007 and 278011 end in ragged
# chunks, and an empty tensor sits in the middle.
LIST = [(300007,), (0,), (5,), (64, 32, 3, 3), (1025,), (1,), (278011,)]
LIST_SMALL = [(5,), (0,), (1025,), (7, 13), (1,), (70001,)]


class ServerCase:
    """params, updates (acc dtype), exp_avg and exp_avg_sq for one rule (state lists empty
    where the rule has none), placed as ``layout`` says:

    * ``"separate"``: every tensor its own allocation (all 16-byte aligned);
    * ``"flat"``: updates are views at odd element offsets of ONE flat acc vector, as
      the ops layer passes them (most not 16-byte aligned);
    * ``"aligned"``: updates are views at 16-byte aligned offsets of one flat vector;
    * ``"views"``: params and state are views at odd offsets of guarded flat buffers too.

    Values: x ~ N(0, 1), D ~ N(0, 0.3^2), m ~ N(0, 0.1^2), v in [1e-4, 0.05); Yogi ties
    (v == D^2 exactly: sign 0) at every 11th element from 3 and 9 (D = +-0.5) and every
    97th (D = 0.25), D = 0 at every 89th.
    """

    def __init__(self, be, rule, dtype, shapes, *, seed=0, layout="flat"):
        self.be, self.dtype, self.layout = be, dtype, layout
        self.code, self.nesterov = RULES[rule]
        acc = acc_of(dtype)
        gen = torch.Generator().manual_seed(seed)
        sizes = [math.prod(s) for s in shapes]
        total = sum(sizes)
        x = torch.randn(total, generator=gen, dtype=torch.float64)
        d = torch.randn(total, generator=gen, dtype=torch.float64) * 0.3
        m = torch.randn(total, generator=gen, dtype=torch.float64) * 0.1
        v = torch.rand(total, generator=gen, dtype=torch.float64) * 0.05 + 1e-4
        for start, value in ((3, 0.5), (9, -0.5)):
            d[start::11] = value
            v[start::11] = 0.25
        d[::97], v[::97] = 0.25, 0.0625
        d[::89] = 0.0
        self.guards = []
        views = layout == "views"
        self.params = self._place(x, dtype, shapes, sizes, views)
        self.updates = self._place_updates(d.to(acc), shapes, sizes)
        self.exp_avg = self._place(m, dtype, shapes, sizes, views) if self.code >= 1 else []
        self.exp_avg_sq = self._place(v, dtype, shapes, sizes, views) if self.code >= 2 else []

    def _place(self, values, dtype, shapes, sizes, as_views, offset=1):
        dev = self.be.device
        if as_views:
            buf = torch.full((values.numel() + offset + 1,), 7.0, dtype=dtype, device=dev)
            buf[offset:offset + values.numel()] = values.to(dtype).to(dev)
            self.guards.append((buf, torch.cat([buf[:offset], buf[-1:]]).clone()))
        out, at = [], 0
        for s, n in zip(shapes, sizes):
            if as_views:
                out.append(buf[offset + at:offset + at + n].view(s))
            else:
                out.append(values[at:at + n].to(dtype).view(s).clone().to(dev))
            at += n
        return out

    def _place_updates(self, d, shapes, sizes):
        if self.layout in ("separate",):
            return self._place(d, d.dtype, shapes, sizes, False)
        step = 16 // d.element_size()  # elements per 16 bytes
        offs, o = [], 1
        for n in sizes:
            if self.layout == "aligned":
                o = -(-o // step) * step
            offs.append(o)
            o += n
        flat = torch.full((o + step,), 5.0, dtype=d.dtype)
        for a, n, at in zip(offs, sizes, [sum(sizes[:i]) for i in range(len(sizes))]):
            flat[a:a + n] = d[at:at + n]
        self.flat = flat.to(self.be.device)
        return [self.flat[a:a + n].view(s) for a, n, s in zip(offs, sizes, shapes)]

    def writable(self):
        return self.params + self.exp_avg + self.exp_avg_sq

    def clone(self):
        """The same values in fresh aligned tensors (updates shared: they are only read)."""
        c = object.__new__(ServerCase)
        c.__dict__.update(self.__dict__)
        c.guards = []
        c.params, c.exp_avg, c.exp_avg_sq = ([t.clone() for t in ts] for ts in (self.params, self.exp_avg,
                                                                                  self.exp_avg_sq))
        return c

    def run(self, *, skip=None, **hyper):
        """The backend's step in place; ``hyper`` overrides HYPER."""
        h = dict(HYPER, **hyper)
        self.be.server_update_(self.params, self.updates, self.exp_avg, self.exp_avg_sq, self.code, h["lr"],
                               h["gamma"], h["beta1"], h["beta2"], h["tau"], self.nesterov, skip)

    def expected(self, **hyper):
        """The oracle's new (params, exp_avg, exp_avg_sq) from the CURRENT values: CPU
        tensors in the acc dtype, before the store rounding."""
        h = dict(HYPER, **hyper)
        acc = acc_of(self.dtype)
        out = ([], [], [])
        for i, (p, u) in enumerate(zip(self.params, self.updates)):
            x = p.cpu().reshape(-1).to(acc)
            m = self.exp_avg[i].cpu().reshape(-1).to(acc) if self.exp_avg else None
            v = self.exp_avg_sq[i].cpu().reshape(-1).to(acc) if self.exp_avg_sq else None
            x, m, v = server_update_exact(self.code, self.nesterov, x, u.cpu().reshape(-1), m, v, **h)
            for lst, new in zip(out, (x, m, v)):
                if new is not None:
                    lst.append(new.view(p.shape))
        return out

    def check(self, expected, what, nan_ok=False):
        names = ("params", "exp_avg", "exp_avg_sq")
        for name, got, exp in zip(names, (self.params, self.exp_avg, self.exp_avg_sq), expected):
            assert len(got) == len(exp), (what, name)
            for i, (a, e) in enumerate(zip(got, exp)):
                check_server(self.be, a, e, f"{what}: {name}[{i}]", nan_ok=nan_ok)

    def assert_guards_untouched(self):
        for buf, before in self.guards:
            n = before.numel() - 1
            assert same_bits(torch.cat([buf[:n], buf[-1:]]), before), "wrote outside the views"


def check_server(be, out, acc_values, what, nan_ok=False):
    """``out`` (the params' dtype) is ``acc_values`` (the oracle's, acc dtype) stored:
    rounded to nearest even, bit for bit (NaN payloads aside when ``nan_ok``); the
    reference backend within the dtype's tolerance."""
    out = out.detach().cpu()
    assert out.shape == acc_values.shape, what
    stored = acc_values.to(out.dtype)
    if be.name == "reference":
        torch.testing.assert_close(out, stored, equal_nan=True, msg=lambda m: f"{what}: {m}")
        return
    good = bits(out) == bits(stored)
    if nan_ok:
        good |= torch.isnan(out) & torch.isnan(stored)
    bad = (~good).reshape(-1).nonzero().reshape(-1)
    if bad.numel():
        idx = bad[:5].tolist()
        raise AssertionError(f"{what}: {bad.numel()} of {out.numel()} elements differ in their bits, first at {idx}: "
                             f"got {out.reshape(-1)[idx].tolist()}, expected {stored.reshape(-1)[idx].tolist()}")


# Triton's interpreter computes in numpy, which warns on inf - inf, 0 / 0, ...: the IEEE
# results (NaN, inf) are what the cases check.
NUMPY_NONFINITE = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                             "ignore:divide by zero encountered:RuntimeWarning",
                                             "ignore:overflow encountered:RuntimeWarning")


def test_oracle_sqrt_is_correctly_rounded():
    vals = [2.0, 3.0, 0.1, 1e-300, 7.0e200, 0.25, 12345.678]
    got = sqrt_rn(torch.tensor(vals, dtype=torch.float64)).tolist()
    assert got == [math.sqrt(a) for a in vals]
    f32 = torch.rand(10000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sqrt_rn(f32), f32.double().sqrt().float())  # 24-bit roots: fp64 suffices


# ----------------------------------------------------------------------------- values

SHAPES = {"0": [(0,)], "1": [(1,)], "5": [(5,)], "1025": [(1025,)], "70001": [(70001,)], "list": LIST}


@pytest.mark.parametrize("shapes", list(SHAPES))
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_server_update_matches_the_formulas(be, dtype, rule, shapes):
    if be.small:
        shapes = {"70001": [(4099,)], "list": LIST_SMALL}.get(shapes, SHAPES[shapes])
    else:
        shapes = SHAPES[shapes]
    case = ServerCase(be, rule, dtype, shapes, seed=RULES[rule][0] + 10 * DTYPES.index(dtype))
    updates = [u.clone() for u in case.updates]
    expected = case.expected()
    case.run()
    case.check(expected, "floats")
    assert_bitwise(case.updates, updates, "updates (read only)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("layout", ["separate", "flat", "aligned", "views"])
def test_server_update_layouts(be, dtype, rule, layout):
    """Every load path, two rounds (the second reads the state the first one wrote), and
    nothing written outside the views."""
    sizes = [(0,), (1,), (5,), (1025,), (33, 31), (be.size(278011, 4099, host=70001),)]
    case = ServerCase(be, rule, dtype, sizes, seed=len(rule) + 10 * DTYPES.index(dtype), layout=layout)
    nonempty = [i for i, p in enumerate(case.params) if p.numel()]
    aligned = [case.params[i].data_ptr() % 16 == 0 for i in nonempty]
    d_aligned = [case.updates[i].data_ptr() % 16 == 0 for i in nonempty]
    if layout in ("separate", "aligned"):
        assert all(aligned) and all(d_aligned)
    elif layout == "flat":  # both the full-vector and the scalar-D variant occur
        assert all(aligned) and any(d_aligned) and not all(d_aligned)
    else:  # a view may still start aligned by chance; most do not
        assert not all(aligned)
    for rnd in range(2):
        expected = case.expected(**HYPER_OTHER)
        case.run(**HYPER_OTHER)
        case.check(expected, f"round {rnd}")
    case.assert_guards_untouched()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(RULES))
def test_server_update_tensor_lr_and_gamma(be, dtype, rule):
    """lr / gamma as 0-d acc tensors on the device (alone or both) give the oracle's
    result and the bits of the floats they hold (0.05 and 1.3 are not exact in fp32:
    both must round the same way); the kernel reads the tensors when it runs (a value
    changed on the device is used)."""
    acc = acc_of(dtype)
    # The CPU kernels read lr and gamma once on the host, before any chunk or thread
    # (csrc/cpu/server_update.cpp): several chunks, not the threads of LIST, show it.
    shapes = be.size(LIST, [(3000,), (5,), (1025,), (4099,)], host=[(70001,), (5,), (1025,), (4099,)])
    base = ServerCase(be, rule, dtype, shapes, seed=20 + RULES[rule][0])
    lr_t = torch.tensor(0.05, dtype=acc, device=be.device)
    gamma_t = torch.tensor(1.3, dtype=acc, device=be.device)
    floats = base.clone()
    expected = base.expected(**HYPER_INEXACT)
    floats.run(**HYPER_INEXACT)
    floats.check(expected, "floats")
    for lr, gamma in [(lr_t, gamma_t), (lr_t, 1.3), (0.05, gamma_t)]:
        case = base.clone()
        case.run(**dict(HYPER_INEXACT, lr=lr, gamma=gamma))
        case.check(expected, "0-d tensors")
        assert_bitwise(case.writable(), floats.writable(), "tensor vs float")
    # Changed on the device (no host round trip), then read by the next launch.
    lr_t.mul_(0.5)
    gamma_t.fill_(0.5)
    expected = floats.expected(**dict(HYPER_INEXACT, lr=lr_t, gamma=gamma_t))
    floats.run(**dict(HYPER_INEXACT, lr=lr_t, gamma=gamma_t))
    floats.check(expected, "updated 0-d tensors")


@NUMPY_NONFINITE
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(RULES))
def test_server_update_skip_flag(be, dtype, rule):
    """skip true writes nothing (even with NaN / Inf updates, with a float or tensor lr);
    the flag is read on the device when the kernel runs; false is exactly None."""
    # The CPU kernels read the flag once on the host, before any chunk or thread
    # (csrc/cpu/server_update.cpp): several chunks, not the threads of LIST, show it.
    shapes = be.size(LIST, [(2049,), (0,), (1,), (1025,), (3,)], host=[(70001,), (0,), (1,), (1025,), (3,)])
    case = ServerCase(be, rule, dtype, shapes, seed=30)
    case.updates[0].view(-1)[17] = float("nan")
    case.updates[3].view(-1)[5] = float("inf")
    nan_case = case.clone()
    nan_case.updates = [torch.full_like(d, float("nan")) for d in case.updates]
    before = [t.clone() for t in case.writable()]
    flag = torch.tensor(True, device=be.device)
    nan_case.run(skip=flag)  # a float lr
    case.run(lr=torch.tensor(0.3, dtype=acc_of(dtype), device=be.device), skip=flag)  # a tensor lr
    for c in (case, nan_case):
        assert_bitwise(c.writable(), before, "skipped")
    other = case.clone()
    flag.fill_(False)
    expected = case.expected()
    case.run(skip=flag)
    other.run(skip=None)
    assert_bitwise(case.writable(), other.writable(), "skip=False vs None")
    case.check(expected, "skip=False", nan_ok=True)
    assert not same_bits(case.params[0], before[0])


@NUMPY_NONFINITE
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(RULES))
def test_server_update_special_values(be, dtype, rule):
    """Zeros, infinities, NaN and v == D^2 exactly (Yogi's sign(0)) follow the oracle."""
    case = ServerCase(be, rule, dtype, [(37,)], seed=40, layout="separate")
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 0.5, -1.5, 0.25]
    u = case.updates[0]
    u[:len(specials)] = torch.tensor(specials, dtype=u.dtype, device=be.device)
    if case.exp_avg_sq:  # v = D^2 exactly (representable in every dtype for these D)
        v = case.exp_avg_sq[0]
        v[5:8] = (u[5:8] * u[5:8]).to(v.dtype)
        v[20] = 0.0
        u[20] = 0.0
    expected = case.expected(**HYPER_OTHER)
    case.run(**HYPER_OTHER)
    case.check(expected, "special values", nan_ok=True)


@NUMPY_NONFINITE
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(RULES))
def test_server_update_nonfinite_values_propagate_like_the_formulas(be, dtype, rule):
    """inf / NaN in x, D, m, v: the same values, NaN where the formulas give NaN."""
    case = ServerCase(be, rule, dtype, [(1025,), (77,)], seed=11)
    bad = [float("nan"), float("inf"), -float("inf")]
    for k, val in enumerate(bad):
        case.params[0][10 + k] = val
        case.updates[0][40 + k] = val
        if case.exp_avg:
            case.exp_avg[0][70 + k] = val
        if case.exp_avg_sq:
            case.exp_avg_sq[1][k] = abs(val)  # v = +inf, and v = +inf with D = +-inf below
        case.updates[1][k] = val
    expected = case.expected()
    case.run()
    case.check(expected, "non-finite", nan_ok=True)


@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_server_update_many_chunks(be, rule):
    # > 2048 chunks of the minimum size in total (a grown chunk size where chunks grow);
    # the big tensor spans many chunks, the small ones add a tail chunk each.
    case = ServerCase(be, rule, torch.float32, [(be.size(16_777_219, 20_011, host=1_000_003),), (7,), (3, 5)], seed=50)
    expected = case.expected()
    case.run()
    case.check(expected, "many chunks")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(RULES))
def test_server_update_matches_the_cpu_backend(be, dtype, rule):
    """The kernels evaluate the same math.h functions: the CPU backend's bits (where a
    backend is exact; the others against the oracle, as everywhere)."""
    case = ServerCase(be, rule, dtype, [(5,), (1025,), (be.size(70001, 4099),)], seed=60)
    expected = case.expected()
    host = [[t.detach().cpu().clone() for t in ts] for ts in (case.params, case.updates, case.exp_avg, case.exp_avg_sq)]
    cpu = backends.resolve("cpu", torch.device("cpu"))
    h = HYPER
    cpu.server_update_(*host, case.code, *split(h["lr"]), *split(h["gamma"]), h["beta1"], h["beta2"], h["tau"],
                       case.nesterov, None)
    case.run()
    if be.name == "reference" or (be.interpreted and dtype == torch.bfloat16):
        case.check(expected, "oracle")
    else:
        assert_bitwise(case.writable(), host[0] + host[2] + host[3], "CPU backend")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_server_update_no_elements_and_single_elements(be, dtype):
    acc = acc_of(dtype)
    for rule in RULES:
        code, nesterov = RULES[rule]
        be.server_update_([], [], [], [], code, 0.1, 1.0, 0.9, 0.99, 1e-3, nesterov, None)
        params = [torch.empty(0, dtype=dtype, device=be.device), torch.empty(3, 0, dtype=dtype, device=be.device)]
        updates = [torch.empty(0, dtype=acc, device=be.device), torch.empty(3, 0, dtype=acc, device=be.device)]
        m = [t.clone() for t in params] if code >= 1 else []
        v = [t.clone() for t in params] if code >= 2 else []
        be.server_update_(params, updates, m, v, code, 0.1, 1.0, 0.9, 0.99, 1e-3, nesterov,
                          torch.tensor(False, device=be.device))
        case = ServerCase(be, rule, dtype, [(1,), (0,), (0, 4)], seed=40 + code)
        expected = case.expected()
        case.run()
        case.check(expected, "single element")
