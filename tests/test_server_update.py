"""Every backend of ``ops.server_update_`` against python_ref (the one test matrix), a
hand-computed case, the skip flag, bad input and ``torch.compile``."""

from __future__ import annotations

import math

import pytest
import torch

import python_ref.server_optimizers as R
from _asserts import acc_of, bits
from _server_update_oracle import server_update_exact
from fedopt_kernels import backends, ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# rule, nesterov
RULES = [("sgd", False), ("momentum", False), ("momentum", True), ("adagrad", False), ("adam", False),
         ("yogi", False)]
HYPER = dict(beta1=0.8, beta2=0.95, tau=1e-2)
# Sizes straddle the kernels' chunks (64Ki on CPU) and vector widths; one tensor is empty.
SIZES = [(1,), (5,), (0,), (33, 31), (1025,), (70001,)]


def make_case(rule, dtype, device, sizes=SIZES, *, offset=3, seed=0):
    """params, the flat D with ``updates`` as views at an odd offset, and the state of
    ``rule`` (m small, v positive as a real second moment is)."""
    g = torch.Generator().manual_seed(seed)
    acc = acc_of(dtype)
    params = [torch.randn(s, generator=g).to(dtype).to(device) for s in sizes]
    total = sum(math.prod(s) for s in sizes)
    flat = (torch.randn(total + offset, generator=g) * 0.3).to(acc).to(device)
    updates, at = [], offset
    for s in sizes:
        n = math.prod(s)
        updates.append(flat[at:at + n].view(s))
        at += n
    m = [(torch.randn(s, generator=g) * 0.1).to(dtype).to(device) for s in sizes]
    v = [(torch.rand(s, generator=g) * 0.05 + 1e-4).to(dtype).to(device) for s in sizes]
    state = dict(sgd={}, momentum=dict(exp_avg=m))
    state = state.get(rule, dict(exp_avg=m, exp_avg_sq=v))
    return params, updates, state


def clone_case(params, state):
    return [p.clone() for p in params], {k: [t.clone() for t in ts] for k, ts in state.items()}


def tolerances(dtype, backend_name):
    # python_ref evaluates lr * m / denom as (lr * m) / denom and (1 - beta) * D with a
    # double (1 - beta): a few fp32 ulps apart from the kernels' order; reduced
    # precision differs by at most one rounding of the stored value.
    return {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=1e-5, atol=1e-6),
            torch.float16: dict(rtol=2e-3, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule,nesterov", RULES, ids=[f"{r}{'-nesterov' if n else ''}" for r, n in RULES])
def test_matches_reference(backend, rule, nesterov, dtype):
    name, device = backend
    interpreted = name == "triton" and backends.triton_interpret_mode()
    # Under the Triton interpreter 4099 instead of 70001 elements: still several blocks.
    params, updates, state = make_case(rule, dtype, device, SIZES[:-1] + [(4099,)] if interpreted else SIZES)
    p_f, s_f = clone_case(params, state)
    kw = dict(rule=rule, lr=0.3, gamma=0.9, nesterov=nesterov, **HYPER)
    # The oracle: the contract's arithmetic written out in tests/_server_update_oracle.py
    # (not python_ref, which IS the reference backend), state stored in the param dtype.
    p_r = [p.cpu().clone() for p in params]
    s_r = {k: [t.cpu().clone() for t in ts] for k, ts in state.items()}
    code = dict(sgd=0, momentum=1, adagrad=2, adam=3, yogi=4)[rule]
    for _ in range(2):  # the second round reads the state the first one wrote
        ops.server_update_(p_f, updates, backend=name, **s_f, **kw)
        for k, d in enumerate(updates):
            m = s_r["exp_avg"][k] if "exp_avg" in s_r else None
            v = s_r["exp_avg_sq"][k] if "exp_avg_sq" in s_r else None
            x, m, v = server_update_exact(code, nesterov, p_r[k], d.cpu(), m, v, lr=0.3, gamma=0.9, **HYPER)
            p_r[k] = x.to(dtype)
            if m is not None:
                s_r["exp_avg"][k] = m.to(dtype)
            if v is not None:
                s_r["exp_avg_sq"][k] = v.to(dtype)
    for a, b, p in zip(p_f, p_r, params):
        assert a.dtype == dtype and a.shape == p.shape
        torch.testing.assert_close(a.cpu(), b, **tolerances(dtype, name))
    for key in s_f:
        for a, b in zip(s_f[key], s_r[key]):
            torch.testing.assert_close(a.cpu(), b, **tolerances(dtype, name))
    changed = [not torch.equal(a, p) for a, p in zip(p_f, params) if p.numel()]
    assert all(changed)


@pytest.mark.parametrize("rule,nesterov", RULES, ids=[f"{r}{'-nesterov' if n else ''}" for r, n in RULES])
def test_tensor_hyperparameters_equal_floats(backend, rule, nesterov):
    """lr and gamma held in 0-d device tensors (FedExP's and ASNES's adaptive lr) give the
    same bits as the same values passed as floats."""
    name, device = backend
    params, updates, state = make_case(rule, torch.float32, device, sizes=[(7,), (300,)])
    p_a, s_a = clone_case(params, state)
    p_b, s_b = clone_case(params, state)
    lr, gamma = 0.375, 0.875  # exact in fp32, so float and tensor are the same number
    ops.server_update_(p_a, updates, rule=rule, lr=lr, gamma=gamma, nesterov=nesterov, backend=name, **s_a,
                       **HYPER)
    ops.server_update_(p_b, updates, rule=rule, lr=torch.tensor(lr, device=device),
                       gamma=torch.tensor(gamma, device=device), nesterov=nesterov, backend=name, **s_b, **HYPER)
    for a, b in zip(p_a + sum(s_a.values(), []), p_b + sum(s_b.values(), [])):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("rule", ["sgd", "momentum", "adam", "yogi"])
def test_skip_writes_nothing(backend, rule):
    name, device = backend
    params, updates, state = make_case(rule, torch.bfloat16, device)
    p, s = clone_case(params, state)
    ops.server_update_(p, updates, rule=rule, lr=0.3, skip=torch.tensor(True, device=device), backend=name, **s,
                       **HYPER)
    for a, b in zip(p + sum(s.values(), []), params + sum(state.values(), [])):
        assert torch.equal(bits(a), bits(b))
    p2, s2 = clone_case(params, state)
    ops.server_update_(p, updates, rule=rule, lr=0.3, skip=torch.tensor(False, device=device), backend=name, **s,
                       **HYPER)
    ops.server_update_(p2, updates, rule=rule, lr=0.3, backend=name, **s2, **HYPER)
    for a, b in zip(p + sum(s.values(), []), p2 + sum(s2.values(), [])):
        assert torch.equal(bits(a), bits(b))


def test_hand_computed_adam_and_yogi(backend):
    """One element in fp64 against numbers worked out with Python's math module."""
    name, device = backend
    x0, d, tau, lr, b1, b2 = 1.0, 0.5, 1e-3, 0.1, 0.9, 0.99
    for rule in ("adam", "yogi"):
        x = torch.tensor([x0], dtype=torch.float64, device=device)
        m = torch.zeros(1, dtype=torch.float64, device=device)
        v = torch.full((1,), tau * tau, dtype=torch.float64, device=device)
        ops.server_update_([x], [torch.tensor([d], dtype=torch.float64, device=device)], rule=rule, lr=lr,
                           beta1=b1, beta2=b2, tau=tau, exp_avg=[m], exp_avg_sq=[v], backend=name)
        m_exp = (1 - b1) * d  # 0.05
        if rule == "adam":
            v_exp = b2 * tau * tau + (1 - b2) * d * d  # 0.00250099
        else:  # v < d^2, so sign(v - d^2) = -1: v grows by (1 - b2) d^2
            v_exp = tau * tau + (1 - b2) * d * d  # 0.002501
        x_exp = x0 - lr * m_exp / (math.sqrt(v_exp) + tau)
        assert m.item() == pytest.approx(m_exp, rel=1e-15)
        assert v.item() == pytest.approx(v_exp, rel=1e-14)
        assert x.item() == pytest.approx(x_exp, rel=1e-14)
    # The two rules only differ in v, and Yogi's grows more slowly than Adam's here.
    assert (tau * tau + (1 - b2) * d * d) > (b2 * tau * tau + (1 - b2) * d * d)


def test_matches_python_ref_flat_vectors(backend):
    """A model split into tensors steps exactly like python_ref's formula on the one flat
    vector (fp64): splitting changes nothing, elementwise."""
    name, device = backend
    sizes = [(4, 5), (4,), (3, 4), (3,)]
    params, updates, state = make_case("adam", torch.float64, device, sizes=sizes, offset=0)
    x = torch.cat([p.reshape(-1) for p in params]).cpu()
    D = torch.cat([u.reshape(-1) for u in updates]).cpu()
    m = torch.cat([t.reshape(-1) for t in state["exp_avg"]]).cpu()
    v = torch.cat([t.reshape(-1) for t in state["exp_avg_sq"]]).cpu()
    ops.server_update_(params, updates, rule="adam", lr=0.05, backend=name, **state, **HYPER)
    x_ref, m_ref, v_ref = R.fedadam(x, D, m, v, lr=0.05, betas=(HYPER["beta1"], HYPER["beta2"]), tau=HYPER["tau"])
    torch.testing.assert_close(torch.cat([p.reshape(-1).cpu() for p in params]), x_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat([t.reshape(-1).cpu() for t in state["exp_avg_sq"]]), v_ref,
                               rtol=1e-12, atol=1e-16)


def test_empty_lists_and_empty_tensors(backend):
    name, device = backend
    ops.server_update_([], [], rule="adam", lr=0.1, tau=1e-3, exp_avg=[], exp_avg_sq=[], backend=name)
    params, updates, state = make_case("adam", torch.float32, device, sizes=[(0,), (0, 3)])
    ops.server_update_(params, updates, rule="adam", lr=0.1, backend=name, **state, **HYPER)
    assert all(p.numel() == 0 for p in params)


def _bad_calls():
    """(description, kwargs changes, exception, message) of invalid calls."""
    return [
        ("rule", dict(rule="adamw"), ValueError, "rule must be one of"),
        ("missing exp_avg_sq", dict(exp_avg_sq=None), ValueError, "exp_avg_sq is required"),
        ("lr < 0", dict(lr=-0.1), ValueError, "lr must satisfy"),
        ("beta1 = 1", dict(beta1=1.0), ValueError, "beta1 must satisfy"),
        ("beta2 nan", dict(beta2=float("nan")), ValueError, "beta2 must be finite"),
        ("tau = 0", dict(tau=0.0), ValueError, "tau must satisfy"),
        ("gamma <= 0", dict(gamma=0.0), ValueError, "gamma must satisfy"),
        ("skip not bool", dict(skip=torch.tensor(1.0)), ValueError, "skip must be a bool tensor"),
        ("lr tensor shape", dict(lr=torch.tensor([0.1, 0.2])), ValueError, "lr as a tensor must have shape"),
        ("backend", dict(backend="tpu"), ValueError, "backend must be one of"),
    ]


@pytest.mark.parametrize("what,change,exc,match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_arguments_raise_and_modify_nothing(what, change, exc, match):
    params, updates, state = make_case("adam", torch.float32, "cpu", sizes=[(5,), (7,)])
    p, s = clone_case(params, state)
    kw = dict(rule="adam", lr=0.1, exp_avg=s["exp_avg"], exp_avg_sq=s["exp_avg_sq"], **HYPER)
    kw.update(change)
    with pytest.raises(exc, match=match):
        ops.server_update_(p, updates, **kw)
    for a, b in zip(p + sum(s.values(), []), params + sum(state.values(), [])):
        assert torch.equal(a, b)


def test_bad_tensors_are_named():
    params, updates, state = make_case("adam", torch.float32, "cpu", sizes=[(5,), (6, 7)])
    kw = dict(rule="adam", lr=0.1, **state, **HYPER)
    with pytest.raises(ValueError, match=r"updates\[1\] has 41 elements but params\[1\] has 42"):
        ops.server_update_(params, [updates[0], updates[1].reshape(-1)[:41]], **kw)
    with pytest.raises(ValueError, match=r"updates\[0\] has dtype torch.float16; updates must be in the "
                                         r"accumulation dtype torch.float32"):
        ops.server_update_(params, [updates[0].half(), updates[1]], **kw)
    with pytest.raises(ValueError, match=r"updates has 1 tensors but params has 2"):
        ops.server_update_(params, updates[:1], **kw)
    with pytest.raises(ValueError, match=r"params\[1\] must be contiguous"):
        ops.server_update_([params[0], params[1].t()], updates, **kw)
    with pytest.raises(ValueError, match=r"exp_avg\[0\] has shape \(4,\) but params\[0\] has shape \(5,\)"):
        ops.server_update_(params, updates, **{**kw, "exp_avg": [torch.zeros(4), state["exp_avg"][1]]})
    with pytest.raises(ValueError, match=r"params must share one dtype"):
        ops.server_update_([params[0], params[1].double()], updates, **kw)


def test_torch_compile_fullgraph_tensor_lr_without_recompiles():
    """The op is one custom-op node: a compiled server step takes a new lr from a 0-d
    tensor without recompiling and matches eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    params, updates, state = make_case("adam", torch.float32, "cpu", sizes=[(9,), (4, 4)])
    p_e, s_e = clone_case(params, state)
    lr = torch.tensor(0.1)

    def step(p, u, m, v, lr):
        ops.server_update_(p, u, rule="adam", lr=lr, exp_avg=m, exp_avg_sq=v, **HYPER)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for value in (0.1, 0.05, 0.2, 0.01, 0.3):
        lr.fill_(value)
        compiled(params, updates, state["exp_avg"], state["exp_avg_sq"], lr)
        ops.server_update_(p_e, updates, rule="adam", lr=value, **s_e, **HYPER)
        for a, b in zip(params, p_e):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert counter.frame_count == 1
