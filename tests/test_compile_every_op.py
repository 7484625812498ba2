"""Every public op compiles with ``torch.compile(fullgraph=True)`` on every backend and
equals eager (issue 12, item 2).

The compiler is ``aot_eager`` behind a frame counter: Dynamo must trace each op as one
node without a graph break (``fullgraph``), and AOTAutograd functionalizes the graph,
which is where a custom op that returns two views of one buffer, or whose fake kernel
disagrees with the real one, fails.  Each function is called with three tensor lr /
gamma values: one frame, no recompile.  Value checks that used to branch in Python on
CPU weights / gamma are graph nodes now, and still fail on bad values.
"""

from __future__ import annotations

import pytest
import torch
from conftest import require_backend
from torch._dynamo.testing import CompileCounterWithBackend

from fedopt_kernels import ops
from fedopt_kernels.ops import robust_aggregate as R


def _compiled(fn):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=counter, fullgraph=True), counter


def _randn(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _same(a, b, exact):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y, exact)
    elif exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(a, b, equal_nan=True)


def _check(fn_factory, values, device, exact=True):
    """``fn_factory(lr_tensor)`` -> (fn, state reset); compiled and eager runs from the
    same start give equal results for every value, with one compiled frame.  Bitwise for
    the kernel backends (the compiled graph calls the same kernels); the ``reference``
    backend's torch ops may be decomposed by AOTAutograd, so there to rounding."""
    lr = torch.tensor(values[0], device=device)
    fn, reset = fn_factory(lr)
    compiled, counter = _compiled(fn)
    for v in values:
        lr.fill_(v)
        reset()
        expected = fn()
        reset()
        got = compiled()
        _same(got, expected, exact)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


VALUES = (0.1, 0.05, 0.3)


def test_nar_step_(backend):
    name, dev = backend
    gen = torch.Generator().manual_seed(0)
    start = [_randn(gen, 1000, device=dev), _randn(gen, 7, 3, device=dev), _randn(gen, 0, device=dev)]
    grads = [_randn(gen, *p.shape, device=dev) * 3 for p in start]

    def factory(lr):
        params = [p.clone() for p in start]
        bufs = [torch.zeros_like(p) for p in start]

        def reset():
            for p, s, b in zip(params, start, bufs):
                p.copy_(s)
                b.zero_()

        def fn():
            st = ops.nar_step_(params, grads, lr=lr, weight_decay=0.01, max_norm=1.0, momentum=0.9,
                               momentum_buffers=bufs, backend=name)
            return [p.clone() for p in params], [b.clone() for b in bufs], tuple(st)
        return fn, reset

    _check(factory, VALUES, dev)


def test_nar_step_batched_(backend):
    name, dev = backend
    gen = torch.Generator().manual_seed(1)
    X0, G = _randn(gen, 3, 257, device=dev), _randn(gen, 3, 257, device=dev)

    def factory(lr):
        X = X0.clone()

        def reset():
            X.copy_(X0)

        def fn():
            st = ops.nar_step_batched_(X, G, lr=lr, weight_decay=0.01, max_norm=1.0, backend=name)
            return X.clone(), tuple(st)
        return fn, reset

    _check(factory, VALUES, dev)


def test_nar_step_groups_(backend):
    name, dev = backend
    gen = torch.Generator().manual_seed(2)
    start = [_randn(gen, 100, device=dev), _randn(gen, 33, device=dev)]
    grads = [_randn(gen, 100, device=dev), _randn(gen, 33, device=dev)]

    def factory(lr):
        params = [p.clone() for p in start]

        def reset():
            for p, s in zip(params, start):
                p.copy_(s)

        def fn():
            st = ops.nar_step_groups_([dict(params=params[:1], grads=grads[:1], lr=lr, weight_decay=0.01),
                                       dict(params=params[1:], grads=grads[1:], lr=lr, weight_decay=0.0)],
                                      max_norm=1.0, backend=name)
            return [p.clone() for p in params], tuple(st)
        return fn, reset

    _check(factory, VALUES, dev)


@pytest.mark.parametrize("form", ["2d", "list"])
@pytest.mark.parametrize("weights_on", ["device", "cpu"])
def test_aggregate(backend, form, weights_on):
    """Including CPU weights (a value check on the host before) and the robust second
    pass (``nonfinite="exclude"``) with a NaN client."""
    name, dev = backend
    gen = torch.Generator().manual_seed(3)
    X = _randn(gen, 5, 301, device=dev)
    X[3, 7] = float("nan")
    clients = X if form == "2d" else list(X.unbind(0))
    w = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], device=dev if weights_on == "device" else "cpu")

    def factory(gamma):
        def fn():
            out, st = ops.aggregate(clients, w, gamma=gamma, backend=name)
            return out, tuple(st)
        return fn, lambda: None

    _check(factory, (1.0, 0.9, 0.5), dev, exact=name != "reference")


def test_aggregate_bad_cpu_weights_still_fail_under_compile():
    X = torch.randn(3, 10)
    compiled, _ = _compiled(lambda w: ops.aggregate(X, w, backend="reference")[0])
    compiled(torch.tensor([1.0, 2.0, 3.0]))
    for bad in ([1.0, -2.0, 3.0], [1.0, float("nan"), 3.0], [0.0, 0.0, 0.0]):
        with pytest.raises(RuntimeError, match="weights must be finite, >= 0 and not all zero"):
            compiled(torch.tensor(bad))
    compiled_g, _ = _compiled(lambda g: ops.aggregate(X, torch.ones(3), gamma=g, backend="reference")[0])
    with pytest.raises(RuntimeError, match="gamma must be finite"):
        compiled_g(torch.tensor(-1.0))


def test_client_dots(backend):
    name, dev = backend
    gen = torch.Generator().manual_seed(4)
    X, g = _randn(gen, 4, 129, device=dev), _randn(gen, 129, device=dev)

    def factory(scale):
        def fn():
            return ops.client_dots(X, g * scale, backend=name), ops.client_dots(list(X.unbind(0)), g, backend=name)
        return fn, lambda: None

    _check(factory, VALUES, dev)


# one rule per robust kernel: coordinate_select (the median; trimmed mean and Bulyan
# call it the same way), client_gram then aggregate (Multi-Krum; the geometric median
# and centered clipping likewise)
ROBUST_RULES = {
    "coordinate_median": lambda X, name: R.coordinate_median(X, backend=name),
    "multi_krum": lambda X, name: R.multi_krum(list(X.unbind(0)), 1, 3, backend=name),
}


@pytest.mark.parametrize("name", ["cpu", "cuda"])
@pytest.mark.parametrize("rule", list(ROBUST_RULES))
def test_robust_rule(name, rule):
    """The robust aggregators reach their kernels (coordinate_select, client_gram,
    aggregate) through the same dispatcher: one graph, no recompile for new values,
    the same bits as eager.  On the C++ backends only: the graph holds the same routed
    ops whatever the backend (each backend's routed op against its fake kernel:
    tests/test_op_signatures.py), and tracing the rules costs ~8 s per backend here."""
    dev = require_backend(name)
    gen = torch.Generator().manual_seed(6)
    X = _randn(gen, 7, 53, device=dev)
    X[2, 5] = float("nan")  # left out by every rule

    def factory(scale):
        def fn():
            out, stats = ROBUST_RULES[rule](X * scale, name)
            return out, stats.excluded, stats.selected
        return fn, lambda: None

    _check(factory, VALUES, dev)


@pytest.mark.parametrize("form", ["2d", "list"])
def test_weighted_sum_forward_and_backward(backend, form):
    """FedLAW's server loss compiles as one graph with the op's forward and backward
    (custom-op autograd), and its gradients equal eager's."""
    name, dev = backend
    gen = torch.Generator().manual_seed(5)
    X = _randn(gen, 4, 203, device=dev)
    clients = X if form == "2d" else list(X.unbind(0))
    target = _randn(gen, 203, device=dev)

    w = torch.full((4,), 0.25, device=dev, requires_grad=True)
    gamma = torch.ones((), device=dev, requires_grad=True)

    def loss_fn():
        return (ops.weighted_sum(clients, w, gamma, backend=name) - target).square().sum()

    compiled, counter = _compiled(loss_fn)
    for value in (1.0, 0.8, 0.6):
        results = []
        for fn in (loss_fn, compiled):
            w.grad = gamma.grad = None
            with torch.no_grad():
                gamma.fill_(value)
            loss = fn()
            loss.backward()
            results.append((loss.detach(), w.grad.clone(), gamma.grad.clone()))
        (l_e, w_e, g_e), (l_c, w_c, g_c) = results
        torch.testing.assert_close(l_c, l_e)
        torch.testing.assert_close(w_c, w_e)
        torch.testing.assert_close(g_c, g_e)
        assert torch.count_nonzero(w_e) == 4  # a real gradient reaches every weight
    assert counter.frame_count == 1


@pytest.mark.parametrize("rule", ["sgd", "momentum", "adam"])
def test_server_update_(backend, rule):
    name, dev = backend
    gen = torch.Generator().manual_seed(6)
    start = [_randn(gen, 500, device=dev), _randn(gen, 9, device=dev)]
    updates = [_randn(gen, 500, device=dev), _randn(gen, 9, device=dev)]
    hyper = dict(sgd={}, momentum=dict(beta1=0.9), adam=dict(beta1=0.9, beta2=0.99, tau=1e-3))[rule]

    def factory(lr):
        params = [p.clone() for p in start]
        m = [torch.zeros_like(p) for p in start]
        v = [torch.zeros_like(p) for p in start]

        def reset():
            for p, s, a, b in zip(params, start, m, v):
                p.copy_(s)
                a.zero_()
                b.zero_()

        def fn():
            ops.server_update_(params, updates, rule=rule, lr=lr, exp_avg=m if rule != "sgd" else None,
                               exp_avg_sq=v if rule == "adam" else None, backend=name, **hyper)
            return [p.clone() for p in params], [a.clone() for a in m], [b.clone() for b in v]
        return fn, reset

    _check(factory, VALUES, dev)
